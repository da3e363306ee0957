// The inspector page: sessions, a paged timeline of turns, model-call requests, the token
// budget chart and the state at any event. Everything it shows comes from the JSON
// endpoints; log text is only ever put in the page as text, never as markup.
"use strict";

const PAGE = 50;
const PART_COLORS = {
  system: "#8e9aaf", persona: "#c9a0dc", memory_summary: "#f4a261", memory_vector: "#e9c46a",
  skills: "#90be6d", platform: "#43aa8b", subtask: "#4d908e", system_other: "#b8c0cc",
  tool_defs: "#577590", tool_results: "#f8961e", history: "#7fb3f5",
};

const inspector = (window.inspector = {
  session: null, offset: 0, total: 0, lastSeq: 0, chart: null, usage: null, timeline: null,
  state: null, ready: false,
  // Where each page before this one started, for "prev": a page cut by its byte budget
  // holds fewer turns than asked, so the one before it does not start PAGE turns back.
  pageStarts: [],
});

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else if (k in node && k !== "list") node[k] = v;
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

const $ = (id) => document.getElementById(id);

async function api(path) {
  const res = await fetch(path, { cache: "no-store" });
  const data = await res.json();
  if (!res.ok) throw new Error(data.error || res.statusText);
  return data;
}

function sessionPath(id, what, params) {
  // The id travels in the query: in the path, "." and ".." are steps a browser resolves.
  const q = new URLSearchParams({ id, ...(params || {}) }).toString();
  return `/api/session/${what}?${q}`;
}

// --- what an answer left out ------------------------------------------------------
// Answers are bounded: a long text comes as a preview ending in "…" with its whole
// length in the entry's `cut` map (by path: "content", "settings.persona"), a long list
// as its first or newest entries with a count of the rest. The events API gives any one
// event whole (`whole=1`).

const fmtCount = (n) => Number(n).toLocaleString("en-US");

function wholeEventUrl(seq) {
  return sessionPath(inspector.session, "events", { from: seq, to: seq, whole: 1 });
}

// " (12,345 more characters)" after a cut text, with a link to its event when known.
function cutNote(cut, path, text, seq) {
  const whole = cut && cut[path];
  if (!whole) return "";
  const shown = Math.max([...(text || "")].length - 1, 0); // the preview ends in "…"
  const note = el("span", { class: "cut", "data-cut": path },
    ` (${fmtCount(whole - shown)} more characters)`);
  if (seq) {
    note.append(" ", el("a", { href: wholeEventUrl(seq), target: "_blank", rel: "noopener" },
      "whole"));
  }
  return note;
}

// Every cut place of an answer's own fields not shown inline, as one line.
function cutList(cut, skip) {
  const rest = Object.entries(cut || {}).filter(([p]) => !(skip || []).includes(p));
  if (!rest.length) return "";
  return el("p", { class: "muted cut-list" }, "cut here (whole size): " +
    rest.map(([p, n]) => `${p || "(all)"} ${fmtCount(n)}`).join("; "));
}

function omittedNote(n, what, tag) {
  if (!n) return "";
  return el(tag || "li", { class: "omitted muted", "data-omitted": n },
    `${fmtCount(n)} more ${what} not shown (the events API has them)`);
}

function fmtTime(ms) {
  if (ms === null || ms === undefined) return "";
  const d = new Date(ms);
  return d.toLocaleString(undefined, { hour12: false }) + "." + String(ms % 1000).padStart(3, "0");
}

// --- sessions ----------------------------------------------------------------------

// A page at a time (the store may hold millions); "more sessions" asks for the next.
async function loadSessions(offset = 0) {
  const data = await api("/api/sessions?" + new URLSearchParams({ offset }).toString());
  const list = $("sessions");
  if (!offset) list.replaceChildren();
  for (const old of list.querySelectorAll("li.more")) old.remove();
  if (!data.total) list.append(el("li", { class: "muted" }, "no sessions"));
  for (const s of data.sessions) {
    const count = el("span", { class: "count" }, `${s.events} ev${s.open ? " · open" : ""}`);
    // An id cut in the list cannot be opened from it (its URL can: #session=<id>).
    list.append(el("li", {}, s.cut
      ? el("span", { class: "muted", title: `${fmtCount(s.cut.session_id)} characters` },
        s.session_id, count)
      : el("a", {
        href: "#session=" + encodeURIComponent(s.session_id),
        "data-session": s.session_id,
      }, s.session_id, count)));
  }
  if (data.next_offset !== null && data.next_offset !== undefined) {
    const left = data.total - data.next_offset;
    const more = el("button", { type: "button" }, `more sessions (${fmtCount(left)} not shown)`);
    more.onclick = () => loadSessions(data.next_offset).catch(showError);
    list.append(el("li", { class: "more" }, more));
  }
  return data.sessions;
}

