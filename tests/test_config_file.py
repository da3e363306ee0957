"""The configuration file: every table loads into the runtime's services, and every
problem is refused at load naming the file, the key and what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import structlog
from aalis_agent.events import ConfigError, ModelRef
from aalis_agent.services.config_file import load_config, parse_config
from aalis_agent.services.models import entry_id, think_levels
from aalis_agent.services.openai_compat import OpenAICompatibleModel

from tests.harness import run_cli

FULL = """
[agent]
systemPrompt = "你是助手。"
historyLimit = 40
maxToolIterations = 6

[servicePreferences]
llm = "local/small"

[pluginServicePreferences.agent]
llm = "remote/gpt"

[providers.local]
type = "scripted"
reply = "本地。"
priority = 5
[[providers.local.models]]
id = "small"
name = "Small"
contextLength = 8192
thinkLevels = [{ id = "low", name = "浅" }, "high"]
defaultThink = "high"

[providers.remote]
baseUrl = "http://127.0.0.1:9/v1"
apiKey = "sk-file-secret"
timeoutMs = 5000
maxReplyMs = 600000
maxRetries = 1
[[providers.remote.models]]
id = "gpt"
contextLength = 64000
maxOutputTokens = 2048
thinkLevels = [{ id = "deep", name = "深", effort = "high" }]

[platforms]
"qq-main" = "onebot"

[settings.platform."qq-main"]
historyLimit = 10
[settings.platformType.onebot]
maxToolIterations = 3
[settings.venue."qq-main:5"]
think = "deep"

[personas.helper]
name = "小助手"
prompt = "你是小助手。"
default = true
[personas.cat]
prompt = "喵。"
"""


def write(tmp_path: Path, text: str, name: str = "aalis.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_a_full_file_loads_every_table(tmp_path: Path) -> None:
    fc = load_config(write(tmp_path, FULL))
    assert fc.config.system_prompt == "你是助手。"
    assert (fc.config.history_limit, fc.config.max_tool_iterations) == (40, 6)
    # Providers and models, in the order of their priority.
    assert [entry_id(m) for m in fc.llm.models()] == ["local/small", "remote/gpt"]
    small, gpt = fc.llm.models()
    assert (small.context_length, small.max_output_tokens) == (8192, 4096)
    assert [(lv.id, lv.label) for lv in think_levels(small)] == [("low", "浅"), ("high", "high")]
    assert isinstance(gpt, OpenAICompatibleModel)
    assert (gpt.context_length, gpt.max_output_tokens) == (64000, 2048)
    assert (gpt.max_reply_s, gpt.max_retries) == (600.0, 1)
    # Preferences: this plugin's wins over the global one.
    assert fc.llm.plugin_preference == ModelRef(provider="remote", model="gpt")
    assert fc.llm.global_preference == ModelRef(provider="local", model="small")
    assert entry_id(fc.llm.preferred()) == "remote/gpt"
    # Settings layers: platform, its type (from [platforms]) and the venue.
    s = fc.settings.for_turn("s", "qq-main", {}, "qq-main:5")
    assert (s.history_limit, s.max_tool_iterations, s.think) == (10, 3, "deep")
    assert fc.settings.for_turn("s", "tg", {}).history_limit == 40
    # Personas, with the default.
    assert fc.personas is not None
    assert fc.personas.list() == [("cat", "cat"), ("helper", "小助手")]
    assert fc.personas.prompt(None) == "你是小助手。"
    services = fc.services()
    assert services.models is fc.llm and services.persona is fc.personas
    assert services.resolver is fc.settings


def test_the_api_key_is_never_shown(tmp_path: Path) -> None:
    fc = load_config(write(tmp_path, FULL))
    shown = repr(fc) + repr(fc.llm.models()) + str(fc.services())
    assert "sk-file-secret" not in shown


def test_the_key_comes_from_the_variable_the_file_names(tmp_path: Path) -> None:
    text = """
