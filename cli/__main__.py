"""``python -m aalis_agent.cli``: the ``aalis-agent`` command."""

from aalis_agent.cli.main import main

raise SystemExit(main())