async function openSession(id) {
  inspector.ready = false;
  inspector.session = id;
  inspector.pageStarts = [];
  for (const a of document.querySelectorAll("#sessions a")) {
    a.classList.toggle("current", a.dataset.session === id);
  }
  $("empty").hidden = true;
  $("session").hidden = false;
  $("session-title").textContent = id;
  $("timeline").replaceChildren(el("li", { class: "muted" }, "loading…"));
  // The first page first: the chart and the state follow without holding it up.
  const page = await loadPage(0);
  inspector.lastSeq = page.last_seq;
  const slider = $("seq-slider");
  slider.max = String(Math.max(page.last_seq, 1));
  $("seq-input").max = String(Math.max(page.last_seq, 1));
  await Promise.all([loadUsage(), showState(page.last_seq)]);
  inspector.ready = true;
}

// --- timeline ----------------------------------------------------------------------

async function loadPage(offset) {
  const id = inspector.session;
  const page = await api(sessionPath(id, "timeline", { offset, limit: PAGE }));
  if (inspector.session !== id) return page;
  inspector.timeline = page;
  inspector.offset = page.offset;
  inspector.total = page.turns_total;
  const s = page.summary;
  $("session-summary").textContent =
    `${s.events} events · ${s.turns} turns · ${s.model_calls} model calls · ` +
    `${fmtTime(s.first_at)} – ${fmtTime(s.last_at)}`;
  const corrupt = $("corrupt");
  corrupt.hidden = !s.corrupt.length;
  // The first rows are listed (each reason cut); `corrupt_omitted` counts the others.
  const others = s.corrupt_omitted || 0;
  corrupt.textContent = s.corrupt.length
    ? `${fmtCount(s.corrupt.length + others)} row(s) did not decode and are left out: ` +
      s.corrupt.map((c) => `seq ${c.seq} (${c.reason})`).join("; ") +
      (others ? `; ${fmtCount(others)} more not listed` : "")
    : "";
  const last = Math.min(page.offset + page.turns.length, page.turns_total);
  $("page-info").textContent = page.turns_total
    ? `turns ${page.offset + 1}–${last} of ${page.turns_total}`
    : "no turns";
  $("page-prev").disabled = $("page-first").disabled = page.offset === 0;
  // A page holds fewer turns than asked once they pass its byte budget: go on from there.
  inspector.nextOffset = page.next_offset ?? null;
  $("page-next").disabled = $("page-last").disabled = page.next_offset == null;
  const list = $("timeline");
  list.replaceChildren(...page.turns.map(renderTurn));
  const tail = $("tail");
  tail.replaceChildren();
  if (page.tail) {
    tail.append(
      el("h4", {}, `After the last turn (seq ${page.tail.first_seq}–${page.tail.last_seq})`),
    );
    if (page.tail.omitted) {
      tail.append(el("p", {}, `${page.tail.omitted} earlier events not shown (the latest ${page.tail.events.length} are)`));
    }
    tail.append(el("div", { class: "events" }, page.tail.events.map(renderLine)));
  }
  return page;
}

function outcomeOf(t) {
  if (t.outcome) return t.outcome;
  return t.running ? "running" : "cut off";
}