[providers.p]
baseUrl = "http://127.0.0.1:9/v1"
apiKeyEnv = "MY_KEY"
[[providers.p.models]]
id = "m"
"""
    fc = load_config(write(tmp_path, text), env={"MY_KEY": "sk-env"})
    model = fc.llm.models()[0]
    assert isinstance(model, OpenAICompatibleModel)
    assert model._headers["Authorization"] == "Bearer sk-env"
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), env={})
    assert str(err.value) == (
        f"{tmp_path / 'aalis.toml'}: providers.p.apiKeyEnv: "
        "the environment variable MY_KEY is not set"
    )


def test_a_provider_without_a_key_does_not_borrow_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-someone-elses")
    text = (
        '[providers.ollama]\nbaseUrl = "http://127.0.0.1:9/v1"\n'
        '[[providers.ollama.models]]\nid = "q"\n'
    )
    model = load_config(write(tmp_path, text)).llm.models()[0]
    assert isinstance(model, OpenAICompatibleModel)
    assert model._headers["Authorization"] == "Bearer not-needed"


def test_an_llm_key_in_the_plugin_config_is_warned_about_and_ignored(tmp_path: Path) -> None:
    text = '[agent]\nllm = "a/b"\nhistoryLimit = 2\n'
    with structlog.testing.capture_logs() as logs:
        fc = load_config(write(tmp_path, text))
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert len(warnings) == 1 and "llm" in warnings[0]["event"]
    assert fc.config.history_limit == 2
    assert fc.llm.plugin_preference is None and fc.llm.global_preference is None


def test_an_empty_file_is_the_embedded_defaults(tmp_path: Path) -> None:
    fc = load_config(write(tmp_path, ""))
    assert fc.config.history_limit == 0 and fc.llm.models() == [] and fc.personas is None
    assert fc.settings.for_turn("s", "qq", {"historyLimit": 3}).history_limit == 3


BAD: list[tuple[str, str, str]] = [
    ("colour = 1", "colour", "unknown key"),
    ("[agent]\nhistoryLimit = -1", "agent", "historyLimit must be >= 0"),
    ("[agent]\nsystemPromt = 'x'", "agent", 'unknown key "systemPromt"'),
    ("[servicePreferences]\nllm = 'nomodel'", "servicePreferences.llm", "<provider>/<model>"),
    ("[pluginServicePreferences.agent]\nllm = '/m'", "pluginServicePreferences.agent.llm", ""),
    ("[pluginServicePreferences.other]\nllm = 'a/b'", "pluginServicePreferences.other", ""),
    ("[providers.p]\ntype = 'magic'", "providers.p.type", "expected one of"),
    ("[providers.p]\ntype = 'scripted'", "providers.p", "no models"),
    ("[providers.p]\n[[providers.p.models]]\nid = 'm'", "providers.p.baseUrl", "required"),
    (
        "[providers.p]\nbaseUrl = 'not a url'\n[[providers.p.models]]\nid = 'm'",
        "providers.p.baseUrl",
        'expected an http:// or https:// URL with a host, got "not a url"',
    ),
    (
        "[providers.p]\nbaseUrl = 'ftp://h/v1'\n[[providers.p.models]]\nid = 'm'",
        "providers.p.baseUrl",
        "expected an http:// or https:// URL",
    ),
    (
        "[providers.p]\ntype = 'scripted'\n[[providers.p.models]]\nname = 'x'",
        "providers.p.models[0].id",
        "required",
    ),
    (
        "[providers.p]\ntype = 'scripted'\n[[providers.p.models]]\nid = 'm'\ncontextLength = 'big'",
        "providers.p.models[0].contextLength",
        'expected an integer, got text ("big")',
    ),
    (
        "[providers.p]\ntype = 'scripted'\n[[providers.p.models]]\nid = 'm'\ndefaultThink = 'x'",
        "providers.p.models[0].defaultThink",
        "not one of thinkLevels",
    ),
    (
        "[providers.p]\ntype = 'scripted'\n[[providers.p.models]]\nid = 'm'\n"
        "[[providers.p.models]]\nid = 'm'",
        "providers.p.models",
        '"m" is listed twice',
    ),
    (
        "[providers.p]\ntype = 'scripted'\nbaseUrl = 'http://x'\n[[providers.p.models]]\nid = 'm'",
        "providers.p.baseUrl",
        "not used by a scripted provider",
    ),
    ("[settings.platform.qq]\nhistoryLimit = 'lots'", "settings.platform.qq.historyLimit", ""),
    (
        "[settings.venue.'qq:1']\nmaxToolIterations = 0",
        'settings.venue."qq:1".maxToolIterations: ',
        "",
    ),
    ("[settings.platformType.onebot]\ncolour = 1", "settings.platformType.onebot.colour", ""),
    ("[settings.room.x]\nthink = 'a'", "settings.room", "unknown key"),
    ("[platforms]\nqq = 3", "platforms.qq", "expected a platform type"),
    (
        "[providers.p]\ntype = 'scripted'\n[[providers.p.models]]\nid = 'm'\n"
        "[[providers.p.models.thinkLevels]]\nid = 'hi'\ncolour = 'red'",
        "providers.p.models[0].thinkLevels[0].colour",
        "unknown key (known: effort, id, name)",
    ),
    (
        "[providers.p]\ntype = 'scripted'\n[[providers.p.models]]\nid = 'm'\nthinkLevels = [3]",
        "providers.p.models[0].thinkLevels[0]",
        "expected non-empty text or a table, got a number (3)",
    ),
    (
        "[providers.p]\ntype = 'scripted'\npriority = 2000000\n[[providers.p.models]]\nid = 'm'",
        "providers.p.priority",
        "",
    ),
    ("[personas.a]\nname = 'A'", "personas.a.prompt", "required"),
    (
        "[personas.a]\nprompt = 'x'\ndefault = true\n[personas.b]\nprompt = 'y'\ndefault = true",
        "personas.b.default",
        "already the default",
    ),
]


@pytest.mark.parametrize(("text", "key", "problem"), BAD)
def test_bad_files_are_refused_naming_file_key_and_problem(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message
    assert key in message and problem in message, message


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[providers."a/b"]\ntype = "scripted"', 'providers."a/b": '),
        ('[providers.""]\ntype = "scripted"', 'providers."": '),
        ("[settings.venue.'qq:1']\nthink = 1", 'settings.venue."qq:1".think: '),
        ('[settings.platform."qq 2"]\n"max tool" = 1', 'settings.platform."qq 2"."max tool": '),
        ("[settings.platform.qq_2-x]\nlocal = 1", "settings.platform.qq_2-x.local: "),
        ('[platforms."on.bot"]\nx = 1', 'platforms."on.bot": '),
        ('[personas."a b"]\nprompt = 1', 'personas."a b".prompt: '),
        ('[mcp."a:b"]\nurl = "http://h"\nheaders = {"X Key" = 1}', 'mcp."a:b".headers."X Key": '),
    ],
)
def test_a_key_path_is_quoted_where_toml_needs_it(tmp_path: Path, text: str, key: str) -> None:
    """An error names its key as the file would write it: a part that is not a bare key
    (A-Za-z0-9_- only) is quoted (settings.venue."qq:1".think, providers."a/b")."""
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: {key}"), str(err.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[settings.venue."qq:1"]\nhistoryLimit = 18446744073709551616',
            'settings.venue."qq:1".historyLimit: integer out of range: it must fit in 64 bits '
            "(-9223372036854775808 to 9223372036854775807)",
        ),
        (
            '[settings.venue."a/b"]\nx = ' + "[" * 65 + "]" * 65,
            'settings.venue."a/b".x: nested deeper than 64 levels (line 2)',
        ),
        (
            '[settings.venue."房间 1"]\n"a\\tb".c = ' + "[" * 65 + "]" * 65,
            'settings.venue."房间 1"."a\\tb".c: nested deeper than 64 levels (line 2)',
        ),
        (
            "[personas.'a\\b']\nname = " + "[" * 65 + "]" * 65,
            'personas."a\\\\b".name: nested deeper than 64 levels (line 2)',
        ),
        (
            '[providers.p]\ntype = "scripted"\n"bad key" = 1',
            'providers.p."bad key": unknown key (known: apiKey, apiKeyEnv, baseUrl, listModels, '
            "maxReplyMs, maxRetries, models, priority, reply, timeoutMs, type)",
        ),
    ],
)
def test_a_key_path_from_the_log_checks_is_quoted_as_toml(
    tmp_path: Path, text: str, message: str
) -> None:
    """The checks for what the log cannot hold (too deep, out of 64 bits) and msgspec's
    unknown keys name the key as TOML writes it, as every other error does: a basic
    string's escapes read and written again ("a\\tb"), a literal string's backslash
    escaped ('a\\b' is "a\\\\b")."""
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: {message}"


def test_a_parsed_mapping_names_a_key_toml_quotes_quoted() -> None:
    data: dict[str, Any] = {"settings": {"venue": {"qq:1": {"think": "\ud800"}}}}
    with pytest.raises(ConfigError) as err:
        parse_config(data, file="inline")
    assert str(err.value) == (
        'inline: settings.venue."qq:1".think: text that is not valid Unicode (a lone surrogate)'
    )
    data = {"providers": {"k" * 100: {"x\ud800": 1}}}
    with pytest.raises(ConfigError) as err:
        parse_config(data, file="inline")
    assert str(err.value) == (
        f'inline: providers.{"k" * 60}...."x\\ud800": text that is not valid Unicode '
        "(a lone surrogate)"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[providers."a/b"]\ntype = "scripted"',
            'providers."a/b": a provider id must be non-empty and without "/"',
        ),
        (
            '[personas."a b"]\nprompt = "x"\ndefault = true\n'
            '[personas.c]\nprompt = "y"\ndefault = true',
            'personas.c.default: "a b" is already the default persona',
        ),
        (
            '[settings.venue."qq:1"]\nenabledToolGroups = [1]',
            'settings.venue."qq:1".enabledToolGroups: venue "qq:1" setting "enabledToolGroups": '
            'expected a list of group names ("*" for all)',
        ),
        (
            '[settings.venue."qq:1"]\nhistoryLimit = "5"',
            'settings.venue."qq:1".historyLimit: venue "qq:1" setting "historyLimit": must be '
            'an integer, not a string: "5"',
        ),
        (
            "[agent]\n\"system prompt\" = 'x'",
            'agent: unknown key "system prompt" (known: historyLimit, locale, maxToolIterations, '
            "memoryTokenBudget, promptBuildTimeoutMs, systemPrompt, think, toolResultMaxRatio, "
            "trimThresholdRatio)",
        ),
    ],
)
def test_names_and_hints_are_spelled_as_toml(tmp_path: Path, text: str, message: str) -> None:
    """A name the file gave (a venue, a persona, a key) and a hint at what to write are
    TOML strings in an error ("qq:1", "/", "*"), not Python's ('qq:1', '/', '*')."""
    path = write(tmp_path, text + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: {message}"


def test_the_layer_is_named_for_a_bad_setting(tmp_path: Path) -> None:
    path = write(tmp_path, "[settings.platform.qq]\nhistoryLimit = -2\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f'{path}: settings.platform.qq.historyLimit: platform profile "qq" setting '
        '"historyLimit": must be >= 0, got -2'
    )


def test_syntax_errors_and_missing_files_name_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[agent\nhistoryLimit = 1\n")
    with pytest.raises(ConfigError, match=r"not valid TOML.*line 1"):
        load_config(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.toml")


def test_parse_config_checks_an_already_parsed_mapping() -> None:
    data: dict[str, Any] = {"agent": {"historyLimit": True}}
    with pytest.raises(ConfigError, match=r"^inline: agent.historyLimit must be an integer"):
        parse_config(data, file="inline")


def test_the_documented_example_loads() -> None:
    example = Path(__file__).resolve().parent.parent / "docs" / "examples" / "aalis-agent.toml"
    fc = load_config(example, env={"DEEPSEEK_API_KEY": "sk-example"})
    assert entry_id(fc.llm.preferred()) == "deepseek/deepseek-chat"
    assert fc.settings.for_turn("s", "qq-main", {}, "qq-main:123456").max_tool_iterations == 5


def test_the_config_command_shows_what_the_file_gives(tmp_path: Path) -> None:
    path = write(tmp_path, FULL.replace('llm = "remote/gpt"', 'llm = "remote/gone"'))
    result = run_cli("config", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"{path}: ok"
    assert (
        "  local/small  Small · context 8192 · max output 4096; think low (浅), high, default high"
    ) in lines
    assert "this plugin's preference: remote/gone (MISSING: falls back)" in lines
    assert "a session without an llm setting uses: local/small (global-preference)" in lines
    assert "platform-type profile 'onebot': maxToolIterations 3" in lines
    assert "venue 'qq-main:5': think deep" in lines
    assert "personas: cat, helper (default)" in lines
    assert "sk-file-secret" not in result.stdout + result.stderr


def test_the_config_command_refuses_a_bad_file_with_its_key(tmp_path: Path) -> None:
    path = write(tmp_path, "[providers.p]\ntype = 'magic'\n")
    result = run_cli("config", str(path))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"aalis-agent config: error: {path}: providers.p.type:")


def test_a_key_pasted_into_api_key_env_is_not_echoed(tmp_path: Path) -> None:
    text = '[providers.p]\nbaseUrl = "https://x/v1"\napiKeyEnv = "sk-abc-123"\n'
    text += '[[providers.p.models]]\nid = "m"\n'
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text), env={})
    assert "providers.p.apiKeyEnv: must name an environment variable" in str(err.value)
    assert "sk-abc-123" not in str(err.value)


def test_the_config_command_lists_missing_key_variables(tmp_path: Path) -> None:
    text = '[providers.p]\nbaseUrl = "https://x/v1"\napiKeyEnv = "UNSET_KEY_VAR"\n'
    text += '[[providers.p.models]]\nid = "m"\n'
    path = write(tmp_path, text)
    result = run_cli("config", str(path), env={"PATH": "/usr/bin:/bin"})
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"{path}: valid, but keys are missing"
    assert (
        f"not usable here: {path}: providers.p.apiKeyEnv: the environment variable "
        "UNSET_KEY_VAR is not set"
    ) in lines
    assert "  p/m  m · context 128000 · max output 4096" in lines
    with pytest.raises(ConfigError, match="UNSET_KEY_VAR is not set"):
        load_config(path, env={})  # chat's way: refused


# --- what the log cannot hold, and input nested past a sane depth --------------------------

SCRIPTED = "[providers.p]\ntype = 'scripted'\n[[providers.p.models]]\nid = 'm'\n"

HOSTILE: list[tuple[str, str, str, str]] = [
    (
        "historyLimit-beyond-64-bits",
        "[agent]\nhistoryLimit = 99999999999999999999",
        "agent.historyLimit",
        "integer out of range: it must fit in 64 bits",
    ),
    (
        "layer-historyLimit-beyond-64-bits",
        "[settings.platform.qq]\nhistoryLimit = 99999999999999999999",
        "settings.platform.qq.historyLimit",
        "integer out of range",
    ),
    (
        "negative-beyond-64-bits",
        "[providers.p]\npriority = -99999999999999999999",
        "providers.p.priority",
        "integer out of range",
    ),
    (
        "memoryTokenBudget",
        "[agent]\nmemoryTokenBudget = 9223372036854775807",
        "agent",
        "memoryTokenBudget must be <= 1000000000",
    ),
    (
        "promptBuildTimeoutMs",
        "[agent]\npromptBuildTimeoutMs = 9000000000000",
        "agent",
        "promptBuildTimeoutMs must be <= 2147483647",
    ),
    (
        "trimThresholdRatio",
        "[agent]\ntrimThresholdRatio = 1e300",
        "agent",
        "trimThresholdRatio must be <= 1000",
    ),
    (
        "contextLength",
        SCRIPTED + "contextLength = 9223372036854775807",
        "providers.p.models[0].contextLength",
        "must be <= 1000000000",
    ),
    (
        "maxOutputTokens",
        SCRIPTED + "maxOutputTokens = 10000000000",
        "providers.p.models[0].maxOutputTokens",
        "must be <= 1000000000",
    ),
    (
        "timeoutMs",
        "[providers.p]\nbaseUrl = 'http://x'\ntimeoutMs = 9223372036854775807\n"
        "[[providers.p.models]]\nid = 'm'",
        "providers.p.timeoutMs",
        "must be <= 2147483647",
    ),
    (
        "maxReplyMs",
        "[providers.p]\nbaseUrl = 'http://x'\nmaxReplyMs = 0\n[[providers.p.models]]\nid = 'm'",
        "providers.p.maxReplyMs",
        "must be >= 1",
    ),
    (
        "maxRetries",
        "[providers.p]\nbaseUrl = 'http://x'\nmaxRetries = -1\n[[providers.p.models]]\nid = 'm'",
        "providers.p.maxRetries",
        "must be >= 0",
    ),
    (
        "scripted-maxRetries",
        "[providers.p]\ntype = 'scripted'\nmaxRetries = 2\n[[providers.p.models]]\nid = 'm'",
        "providers.p.maxRetries",
        "not used by a scripted provider",
    ),
    (
        "priority",
        "[providers.p]\npriority = 10000000000",
        "providers.p.priority",
        "must be <= 1000000",
    ),
    (
        "long-think-id",
        "[settings.venue.x]\nthink = '" + "t" * 300 + "'",
        "settings.venue.x.think",
        "at most 256 characters",
    ),
    (
        "deep-array",
        "[agent]\nsystemPrompt = " + "[" * 2000 + "]" * 2000,
        "agent.systemPrompt",
        "nested deeper than 64 levels (line 2)",
    ),
    (
        "deep-inline-table",
        "[settings.venue.x]\n\nenabledToolGroups = " + "{a=" * 1000 + "1" + "}" * 1000,
        "settings.venue.x.enabledToolGroups",
        "nested deeper than 64 levels (line 3)",
    ),
    (
        "deep-model-table",
        SCRIPTED + "[[providers.p.models]]\nthinkLevels = [" + "[" * 100 + "]" * 100 + "]",
        "providers.p.models[1].thinkLevels",
        "nested deeper than 64 levels (line 6)",
    ),
    (
        "deep-dotted-key",
        "[agent]\n" + ".".join(["k"] * 1000) + " = 1",
        "agent.k.k.k.k",
        "nested deeper than 64 levels",
    ),
    (
        "deep-header",
        "[" + ".".join(["t"] * 1000) + "]\nx = 1",
        "t.t.t.t",
        "nested deeper than 64 levels",
    ),
]


@pytest.mark.parametrize(
    ("text", "key", "problem"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_what_the_log_cannot_hold_is_refused_at_load_naming_file_and_key(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {key}"), message[:300]
    assert problem in message and len(message) < 500, message[:300]


def test_the_config_command_refuses_a_setting_the_log_cannot_hold(tmp_path: Path) -> None:
    path = write(tmp_path, "[agent]\nhistoryLimit = 99999999999999999999\n")
    result = run_cli("config", str(path))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"aalis-agent config: error: {path}: agent.historyLimit:")
    path = write(tmp_path, "[agent]\nsystemPrompt = " + "[" * 5000 + "]" * 5000 + "\n")
    result = run_cli("config", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "agent.systemPrompt: nested deeper than 64 levels" in result.stderr


def test_the_64_bit_limits_themselves_load(tmp_path: Path) -> None:
    text = "[agent]\nhistoryLimit = 9223372036854775807\nmaxToolIterations = 9223372036854775807\n"
    text += "[settings.venue.x]\nhistoryLimit = 9223372036854775807\n"
    fc = load_config(write(tmp_path, text))
    assert fc.config.history_limit == 2**63 - 1
    assert fc.settings.for_turn("s", None, {}, "x").history_limit == 2**63 - 1


def test_a_file_that_is_not_utf8_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "latin.toml"
    path.write_bytes(b"[agent]\nsystemPrompt = '\xe9'\n")
    with pytest.raises(ConfigError, match=r"not UTF-8 text"):
        load_config(path)


def test_an_already_parsed_mapping_is_checked_the_same_way() -> None:
    data: dict[str, Any] = {"personas": {"a": {"prompt": "\ud800"}}}
    with pytest.raises(ConfigError) as err:
        parse_config(data, file="inline")
    assert str(err.value) == (
        "inline: personas.a.prompt: text that is not valid Unicode (a lone surrogate)"
    )
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(
        ConfigError, match=r"^inline: agent\.systemPrompt\[0\]\[0\].*: nested deeper"
    ):
        parse_config({"agent": {"systemPrompt": deep}}, file="inline")


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        ("historyLimit = true", "agent.historyLimit must be an integer, got true"),
        ("historyLimit = 'many'", 'agent.historyLimit must be an integer, got "many"'),
        ("historyLimit = 1.5", "agent.historyLimit must be an integer, got 1.5"),
        ("historyLimit = [1, 'a']", 'agent.historyLimit must be an integer, got [1, "a"]'),
        ("historyLimit = {a = false}", "agent.historyLimit must be an integer, got {a = false}"),
        ("historyLimit = 2020-01-02", "agent.historyLimit must be an integer, got 2020-01-02"),
        ("maxToolIterations = false", "agent.maxToolIterations must be an integer, got false"),
        ("toolResultMaxRatio = 'x'", 'agent.toolResultMaxRatio must be a number, got "x"'),
        ("trimThresholdRatio = inf", "agent.trimThresholdRatio must be a number, got inf"),
        ("trimThresholdRatio = nan", "agent.trimThresholdRatio must be a number, got nan"),
        ("think = true", "agent.think must be a level id (text), got true"),
        ('think = ["a\\nb"]', 'agent.think must be a level id (text), got ["a\\nb"]'),
        ("locale = true", "agent.locale: unknown locale true; known: en, zh"),
        ("locale = 'fr'", 'agent.locale: unknown locale "fr"; known: en, zh'),
        ("systemPrompt = true", "agent.systemPrompt must be text, got true"),
        ("systemPrompt = 12", "agent.systemPrompt must be text, got 12"),
        ("systemPrompt = ['a', 'b']", 'agent.systemPrompt must be text, got ["a", "b"]'),
    ],
)
def test_agent_errors_show_the_value_as_the_file_wrote_it(
    tmp_path: Path, toml: str, said: str
) -> None:
    """An ``[agent]`` value of the wrong type is shown as TOML spells it (``true``,
    ``"x"``), not as Python does (``True``, ``'x'``), and its key as a path."""
    path = write(tmp_path, f"[agent]\n{toml}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: {said}"


def test_a_long_or_deep_agent_value_is_shown_shortened(tmp_path: Path) -> None:
    path = write(tmp_path, "[agent]\nthink = [[[[[1]]]], '" + "x" * 500 + "', 3, 4, 5]\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    shown = str(err.value).split(", got ", 1)[1]
    assert shown == '[[[[...]]], "' + "x" * 60 + '...", 3, 4, ...]'


def test_a_plugin_config_built_in_python_shows_values_the_same_way() -> None:
    from aalis_agent.services.config import AgentConfig

    for kwargs, said in [
        ({"max_tool_iterations": "3"}, 'maxToolIterations must be an integer, got "3"'),
        ({"think": ("\ud800\x01",)}, 'think must be a level id (text), got ["\\ud800\\u0001"]'),
        ({"history_limit": None}, "historyLimit must be an integer, got null"),
        ({"system_prompt": None}, "systemPrompt must be text, got null"),
        ({"history_limit": 10**400}, "<= 9223372036854775807, got an integer of about 401 digits"),
        ({"history_limit": {"a b": object()}}, 'got {"a b" = a object}'),
    ]:
        with pytest.raises(ConfigError) as err:
            AgentConfig(**kwargs)
        assert said in str(err.value), str(err.value)


@pytest.mark.parametrize("layer", ["platform.qq", "platformType.onebot", "venue.'qq:1'"])
def test_tool_groups_written_as_a_string_are_refused(tmp_path: Path, layer: str) -> None:
    """``enabledToolGroups`` is a list; a string in the file is a mistake (it was split
    at commas and taken as a list), refused naming the key, as a scenario file does."""
    path = write(tmp_path, f'[settings.{layer}]\nenabledToolGroups = "web, files"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    key = f"settings.{layer.replace(chr(39), chr(34))}.enabledToolGroups"  # "qq:1" quoted
    assert str(err.value).startswith(f"{path}: {key}: "), str(err.value)
    assert str(err.value).endswith(
        'setting "enabledToolGroups": must be a list of strings (group names, ["*"] for '
        'all), not a string: "web, files"'
    )
    ok = write(tmp_path, f'[settings.{layer}]\nenabledToolGroups = ["web", "files"]\n')
    layers = load_config(ok).settings
    assert ("web", "files") in {
        layers.for_turn("s", "qq", {}, venue="qq:1").tool_groups,
        layers.for_turn("s", "onebot:x", {}).tool_groups,
    }


@pytest.mark.parametrize("layer", ["platform.qq", "platformType.onebot", "venue.'qq:1'"])
@pytest.mark.parametrize(("key", "text"), [("historyLimit", "5"), ("maxToolIterations", " 3")])
def test_an_integer_written_as_a_string_is_refused(
    tmp_path: Path, layer: str, key: str, text: str
) -> None:
    """``historyLimit`` and ``maxToolIterations`` are integers; a string in the file is a
    mistake (it was converted without a word), refused naming the key, as ``[agent]``
    refuses it. ``/session.set historyLimit 5`` still takes the text."""
    path = write(tmp_path, f'[settings.{layer}]\n{key} = "{text}"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    where = f"settings.{layer.replace(chr(39), chr(34))}.{key}"  # "qq:1" quoted
    assert str(err.value).startswith(f"{path}: {where}: "), str(err.value)
    assert str(err.value).endswith(
        f'setting "{key}": must be an integer, not a string: "{text}"'
    ), str(err.value)
    ok = write(tmp_path, f"[settings.{layer}]\n{key} = {text.strip()}\n")
    layers = load_config(ok).settings
    got = {
        getattr(s, "history_limit" if key == "historyLimit" else "max_tool_iterations")
        for s in (
            layers.for_turn("s", "qq", {}, venue="qq:1"),
            layers.for_turn("s", "onebot:x", {}),
        )
    }
    assert int(text) in got


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        ("historyLimit = true", '"historyLimit": expected an integer, got true'),
        (
            "maxToolIterations = [1, 'a']",
            '"maxToolIterations": expected an integer, got [1, "a"]',
        ),
        ("think = false", '"think": expected an id, got false'),
        ("persona = {a = 'b'}", '"persona": expected an id, got {a = "b"}'),
        ("llm = 'big'", '"llm": expected <provider>/<model>, got "big"'),
        ("llm = {provider = 'a'}", '"llm": expected <provider>/<model>, got {provider = "a"}'),
        ("locale = true", '"locale": unknown locale true; known: en, zh'),
        ("locale = 'fr'", '"locale": unknown locale "fr"; known: en, zh'),
        ("think = '" + "x" * 300 + "'", '"think": an id of at most 256 characters, got 300'),
        (
            "enabledToolGroups = [1]",
            '"enabledToolGroups": expected a list of group names ("*" for all)',
        ),
    ],
)
def test_layer_errors_show_the_value_as_the_file_wrote_it(
    tmp_path: Path, toml: str, said: str
) -> None:
    """A settings layer's wrong value is shown as TOML spells it (``true``, ``"x"``,
    ``{a = 1}``), not as Python does (``True``, ``'x'``), as ``[agent]`` shows it."""
    path = write(tmp_path, f"[settings.platform.qq]\n{toml}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    key = toml.split(" ", 1)[0]
    prefix = f'{path}: settings.platform.qq.{key}: platform profile "qq" setting '
    assert str(err.value).startswith(prefix), str(err.value)
    assert str(err.value).removeprefix(prefix).startswith(said), str(err.value)


_SCRIPTED = "[providers.p]\ntype = 'scripted'\n"
_MODEL = "[[providers.p.models]]\nid = 'm'\n"


@pytest.mark.parametrize(
    ("toml", "said"),
    [
        (
            _SCRIPTED + _MODEL + "contextLength = 'big'",
            'providers.p.models[0].contextLength: expected an integer, got text ("big")',
        ),
        (
            _SCRIPTED + 'priority = "x\\ty"\n' + _MODEL,
            'providers.p.priority: expected an integer, got text ("x\\ty")',
        ),
        (
            _SCRIPTED + _MODEL + "thinkLevels = ['a']\ndefaultThink = 'b'",
            'providers.p.models[0].defaultThink: "b" is not one of thinkLevels',
        ),
        (
            _SCRIPTED + _MODEL + "thinkLevels = ['a', \"a\"]",
            'providers.p.models[0].thinkLevels[1]: level "a" is listed twice',
        ),
        (_SCRIPTED + _MODEL + _MODEL, 'providers.p.models: model "m" is listed twice'),
        (
            "[providers.p]\nbaseUrl = 'ftp://h'\n" + _MODEL,
            'providers.p.baseUrl: expected an http:// or https:// URL with a host, got "ftp://h"',
        ),
        (
            "[servicePreferences]\nllm = true",
            "servicePreferences.llm: expected <provider>/<model>, got true",
        ),
        (
            "[pluginServicePreferences.agent]\nllm = {provider = 'a'}",
            'pluginServicePreferences.agent.llm: expected <provider>/<model>, got {provider = "a"}',
        ),
    ],
)
def test_provider_errors_show_the_value_as_the_file_wrote_it(
    tmp_path: Path, toml: str, said: str
) -> None:
    """A provider's or a preference's wrong value is shown as TOML spells it (``"x"``,
    ``true``), not as Python does (``'x'``, ``True``)."""
    path = write(tmp_path, toml + "\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: {said}"


def test_an_unknown_layer_setting_lists_every_key_a_layer_takes(tmp_path: Path) -> None:
    """A layer takes ``locale`` besides the session's settings; a misspelt key's error
    lists it with them."""
    path = write(tmp_path, "[settings.platform.qq]\nlocal = 'en'\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f'{path}: settings.platform.qq.local: unknown platform profile "qq" setting "local"; '
        "known: llm, think, maxToolIterations, historyLimit, persona, enabledToolGroups, locale"
    )
