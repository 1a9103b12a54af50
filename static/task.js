/* RunStead task page (SPEC B9): one task, live.
 *
 * The page embeds its data (JSON: {task, timeline, receipts, git_line, server_time}); this
 * script renders it and then listens on the board's socket (/ws/board/, B2): a `task`
 * event for this task with a newer version re-reads /tasks/{id}/data/ (events, timeline
 * and receipts change with it); a `task.progress` event (G4) updates the live progress
 * in place. Reconnects with backoff and re-reads on every (re)connect (B4).
 * Decisions on an unknown task (U3) are plain forms posted with the CSRF token.
 */
(function () {
  "use strict";
  var dataEl = document.getElementById("task-data");
  if (!dataEl) return;
  var page = JSON.parse(dataEl.textContent);
  var taskId = page.task.id;
  var state = { task: page.task, timeline: page.timeline, receipts: page.receipts, git_line: page.git_line,
                version: page.task.version, progressVersion: page.task.version, messages: 0, progressEvents: 0 };
  window.runsteadTask = state; // tests read it
  var BACKOFF_MIN_MS = 500, BACKOFF_MAX_MS = 30000, backoff = BACKOFF_MIN_MS, ws = null;

  var C = window.RunStead; // common.js
  var $ = C.$, el = C.el, fmtTime = C.fmtTime;
  function timeEl(iso) { return el("time", { datetime: iso, text: fmtTime(iso) }); }
  function fmtSeconds(s) {
    if (s === null || s === undefined) return "";
    s = Math.max(0, Math.round(s));
    if (s < 60) return s + " s";
    if (s < 3600) return Math.floor(s / 60) + " min " + (s % 60) + " s";
    return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
  }
  function fmtCost(c) { return c === null || c === undefined ? null : "$" + Number(c).toFixed(c < 1 ? 4 : 2); }
  function fmtTokens(n) { return n === null || n === undefined ? null : (n >= 10000 ? (n / 1000).toFixed(1) + "k" : String(n)); }

  /** "3 turns · 2 tool calls · 12.3k in / 450 out · $0.0123" (G3, G4). */
  function usageLine(u) {
    if (!u) return "";
    var parts = [];
    if (u.turns !== null && u.turns !== undefined) parts.push(u.turns + " turn" + (u.turns === 1 ? "" : "s"));
    if (u.tool_calls !== null && u.tool_calls !== undefined) parts.push(u.tool_calls + " tool call" + (u.tool_calls === 1 ? "" : "s"));
    var tin = fmtTokens(u.input_tokens), tout = fmtTokens(u.output_tokens);
    if (tin || tout) parts.push((tin || "?") + " in / " + (tout || "?") + " out");
    var cost = fmtCost(u.cost_usd);
    if (cost) parts.push(cost);
    return parts.join(" · ");
  }
  function fill(id, node) { var box = $(id); box.textContent = ""; if (node) box.appendChild(node); }
  function kv(rows) {
    var dl = el("dl", { className: "kv" });
    rows.forEach(function (r) { if (r[1] === null || r[1] === undefined || r[1] === "") return;
      dl.appendChild(el("dt", { text: r[0] })); dl.appendChild(el("dd", {}, r[1])); });
    return dl;
  }

  function renderHeader(t) {
    var badge = $("task-state");
    badge.textContent = t.state.replace(/_/g, " ");
    badge.className = "badge state-" + t.state;
    $("task-reason").textContent = t.state_reason || "";
    fill("task-facts", kv([
      ["runtime", t.runtime_s !== null && t.runtime_s !== undefined ? fmtSeconds(t.runtime_s) : null],
      ["exit code", t.exit_code !== null && t.exit_code !== undefined ? String(t.exit_code) : null],
      ["signal", t.signal !== null && t.signal !== undefined ? String(t.signal) : null],
      ["stop", t.stop_reason || null],
      ["slept", t.slept_s ? fmtSeconds(t.slept_s) : null],
      ["agent session", t.agent_session_id || null],
      ["survivors", t.survivors && t.survivors.length ? String(t.survivors.length) : null],
    ]));
  }

  function renderProgress(t) {
    var p = t.progress;
    var box = $("progress");
    box.hidden = !p && !t.output_tail;
    $("progress-message").textContent = p && p.last_message ? p.last_message : "";
    $("progress-usage").textContent = p ? usageLine(p.usage) : "";
    $("progress-at").textContent = p && p.at ? "updated " + fmtTime(p.at) : "";
    var tail = ((p && p.output_tail) || t.output_tail || "").replace(/\s+$/, "");
    $("progress-tail").textContent = tail;
    $("progress-tail").hidden = !tail;
  }

  function renderResult(t) {
    var r = t.agent_result;
    $("result").hidden = !r && !t.usage;
    fill("result-body", kv([
      ["verdict", r ? (r.is_error ? "error" : "ok") + (r.subtype ? " (" + r.subtype + ")" : "") : null],
      ["summary", r && r.summary ? r.summary : null],
      ["usage", usageLine(t.usage)],
    ]));
  }

  function renderGit(t) {
    var g = t.evidence && t.evidence.git;
    $("git").hidden = !g;
    if (!g) return;
    $("git-line").textContent = state.git_line || "";
    var body = el("div", {});
    body.appendChild(kv([["HEAD before", g.start_head ? g.start_head.slice(0, 12) : "(none)"],
                         ["HEAD after", g.end_head ? g.end_head.slice(0, 12) : "(none)"]]));
    if (g.subjects && g.subjects.length) {
      var ul = el("ul", { className: "plain" });
      g.subjects.forEach(function (s) { ul.appendChild(el("li", { className: "mono", text: s })); });
      body.appendChild(el("h3", { text: "Commits" })); body.appendChild(ul);
    }
    if (g.dirty && g.dirty.length) {
      var dl = el("ul", { className: "plain" });
      g.dirty.forEach(function (s) { dl.appendChild(el("li", { className: "mono", text: s })); });
      body.appendChild(el("h3", { text: "Uncommitted (" + (g.dirty_count || g.dirty.length) + ")" })); body.appendChild(dl);
    }
    fill("git-body", body);
  }

  function renderTimeline() {
    var ul = el("ul", { className: "timeline" });
    state.timeline.forEach(function (item) {
      ul.appendChild(el("li", { className: "tl-" + item.kind, "data-kind": item.kind }, timeEl(item.at), " ", item.text));
    });
    fill("timeline-body", ul);
  }

  function renderReceipts() {
    var ul = el("ul", { className: "plain receipts" });
    state.receipts.forEach(function (r) {
      var facts = r.facts ? JSON.stringify(r.facts) : "";
      ul.appendChild(el("li", { "data-kind": r.kind },
        el("div", { className: "line" }, el("strong", { text: r.kind }), " ", timeEl(r.received_at),
           r.slept_s ? el("span", { className: "muted", text: " slept " + fmtSeconds(r.slept_s) }) : null),
        facts ? el("pre", { className: "tail", text: facts.length > 600 ? facts.slice(0, 600) + "…" : facts }) : null));
    });
    fill("receipts-body", ul);
  }

  function render() {
    var t = state.task;
    renderHeader(t); renderProgress(t); renderResult(t); renderGit(t); renderTimeline(); renderReceipts();
    $("decide").hidden = t.state !== "unknown";
  }

  function reload() {
    return C.api("GET", "/tasks/" + encodeURIComponent(taskId) + "/data/")
      .then(function (res) {
        if (res.status !== 200) return;
        var d = res.data;
        if (d.task.version >= state.version) {
          state.task = d.task; state.timeline = d.timeline; state.receipts = d.receipts; state.git_line = d.git_line;
          state.version = d.task.version; state.progressVersion = Math.max(state.progressVersion, d.task.version);
          render();
        }
      }).catch(function () { /* next event or reconnect tries again */ });
  }

  function onEvent(ev) {
    if (ev.type === "task" && ev.task && ev.task.id === taskId && ev.version > state.version) {
      state.task = Object.assign({}, state.task, ev.task);
      state.version = ev.version;
      render();
      reload();
    } else if (ev.type === "task.progress" && ev.task_id === taskId && ev.version > state.progressVersion) {
      state.progressVersion = ev.version;
      state.progressEvents++;
      state.task = Object.assign({}, state.task, { progress: ev.progress });
      renderProgress(state.task);
    }
  }

  function setConn(s, text) { var c = $("conn"); if (c) { c.dataset.state = s; c.textContent = text; } }
  function connect() {
    var proto = window.location.protocol === "https:" ? "wss:" : "ws:";
    var sock = new WebSocket(proto + "//" + window.location.host + "/ws/board/");
    ws = sock;
    setConn("connecting", "connecting…");
    sock.onopen = function () { backoff = BACKOFF_MIN_MS; setConn("live", "live"); reload(); };
    sock.onmessage = function (e) {
      state.messages++;
      var ev; try { ev = JSON.parse(e.data); } catch (err) { return; }
      onEvent(ev);
    };
    sock.onclose = function () {
      if (ws !== sock) return;
      setConn("offline", "reconnecting…");
      var delay = backoff * (0.5 + Math.random() * 0.5);
      backoff = Math.min(BACKOFF_MAX_MS, backoff * 2);
      setTimeout(connect, delay);
    };
  }

  render();
  connect();
})();