function renderTurn(t) {
  const head = el("div", { class: "turn-head" },
    `#${t.ordinal + 1} ${t.turn_id} — ${outcomeOf(t)}`,
    t.reason ? ` (${t.reason})` : "",
    el("span", { class: "meta" },
      t.source ? `source=${t.source}` : "human",
      t.from_queue ? " · from queue" : "",
      t.settings && t.settings.history_limit ? ` · historyLimit=${t.settings.history_limit}` : "",
      t.settings && t.settings.model ? ` · ${t.settings.model.provider}/${t.settings.model.model}` : "",
      t.duration_ms !== null ? ` · ${t.duration_ms} ms` : ""),
    el("span", { class: "seqs" }, `seq ${t.first_seq}–${t.last_seq}`),
  );
  const items = [];
  for (const i of t.inputs) {
    items.push(el("li", { class: "input", "data-input-id": i.input_id, "data-entry": i.entry },
      el("span", { class: `tag ${i.entry}` }, i.entry), `input ${i.input_id} `,
      i.source ? `[${i.source}] ` : i.sender ? `${i.sender}: ` : "",
      i.content !== null ? `“${i.content}”` : "",
      cutNote(i.cut, "content", i.content, i.received_seq),
      el("span", { class: "muted" }, ` #${i.seq}`)));
  }
  items.push(omittedNote(t.inputs_omitted, "inputs"));
  for (const c of t.model_calls) {
    const usage = c.usage
      ? [` · used ${c.usage.used}/${c.usage.token_budget}`,
        c.usage.trimmed ? el("span", { class: "tag trimmed" }, "trimmed") : ""]
      : [];
    const call = el("li", { class: "call", "data-index": c.index },
      el("span", { class: `tag ${c.status || ""}` }, c.status || "running"),
      `model call ${c.index} (${c.model || "-"}${c.format_retry ? ", format retry" : ""})`,
      c.tool_calls ? ` → ${c.tool_calls} tool call(s)` : "",
      c.duration_ms !== null ? ` · ${c.duration_ms} ms` : "", ...usage,
      c.error ? el("div", { class: "error" }, c.error, cutNote(c.cut, "error", c.error, c.ended_seq)) : "",
      el("span", { class: "muted" }, ` #${c.started_seq}`), " ",
      el("button", { class: "link expand-request", type: "button",
        onclick: (ev) => toggleRequest(ev.target.closest("li"), t.ordinal, c.index) }, "request"));
    items.push(call);
  }
  items.push(omittedNote(t.model_calls_omitted, "model calls"));
  for (const tc of t.tool_calls) {
    items.push(el("li", { class: "tool", "data-call-id": tc.call_id },
      el("span", { class: `tag ${tc.error ? "error" : tc.finished_seq ? "ok" : ""}` },
        tc.error ? "failed" : tc.finished_seq ? "done" : "running"),
      `tool ${tc.name} callId=${tc.call_id} args ${tc.arguments}`,
      cutNote(tc.cut, "arguments", tc.arguments, tc.started_seq),
      tc.duration_ms !== null ? ` · ${tc.duration_ms} ms` : "",
      el("div", { class: tc.error ? "error" : "muted" }, tc.error ?? tc.result ?? "",
        cutNote(tc.cut, tc.error !== null ? "error" : "result", tc.error ?? tc.result,
          tc.finished_seq))));
  }
  items.push(omittedNote(t.tool_calls_omitted, "tool calls"));
  for (const s of t.stops) {
    items.push(el("li", { class: "stop" }, el("span", { class: "tag aborted" }, "stop"),
      `stop requested${s.by ? " by " + s.by : ""} (${s.reason}) #${s.seq}`));
  }
  items.push(omittedNote(t.stops_omitted, "stops"));
  for (const m of t.markers) {
    items.push(el("li", { class: "marker" }, el("span", { class: "tag" }, m.kind || "marker"),
      m.content || "", cutNote(m.cut, "content", m.content, m.seq),
      el("span", { class: "muted" }, ` #${m.seq}`)));
  }
  items.push(omittedNote(t.markers_omitted, "markers"));
  for (const r of t.replies) {
    items.push(el("li", { class: "reply" }, el("span", { class: "tag ok" }, "reply"),
      r.content || "", cutNote(r.cut, "content", r.content, r.seq),
      el("span", { class: "muted" }, ` #${r.seq}`)));
  }
  items.push(omittedNote(t.replies_omitted, "replies"));
  const eventsBox = el("div", { class: "events", hidden: true });
  const toggle = el("button", { class: "link", type: "button", onclick: async () => {
    if (!eventsBox.hidden) { eventsBox.hidden = true; return; }
    eventsBox.replaceChildren();
    await loadEvents(eventsBox, t.first_seq, t.last_seq);
    eventsBox.hidden = false;
  } }, `events (${t.last_seq - t.first_seq + 1})`);
  const stateLink = el("button", { class: "link", type: "button",
    onclick: () => showState(t.last_seq) }, "state at its end");
  return el("li", {
    class: `turn ${t.outcome || (t.running ? "running" : "cut")}`,
    "data-turn-id": t.turn_id, "data-ordinal": t.ordinal,
  }, head, el("ul", {}, items), cutList(t.cut), toggle, " · ", stateLink, eventsBox);
}

// Events first..last into box, a page at a time: each page ends where its byte budget
// does, and a button fetches the next.
async function loadEvents(box, first, last) {
  const data = await api(sessionPath(inspector.session, "events", { from: first, to: last }));
  box.querySelector(".more-events")?.remove();
  box.append(...data.events.map(renderLine));
  if (data.next_from != null) {
    box.append(el("button", { class: "link more-events", type: "button",
      onclick: () => loadEvents(box, data.next_from, last) },
    `more events from #${data.next_from}`));
  }
}

function renderLine(e) {
  return el("div", { class: "line", "data-seq": e.seq },
    el("button", { class: "link", type: "button", onclick: () => showState(e.seq) }, `#${e.seq}`),
    ` ${e.text}`, cutNote(e.cut, "text", e.text, e.seq));
}

// --- one model call's request ------------------------------------------------------

// The turn by its place in the timeline: a turn id too long to show is cut there.
async function toggleRequest(li, ordinal, index) {
  const open = li.querySelector(".request");
  if (open) { open.remove(); return; }
  const box = el("div", { class: "request" }, "loading…");
  li.append(box);
  const r = await api(sessionPath(inspector.session, "request", { ordinal, index }));
  box.replaceChildren(...renderRequest(r));
}

function renderRequest(r) {
  const rows = [
    ["model", r.model || "-"], ["purpose", r.purpose], ["format retry", r.format_retry],
    ["started", `#${r.started_seq} ${fmtTime(r.started_at)}`],
    ["ended", r.ended_seq ? `#${r.ended_seq} ${r.status}, ${r.tool_calls} tool call(s), ${r.duration_ms} ms` : "not ended"],
    ["error", r.error], ["batch prefix", r.batch_prefix],
    ["settings", r.settings ? JSON.stringify(r.settings) : null],
  ].filter(([, v]) => v !== null && v !== undefined);
  const out = [el("table", { class: "call-facts" },
    rows.map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", {}, String(v))))),
  cutList(r.cut)];
  const u = r.usage;
  if (u) {
    out.push(el("h4", {}, `Usage (#${r.usage_seq})`));
    out.push(el("table", { class: "usage" },
      [["used", u.used], ["token budget", u.tokenBudget], ["context window", u.contextWindow],
        ["max tokens", u.maxTokens], ["usage ratio", ((u.usageRatio ?? 0) * 100).toFixed(1) + "%"],
        ["trimmed", u.trimmed ? "yes" : "no"], ["untrimmed history", u.untrimmedHistory],
        ["history messages", u.historyMessages]]
        .map(([k, v]) => el("tr", { "data-key": k }, el("th", {}, k),
          el("td", { class: "num" }, String(v ?? 0))))));
    const parts = u.parts || [];
    if (parts.length) {
      out.push(el("table", { class: "parts" }, el("tr", {}, el("th", {}, "part"), el("th", {}, "tokens")),
        parts.map((p) => el("tr", {}, el("td", {}, p.label), el("td", { class: "num" }, p.tokens)))));
    }
  } else {
    out.push(el("p", { class: "muted" }, "No usage recorded for this call."));
  }
  out.push(el("h4", {}, `History window as the log folds it at #${r.started_seq} ` +
    `(historyLimit=${r.history_limit}, ${r.history.length + r.history_omitted} message(s))`));
  if (r.history_omitted) out.push(el("p", { class: "muted omitted" }, `${fmtCount(r.history_omitted)} older message(s) not shown`));
  out.push(el("div", { class: "history" }, r.history.map(renderMessage)));
  return out;
}

function renderMessage(m) {
  const calls = (m.tool_calls || []).map((c) => `${c.name}#${c.id}(${c.arguments || ""})`);
  return el("div", { class: `msg${m.kind ? " control" : ""}`, "data-id": m.id },
    el("span", { class: "role" }, m.role + (m.kind ? ` [${m.kind}]` : "")),
    m.tool_call_id ? `(callId ${m.tool_call_id}) ` : "",
    m.content || "", cutNote(m.cut, "content", m.content, m.saved_seq),
    calls.length ? ` calls ${calls.join(", ")}` : "", cutList(m.cut, ["content"]));
}

// --- token budget chart ------------------------------------------------------------

async function loadUsage() {
  const id = inspector.session;
  const u = await api(sessionPath(id, "usage"));
  if (inspector.session !== id) return;
  inspector.usage = u;
  if (inspector.chart) { inspector.chart.destroy(); inspector.chart = null; }
  $("chart").replaceChildren();
  $("chart-empty").hidden = u.points > 0;
  const note = $("chart-note");
  note.hidden = !(u.points_total > u.points);
  note.textContent = note.hidden ? "" :
    `${fmtCount(u.points)} of ${fmtCount(u.points_total)} model calls shown: in each stretch ` +
    "the least and most used and the first trimmed (the timeline has every call).";
  if (!u.points) return;
  const x = u.index || u.used.map((_, i) => i + 1);
  const names = Object.keys(u.parts);
  // Stack: cumulative sums, drawn largest first so each lower band paints over it.
  const cum = [];
  let acc = new Array(u.points).fill(0);
  for (const name of names) {
    acc = acc.map((v, i) => v + u.parts[name][i]);
    cum.push(acc);
  }
  const stacked = names.map((name, i) => ({ name, data: cum[i] })).reverse();
  const trimmed = u.used.map((v, i) => (u.trimmed[i] ? v : null));
  const data = [x, ...stacked.map((s) => s.data), u.token_budget, u.used, trimmed];
  const series = [
    { label: "call" },
    ...stacked.map((s) => ({
      label: s.name, stroke: PART_COLORS[s.name] || "#999", fill: PART_COLORS[s.name] || "#999",
      width: 0, points: { show: false },
    })),
    { label: "budget", stroke: "#c0392b", width: 2, dash: [6, 4], points: { show: false } },
    { label: "used", stroke: "#1d2330", width: 2 },
    { label: "trimmed", stroke: "#c0392b", fill: "#c0392b", paths: () => null,
      points: { show: true, size: 11, fill: "#c0392b", stroke: "#c0392b" } },
  ];
  const width = Math.max($("chart").clientWidth || 800, 400);
  const opts = {
    width, height: 300, series, scales: { x: { time: false } },
    axes: [
      { label: "model call (with usage)", incrs: [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000] },
      { label: "tokens", size: 60 },
    ],
    cursor: { points: { size: 7 } },
    hooks: {
      ready: [(chart) => {
        chart.over.addEventListener("click", () => {
          const i = chart.cursor.idx;
          if (i !== null && i !== undefined) showState(u.seq[i]);
        });
      }],
    },
  };
  inspector.chart = new uPlot(opts, data, $("chart"));
  fitChart();
}

// The budget dwarfs a short conversation's prompt: "fit to used" scales to the prompt.
function fitChart() {
  const chart = inspector.chart;
  const u = inspector.usage;
  if (!chart || !u) return;
  const fit = $("chart-fit").checked;
  // A loop, not Math.max(...list): spreading 100k points overflows the call stack.
  const most = (lists) => {
    let m = 1;
    for (const list of lists) for (const v of list) if (v > m) m = v;
    return m;
  };
  const top = fit ? most([u.used]) * 1.15 : most([u.token_budget, u.used]) * 1.05;
  chart.setScale("y", { min: 0, max: top });
}

// --- state at an event -------------------------------------------------------------

let stateTimer = null;
let stateWanted = 0;

function setSeqControls(seq) {
  $("seq-slider").value = String(seq);
  $("seq-input").value = String(seq);
}

async function showState(seq) {
  seq = Math.max(1, Math.min(Number(seq) || 1, inspector.lastSeq || 1));
  stateWanted = seq;
  setSeqControls(seq);
  const id = inspector.session;
  const s = await api(sessionPath(id, "state", { seq }));
  if (inspector.session !== id || stateWanted !== seq) return;
  inspector.state = s;
  $("state-view").replaceChildren(...renderState(s));
}

function scheduleState(seq) {
  stateWanted = Number(seq);
  setSeqControls(seq);
  clearTimeout(stateTimer);
  stateTimer = setTimeout(() => showState(seq), 120);
}

function renderState(s) {
  const ev = s.event;
  const running = s.running_turn;
  const out = [
    el("p", { class: "state-event" }, ev ? `#${ev.seq} ${fmtTime(ev.at)} — ${ev.text}` : `seq ${s.seq}`,
      s.span ? el("span", { class: "muted" }, ` (in ${s.span.turn_id}'s span)`) : ""),
  ];
  const left = el("div", {},
    el("h4", {}, "Queue"),
    el("p", { class: "running" }, running ? `running turn: ${running.turn_id}` +
      (running.stop_requested ? " (stop requested)" : "") : "running turn: none"),
    s.winding_down ? el("p", { class: "winding" }, (s.winding_down.kind === "delete" ? "deletion" :
      "clear" + (s.winding_down.kinds.length ? ` of ${s.winding_down.kinds.join(", ")}` : "")) +
      " begun, not finished (the session's next start finishes it)") : "",
    el("p", { class: "queued" }, `queued (${fmtCount(s.queued.length + (s.queued_omitted || 0))}): ` +
      `${s.queued.join(", ") || "—"}${s.queued_omitted ? `, … ${fmtCount(s.queued_omitted)} more not shown` : ""}`),
    el("p", { class: "pending" }, `pending inserts (${fmtCount(s.pending.length + (s.pending_omitted || 0))}): ` +
      `${s.pending.join(", ") || "—"}${s.pending_omitted ? `, … ${fmtCount(s.pending_omitted)} more not shown` : ""}`),
    el("p", {}, `generation ${s.generation} · ${s.turns} turn(s)`),
    el("h4", {}, "Settings"),
    el("pre", {}, Object.keys(s.settings).length ? JSON.stringify(s.settings, null, 1) : "—"),
    cutList(s.cut),
  );
  const right = el("div", {},
    el("h4", {}, `History window (historyLimit=${s.history_limit}, ${s.history_active} active, ` +
      `starts at ${s.history_start}, ${s.history_window.length + s.history_window_omitted} sent)`),
    s.history_window_omitted
      ? el("p", { class: "muted omitted" }, `${fmtCount(s.history_window_omitted)} older message(s) not shown`) : "",
    el("div", { class: "history" }, s.history_window.map(renderMessage)),
  );
  out.push(el("div", { class: "cols" }, left, right));
  return out;
}

// --- wiring ------------------------------------------------------------------------

function currentHashSession() {
  const m = /session=([^&]*)/.exec(location.hash);
  return m ? decodeURIComponent(m[1]) : null;
}

async function main() {
  $("page-first").onclick = () => { inspector.pageStarts = []; loadPage(0); };
  $("page-prev").onclick = () => loadPage(inspector.pageStarts.length
    ? inspector.pageStarts.pop() : Math.max(inspector.offset - PAGE, 0));
  $("page-next").onclick = () => {
    inspector.pageStarts.push(inspector.offset);
    loadPage(inspector.nextOffset ?? inspector.offset + PAGE);
  };
  $("page-last").onclick = () => {
    inspector.pageStarts = [];
    loadPage(Math.max(inspector.total - PAGE, 0));
  };
  $("chart-fit").onchange = fitChart;
  $("seq-slider").oninput = (e) => scheduleState(e.target.value);
  $("seq-input").onchange = (e) => showState(e.target.value);
  $("seq-prev").onclick = () => showState(Number($("seq-input").value) - 1);
  $("seq-next").onclick = () => showState(Number($("seq-input").value) + 1);
  window.addEventListener("hashchange", () => {
    const id = currentHashSession();
    if (id && id !== inspector.session) openSession(id).catch(showError);
  });
  const sessions = await loadSessions();
  const wanted = currentHashSession();
  const openable = sessions.find((s) => !s.cut);
  const first = wanted ?? (openable ? openable.session_id : null);
  if (first !== null) await openSession(first);
}

function showError(err) {
  const p = el("p", { class: "error" }, String(err && err.message ? err.message : err));
  $("session-pane").prepend(p);
}

main().catch(showError);
