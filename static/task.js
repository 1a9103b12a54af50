/* RunStead task page (SPEC B9): one task, live.
 *
 * The page embeds its data (JSON: {task, timeline, receipts, git_line, entries,
 * entries_next, server_time}); this script renders it and then listens on the board's
 * socket (/ws/board/, B2): a `task` event for this task with a newer version re-reads
 * /tasks/{id}/data/ (events, timeline, receipts and the transcript's last entries change
 * with it); a `task.progress` event (G4) adds its transcript entries and updates the usage
 * in place. Reconnects with backoff and re-reads on every (re)connect (B4).
 *
 * The run is shown as a transcript (G4 entries, by number): the prompt, each assistant
 * message (line breaks kept), each tool call as one line (tool, command or path, its
 * result's status) with the output behind a tap, errors marked, a turn's usage under its
 * first entry. The last 200 come with the page, "Load earlier" reads the 200 before from
 * GET /api/tasks/{id}/entries/?before=N; a gap after a lost event is filled from
 * ?after=N. The raw output is one tap away ("raw"). Every text the agent controls is set
 * as textContent (common.js el), never as HTML.
 * Decisions on an unknown task (U3) are plain forms posted with the CSRF token.
 * The reply box (G6, G8) sends a follow-up (POST /api/tasks/ with continue_task, one
 * Idempotency-Key per box until it is accepted): while the task is unfinished it "will
 * run next" (queued behind it and whatever is queued already), once final it resumes
 * the agent's session at once; the follow-ups queued behind the task are listed above it.
 * A conversation task (C1-C5) is a chat instead: its messages with their state (sent,
 * delivered, answered, undelivered, withdrawn; a waiting one has "withdraw" and "edit", C10; GET /api/tasks/{id}/messages/, then `message` events),
 * a message box (POST .../messages/, one Idempotency-Key per message until it is accepted,
 * Ctrl/Cmd+Enter sends), "Stop this turn" while a turn runs (POST .../interrupt/), "End
 * conversation" (POST .../end/), and the task's pending approvals answered inline (Q2:
 * GET /api/approvals/?task=ID&state=pending, then `approval` events).
 */
(function () {
  "use strict";
  var dataEl = document.getElementById("task-data");
  if (!dataEl) return;
  var page = JSON.parse(dataEl.textContent);
  var taskId = page.task.id;
  var state = { task: page.task, timeline: page.timeline, receipts: page.receipts, git_line: page.git_line,
                queue: page.queue || [], replies: 0,
                version: page.task.version, progressVersion: page.task.version, messages: 0, progressEvents: 0,
                entries: new Map(), earlier: page.entries_next ? page.entries_next.before : null, raw: false,
                catchUps: 0 };
  window.runsteadTask = state; // tests read it

  var C = window.RunStead; // common.js
  var Chat = window.RunSteadChat; // chat.js: what the session page (T6) draws the same way
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
    $("task-reason").textContent = t.state_reason ||
      (t.state === "queued" ? "Queued: it runs when the task it follows has finished." : "");
    fill("task-facts", kv([
      ["runtime", t.runtime_s !== null && t.runtime_s !== undefined ? fmtSeconds(t.runtime_s) : null],
      ["exit code", t.exit_code !== null && t.exit_code !== undefined ? String(t.exit_code) : null],
      ["signal", t.signal !== null && t.signal !== undefined ? String(t.signal) : null],
      ["stop", t.stop_reason || null],
      ["slept", t.slept_s ? fmtSeconds(t.slept_s) : null],
      ["usage", isConversation(t) ? usageLine((t.progress && LEASED[t.state] ? t.progress.usage : null) || t.usage) : null],
      ["survivors", t.survivors && t.survivors.length ? String(t.survivors.length) : null],
    ]));
  }

  // ---------------------------------------------------------------- the transcript (G4, B9)
  var LEASED = { starting: true, running: true };
  var nodes = new Map(); // entry n -> {li, sig}: kept across renders, so an opened tool call stays open

  function addEntries(list) {
    (list || []).forEach(function (e) { if (e && typeof e.n === "number") state.entries.set(e.n, e); });
  }
  function lastN() { var m = 0; state.entries.forEach(function (e, n) { if (n > m) m = n; }); return m; }

  function turnUsage(u) {
    if (!u) return null;
    var tin = fmtTokens(u.input_tokens), tout = fmtTokens(u.output_tokens);
    return el("div", { className: "turn-usage muted", text: "turn: " + (tin || "?") + " in / " + (tout || "?") + " out" });
  }

  function toolEntry(call, result, live) {
    var status = result ? result.status : (live ? "running" : "no result");
    var li = el("li", { className: "entry entry-tool", "data-n": call.n, "data-kind": call.kind, "data-status": status });
    var summary = el("summary", {},
      el("span", { className: "tool-name", text: call.tool || "tool" }), " ",
      el("span", { className: "tool-text mono", text: call.text || "" }), " ",
      el("span", { className: "badge tool-" + status.replace(/ /g, "-"), text: status }));
    var body = el("div", { className: "tool-body" });
    if (call.kind === "tool_call" && call.text) body.appendChild(el("pre", { className: "tail tool-input", text: call.text }));
    var output = result ? result.text : (call.kind === "tool_result" ? call.text : "");
    body.appendChild(el("pre", { className: "tail tool-output", text: output || (result || call.kind === "tool_result" ? "(no output)" : "(no result yet)") }));
    li.appendChild(el("details", {}, summary, body));
    var u = turnUsage(call.usage);
    if (u) li.appendChild(u);
    return li;
  }

  function textEntry(e) {
    var label = { prompt: "prompt", message: null, error: "error" }[e.kind];
    var li = el("li", { className: "entry entry-" + e.kind, "data-n": e.n, "data-kind": e.kind },
      label ? el("span", { className: "badge entry-label", text: label }) : null,
      el("div", { className: "entry-text", text: e.text }));
    var u = turnUsage(e.usage);
    if (u) li.appendChild(u);
    return li;
  }

  function renderTranscript(t) {
    var sorted = Array.from(state.entries.values()).sort(function (a, b) { return a.n - b.n; });
    var results = {}; // tool_call n -> its tool_result
    sorted.forEach(function (e) { if (e.kind === "tool_result" && e.call && state.entries.has(e.call)) results[e.call] = e; });
    var live = !!LEASED[t.state];
    var list = $("transcript");
    var keep = new Set();
    sorted.forEach(function (e) {
      if (e.kind === "tool_result" && e.call && state.entries.has(e.call)) return; // shown with its call
      var result = results[e.n];
      var sig = e.kind + "|" + (result ? result.n : "") + "|" + (e.kind === "tool_call" && !result ? live : "");
      var known = nodes.get(e.n);
      if (!known || known.sig !== sig) {
        var li = e.kind === "tool_call" || e.kind === "tool_result" ? toolEntry(e, result, live) : textEntry(e);
        if (known) {
          var open = known.li.querySelector("details");
          if (open && open.open) li.querySelector("details").open = true;
          known.li.replaceWith(li);
        }
        known = { li: li, sig: sig };
        nodes.set(e.n, known);
      }
      keep.add(e.n);
      list.appendChild(known.li); // in order; moving a node keeps its state
    });
    nodes.forEach(function (v, n) { if (!keep.has(n)) { v.li.remove(); nodes.delete(n); } });
    $("load-earlier").hidden = state.earlier === null || state.earlier === undefined;
  }

  function renderRun(t) {
    var p = t.progress;
    var raw = ((p && LEASED[t.state] && p.output_tail) || t.output_tail || (p && p.output_tail) || "").replace(/\s+$/, "");
    var hasEntries = state.entries.size > 0;
    $("run").hidden = !hasEntries && !raw && !p;
    $("run-usage").textContent = usageLine((p && LEASED[t.state] ? p.usage : null) || t.usage || (p && p.usage));
    $("progress-at").textContent = p && p.at && LEASED[t.state] ? "updated " + fmtTime(p.at) : "";
    var showRaw = state.raw || !hasEntries;
    $("transcript").hidden = showRaw;
    $("run-empty").hidden = hasEntries || !raw;
    $("raw").textContent = raw;
    $("raw").hidden = !showRaw || !raw;
    var toggle = $("raw-toggle");
    toggle.hidden = !hasEntries;
    toggle.textContent = state.raw ? "transcript" : "raw";
    toggle.setAttribute("aria-pressed", state.raw ? "true" : "false");
    if (hasEntries) renderTranscript(t);
    else $("load-earlier").hidden = true;
    if (isConversation(t)) { renderChat(t); renderHeader(t); }
  }

  function entriesUrl(query) { return "/api/tasks/" + encodeURIComponent(taskId) + "/entries/?" + query; }
  function param(url, name) {
    if (!url) return null;
    var v = new URL(url, window.location.href).searchParams.get(name);
    return v === null ? null : Number(v);
  }

  function loadEarlier() {
    if (state.earlier === null) return Promise.resolve();
    var button = $("load-earlier");
    button.disabled = true;
    return C.api("GET", entriesUrl("before=" + state.earlier))
      .then(function (res) {
        if (res.status !== 200) return;
        addEntries(res.data.results);
        state.earlier = param(res.data.next, "before");
        renderRun(state.task);
      }).catch(function () { /* the button stays for another try */ })
      .then(function () { button.disabled = false; });
  }

  /* A lost task.progress event leaves a gap: read what follows the last entry shown. */
  function catchUp(after) {
    state.catchUps++;
    return C.api("GET", entriesUrl("after=" + after)).then(function (res) {
      if (res.status !== 200) return;
      addEntries(res.data.results);
      renderRun(state.task);
      var next = param(res.data.next, "after");
      if (next !== null) return catchUp(next);
    }).catch(function () { /* the next reload fills it */ });
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

  /* --- the branch of a worktree task (G7): its diff, file by file, and merge or discard --- */
  var FINAL = { succeeded: true, failed: true, failed_lease_lost: true, cancelled: true, not_started: true,
                abandoned: true };
  var DIFF_OPEN_MAX = 20; // past this many files, every file starts collapsed
  var integrateKeys = {}; // A1: one Idempotency-Key per action per page, so a double tap decides once
  var discardArmed = false, diffShown = null;

  function integrationText(i, g) {
    var who = i.decided_by ? " by " + i.decided_by : "";
    var paths = (i.paths || []).join(", ");
    if (!i.outcome) return (i.action === "merge" ? "Merge" : "Discard") + " requested" + who + " at " +
      fmtTime(i.decided_at) + ": waiting for the worker.";
    if (i.outcome === "merged") return "Merged into " + (g.base_branch || "its base") + ": " + (i.commit || "").slice(0, 12) +
      (i.detail ? " (" + i.detail + ")" : "");
    if (i.outcome === "discarded") return "Discarded" + who + (i.detail ? ": " + i.detail : "") + ".";
    if (i.outcome === "conflict") return "Not merged: conflict in " + paths + ". Nothing changed in " +
      (g.base_branch || "the base") + "; the branch stays (git merge " + g.branch + " to resolve it by hand).";
    if (i.outcome === "base_dirty") return "Not merged: uncommitted changes in your checkout touch " + paths +
      ". Nothing changed; the branch stays.";
    if (i.outcome === "base_missing") return "Not merged: " + (i.detail || "the base branch no longer exists") + ".";
    return "Not merged: " + (i.detail || i.outcome) + ".";
  }

  function renderBranch(t) {
    var g = t.evidence && t.evidence.git;
    var box = $("branch");
    box.hidden = !(g && g.branch);
    if (box.hidden) return;
    $("branch-line").textContent = g.branch + " from " + (g.base_branch || "a detached HEAD") + " at " +
      String(g.base || "").slice(0, 12);
    var i = t.integration;
    var note = $("integration");
    note.hidden = !i;
    if (i) { note.dataset.outcome = i.outcome || "pending"; note.textContent = integrationText(i, g); }
    var open = FINAL[t.state] && !i;
    $("integrate-actions").hidden = !open;
    $("merge-button").disabled = !g.base_branch;
    $("merge-target").textContent = g.base_branch || "(no branch)";
    if (!g.base_branch) C.tell($("integrate-note"), "It started on a detached HEAD: there is no branch to merge into.", false);
    else if (!FINAL[t.state]) C.tell($("integrate-note"), "Merge or discard once the task is final.", false);
    renderDiff(g);
  }

  /* Splits a unified diff into its files' sections (git writes them in the order of files). */
  function diffSections(diff) {
    var out = [], cur = null;
    diff.split("\n").forEach(function (line) {
      if (line.indexOf("diff --git ") === 0) { cur = []; out.push(cur); }
      if (cur) cur.push(line);
    });
    if (cur && cur.length && cur[cur.length - 1] === "") cur.pop();
    return out;
  }

  /* One file's lines, each as text in its own element: a line holding <script> shows it. */
  function diffBody(lines) {
    var code = el("code", {}), inHunk = false;
    lines.forEach(function (line) {
      var cls = "meta";
      if (line.indexOf("@@") === 0) { inHunk = true; cls = "hunk"; }
      else if (inHunk && line.charAt(0) === "+") cls = "add";
      else if (inHunk && line.charAt(0) === "-") cls = "del";
      else if (inHunk) cls = "ctx";
      code.appendChild(el("span", { className: "dl " + cls, text: line === "" ? " " : line }));
    });
    return el("pre", { className: "diff" }, code);
  }

  function renderDiff(g) {
    if (!g.files) return; // a task event leaves files and diff out: keep what is shown
    var signature = [g.branch, g.end_head, g.files.length, (g.diff || "").length, g.truncated].join("|");
    if (diffShown === signature) return;
    diffShown = signature;
    var files = g.files, sections = diffSections(g.diff || "");
    var plus = 0, minus = 0;
    files.forEach(function (f) { plus += f.insertions || 0; minus += f.deletions || 0; });
    var n = g.files_changed || files.length;
    $("diff-summary").textContent = n + " file" + (n === 1 ? "" : "s") + " changed, +" + plus + " −" + minus +
      (files.length > DIFF_OPEN_MAX ? " · collapsed: tap a file to open it" : "") +
      (g.truncated ? " · the diff was cut at 256 KiB (whole files only)" : "");
    var list = el("div", { className: "diff-files" });
    files.forEach(function (f, idx) {
      var path = f.old_path ? f.old_path + " → " + f.path : f.path;
      var stat = f.insertions === null || f.insertions === undefined ? el("span", { className: "muted", text: "binary" }) :
        el("span", {}, el("span", { className: "diff-add", text: "+" + f.insertions }), " ",
           el("span", { className: "diff-del", text: "−" + f.deletions }));
      var details = el("details", { className: "diff-file", "data-path": f.path },
        el("summary", {}, el("span", { className: "badge diff-status", text: f.status }),
           el("span", { className: "diff-path", text: path }), el("span", { className: "diff-stat" }, stat)),
        sections[idx] ? diffBody(sections[idx]) : el("p", { className: "muted", text: "not shown: past the 256 KiB cut" }));
      details.open = files.length <= DIFF_OPEN_MAX;
      list.appendChild(details);
    });
    fill("diff", list);
  }

  function integrate(action) {
    var key = integrateKeys[action] || (integrateKeys[action] = C.newKey());
    var buttons = [$("merge-button"), $("discard-button")];
    buttons.forEach(function (b) { b.disabled = true; });
    C.tell($("integrate-note"), action === "merge" ? "Merging…" : "Discarding…", false);
    return C.api("POST", "/api/tasks/" + encodeURIComponent(taskId) + "/integrate/", { action: action },
                 { "Idempotency-Key": key })
      .then(function (res) {
        if (res.status === 202) { C.tell($("integrate-note"), "", false); return reload(); }
        C.tell($("integrate-note"), C.errorText(res.status, res.data), true);
      })
      .catch(function () { C.tell($("integrate-note"), "The service did not answer: try again (it decides once).", true); })
      .then(function () {
        var g = state.task.evidence && state.task.evidence.git;
        $("discard-button").disabled = false;
        $("merge-button").disabled = !(g && g.base_branch);
      });
  }

  // ---------------------------------------------------------------- the reply box (G6, G8)
  var replyKey = C.newKey(), replying = false;

  function renderReply(t) {
    if (isConversation(t) && !FINAL[t.state]) { $("reply").hidden = true; return; } // the chat takes messages
    var unfinished = !FINAL[t.state], resumable = !!(FINAL[t.state] && t.agent_session_id);
    $("reply").hidden = !(unfinished || resumable);
    $("reply").dataset.mode = unfinished ? "queue" : "follow-up";
    $("reply-title").textContent = unfinished ? "Next instruction" : "Follow-up";
    $("reply-label").textContent = unfinished
      ? "Your next instruction: will run next, once this task has finished (it resumes the agent's session)"
      : "Your answer: resumes the agent's session now";
    $("reply-button").textContent = unfinished ? "Queue it" : "Send follow-up";
    var list = $("reply-queue");
    list.textContent = "";
    state.queue.forEach(function (q, i) {
      list.appendChild(el("li", { className: "queued-item", "data-task-id": q.id },
        el("span", { className: "badge state-queued", text: i === 0 ? "next" : "queued" }), " ",
        el("a", { href: "/tasks/" + encodeURIComponent(q.id) + "/", text: q.prompt.length > 160 ? q.prompt.slice(0, 160) + "…" : q.prompt })));
    });
    list.hidden = state.queue.length === 0;
  }

  function sendReply(e) {
    e.preventDefault();
    if (replying) return; // a double click: the key would replay anyway (A2)
    var t = state.task, status = $("reply-status");
    var body = { machine: t.machine, folder: t.folder, agent: t.agent, prompt: $("reply-prompt").value,
                 continue_task: t.id, deep_research: !!t.deep_research, max_runtime_s: t.max_runtime_s };
    if (t.session) body.session = t.session;
    if (t.exclusive === false) body.exclusive = false;
    replying = true;
    $("reply-button").disabled = true;
    C.tell(status, "Sending…", false);
    C.api("POST", "/api/tasks/", body, { "Idempotency-Key": replyKey })
      .then(function (res) {
        if (res.status === 201) {
          replyKey = C.newKey(); // the next reply is a new request
          state.replies++;
          if ($("reply-prompt").value === body.prompt) $("reply-prompt").value = ""; // keep what was typed meanwhile
          C.tell(status, res.data.state === "queued" ? "Queued: it will run next." : "Follow-up accepted.", false);
          return reload();
        }
        if (res.data && res.data.error === "idempotency_key_reused") replyKey = C.newKey();
        C.tell(status, C.errorText(res.status, res.data), true);
      })
      .catch(function () { C.tell(status, "Network error; send again (it will not create a second task).", true); })
      .then(function () { replying = false; $("reply-button").disabled = false; });
  }

  // ---------------------------------------------------------------- the conversation (C2-C5, Q)
  /* The thread alternates the owner's messages and the agent's reply to each (C1's "one
   * message, one turn"): message 0 is the task's prompt, then the messages in seq order.
   * The worker marks where each message's turn starts (G4): a `prompt` entry with the
   * message's `seq`; the entries after it, up to the next such entry, are that message's
   * reply. A transcript without these marks (recorded before them) is read as before: a
   * turn starts at a `prompt` entry, or at an entry that opens a model call (it carries
   * `usage`) right after the end of one (a `message`, an `error`, an interrupt); turn k
   * answers the k-th message that reached the agent (delivered or answered, in seq
   * order). "[Request interrupted by user...]" and the error that follows
   * it read "stopped by you". Everything the agent or the owner wrote is set as
   * textContent in a dir="auto" element (bidi isolated, task.css). */
  var chat = { messages: new Map(), approvals: new Map(), key: C.newKey(), sending: false, keys: {},
               open: new Set(), unfolded: new Set(), turns: [], scrolls: 0 };
  state.chat = chat; // tests read it
  var MESSAGE_LABELS = Chat.LABELS, MESSAGE_TITLES = Chat.TITLES;
  var INTERRUPTED = /^\[Request interrupted by user/;

  function isConversation(t) { return t.mode === "conversation"; }
  function conversationOpen(t) {
    return isConversation(t) && !FINAL[t.state] && t.state !== "unknown" && !t.conversation_ended_at;
  }
  function turnRunning() { // C9: a steer taken as its own turn runs until it is answered
    var running = false;
    chat.messages.forEach(function (m) {
      if (m.state === "delivered" || (m.state === "consumed" && m.turn_seq === m.seq)) running = true;
    });
    return running;
  }
  function taskPath(rest) { return "/api/tasks/" + encodeURIComponent(taskId) + "/" + rest; }
  function keepMessage(m) {
    var known = chat.messages.get(m.id);
    if (!known || m.version >= known.version) chat.messages.set(m.id, m);
  }

  function opensTurn(e) { return e.kind === "prompt" && typeof e.seq === "number"; }

  /** The transcript's turns, in order: [{entries, stopped, partial, seq}] (see above;
   *  `seq` is the message whose turn it is, null where the transcript does not say). */
  function turnsOf(sorted) {
    var turns = [], cur = null, prev = null, exact = sorted.some(opensTurn);
    sorted.forEach(function (e) {
      var mark = e.kind === "prompt" && INTERRUPTED.test(e.text || "");
      var ended = prev && (prev.kind === "message" || prev.kind === "error" || prev.mark);
      var starts = exact ? opensTurn(e) : (e.kind === "prompt" && !mark) || ((e.usage || mark) && ended);
      if (!cur || starts) {
        cur = { entries: [], stopped: false, partial: !turns.length && sorted[0].n !== 1,
                seq: opensTurn(e) ? e.seq : null };
        turns.push(cur);
      }
      if (mark) cur.stopped = true;
      else if (!(e.kind === "error" && cur.stopped)) cur.entries.push(e);
      prev = { kind: e.kind, mark: mark };
    });
    return turns;
  }

  /** The owner's side of the thread: message 0 (the prompt) and the messages, by seq. */
  function threadMessages(t) {
    var list = Array.from(chat.messages.values()).sort(function (a, b) { return a.seq - b.seq; });
    if (list.length && list[0].seq === 0) return list; // a live conversation's prompt is its message 0
    return [{ seq: 0, text: t.prompt, state: null, id: "prompt", synthetic: true }].concat(list);
  }

  /** seq -> turn: each turn under the message its prompt entry names; without those
   *  marks, turn k answers the k-th message the agent got, and a transcript whose start
   *  is gone (more than the service keeps) is matched from its end. */
  function repliesBySeq(t, messages, turns) {
    var out = {};
    if (t.conversation !== "live") { if (turns.length) out[0] = turns[0]; return out; }
    if (turns.some(function (turn) { return turn.seq !== null; })) {
      turns.forEach(function (turn) { if (turn.seq !== null) out[turn.seq] = turn; });
      return out;
    }
    var given = messages.filter(function (m) { return m.synthetic || Chat.GIVEN[m.state]; });
    var offset = turns.length && turns[0].partial ? given.length - turns.length : 0;
    turns.forEach(function (turn, i) { var m = given[i + offset]; if (m) out[m.seq] = turn; });
    return out;
  }

  /** A text that folds after 12 lines (task.css), with "Show all" (its state kept by key). */
  function foldable(className, text, key) { return Chat.foldable(className, text, key, chat.unfolded); }
  function addFoldButtons(root) { Chat.addFoldButtons(root, chat.unfolded); }

  function replyTool(call, result) {
    var status = result ? result.status : (call.kind === "tool_result" ? call.status : null);
    var key = "tool:" + call.n;
    var details = el("details", { className: "reply-tool", "data-n": call.n, "data-status": status || "running" },
      el("summary", {},
        el("span", { className: "tool-name", dir: "auto", text: call.tool || "tool" }), " ",
        el("span", { className: "tool-text mono", dir: "auto", text: call.kind === "tool_call" ? (call.text || "") : "" }),
        status === "error" ? el("span", { className: "tool-flag", text: "failed" }) : null),
      call.kind === "tool_call" && call.text ? el("pre", { className: "tail", dir: "auto", text: call.text }) : null,
      el("pre", { className: "tail", dir: "auto",
                  text: (result ? result.text : call.kind === "tool_result" ? call.text : "") || (status ? "(no output)" : "(running…)") }));
    if (chat.open.has(key)) details.open = true;
    details.addEventListener("toggle", function () { if (details.open) chat.open.add(key); else chat.open.delete(key); });
    return details;
  }

  function replyItem(m, turn, working) {
    var li = el("li", { className: "reply", "data-seq": m.seq });
    if (turn) {
      var results = {};
      turn.entries.forEach(function (e) { if (e.kind === "tool_result" && e.call) results[e.call] = e; });
      turn.entries.forEach(function (e) {
        if (e.kind === "prompt") return; // the owner's side, shown as the bubble above
        if (e.kind === "message") li.appendChild(foldable("reply-text", e.text, "r:" + e.n));
        else if (e.kind === "tool_call") li.appendChild(replyTool(e, results[e.n]));
        else if (e.kind === "tool_result" && !(e.call && turn.entries.some(function (c) { return c.n === e.call; }))) {
          li.appendChild(replyTool(e, null));
        } else if (e.kind === "error") li.appendChild(el("div", { className: "reply-error", dir: "auto", text: e.text }));
      });
      if (turn.stopped) li.appendChild(el("div", { className: "reply-stopped", text: "stopped by you" }));
    }
    if (working) li.appendChild(el("div", { className: "reply-working muted", text: "the agent is working…" }));
    return li.childNodes.length ? li : null;
  }

  function messageItem(m, t) {
    var label = m.synthetic ? null : MESSAGE_LABELS[m.state] || m.state;
    // C10: a live conversation's message still waiting on the machine can be taken back.
    var waiting = !m.synthetic && m.seq > 0 && m.state === "sent" && t.conversation === "live" && conversationOpen(t);
    // C9: "now" (steered into the running turn) or "next" (its own turn), and where it landed.
    var delivery = !m.synthetic && m.seq > 0 && t.conversation === "live" ? m.delivery || "queue" : null;
    var where = m.synthetic ? null : Chat.landed(m);
    return el("li", { className: "msg", "data-seq": m.seq, "data-state": m.state || "prompt", "data-id": m.id,
                      "data-delivery": delivery || "" },
      foldable("msg-text", m.text || "", "m:" + m.seq),
      delivery || label ? el("div", { className: "msg-meta" },
        delivery ? el("span", { className: "msg-delivery", title: Chat.DELIVERY_TITLES[delivery],
                                text: Chat.DELIVERY[delivery] }) : null,
        where ? el("span", { className: "msg-landed", text: where }) : null,
        label ? el("span", { className: "msg-state", title: MESSAGE_TITLES[m.state] || "", text: label }) : null) : null,
      waiting ? withdrawButton(m, "withdraw", false) : null,
      waiting ? withdrawButton(m, "edit", true) : null,
      m.carrier ? el("a", { className: "msg-carrier", href: "/tasks/" + encodeURIComponent(m.carrier) + "/",
                            text: "its run" }) : null);
  }

  function withdrawButton(m, text, edit) {
    var b = el("button", { type: "button", className: "msg-" + text + " link", text: text });
    b.addEventListener("click", function () { b.disabled = true; withdrawMessage(m, edit); });
    return b;
  }

  /* C10: withdraw message m (one of this and its delivery wins: the answer says which);
   * edit is withdraw, then its text back in the message box to change and send anew. */
  function withdrawMessage(m, edit) {
    var status = $("chat-status");
    C.tell(status, "Withdrawing…", false);
    return C.api("POST", taskPath("messages/" + m.seq + "/withdraw/"), {}).then(function (res) {
      if (res.status === 200) {
        keepMessage(res.data);
        renderChat(state.task);
        C.tell(status, edit ? "Withdrawn: change it and send it again." : "Withdrawn: the agent will not see it.", false);
        if (edit) { var box = $("chat-text"); box.value = m.text; box.focus(); }
        return;
      }
      C.tell(status, res.data && res.data.error === "already_delivered"
        ? "Too late: the agent already has it." : C.errorText(res.status, res.data), true);
    }).catch(function () { C.tell(status, "The service did not answer: try again (it decides once).", true); });
  }

  function renderChat(t) {
    $("chat").hidden = !isConversation(t);
    if (!isConversation(t)) { $("chat-form").hidden = true; return; }
    var open = conversationOpen(t);
    $("chat-mode").textContent = !open ? "ended" : t.conversation === "live"
      ? "the agent stays open between turns" : "each message resumes the agent's session";
    var follow = nearEnd();
    var sorted = Array.from(state.entries.values()).sort(function (a, b) { return a.n - b.n; });
    var messages = threadMessages(t);
    chat.turns = turnsOf(sorted);
    var replies = repliesBySeq(t, messages, chat.turns);
    var lastGiven = null;
    chat.firstWorking = false;
    messages.forEach(function (m) { if (m.synthetic || Chat.GIVEN[m.state]) lastGiven = m; });
    var list = $("chat-log");
    list.textContent = "";
    messages.forEach(function (m) {
      list.appendChild(messageItem(m, t));
      var working = open && LEASED[t.state] && m === lastGiven &&
        (m.synthetic ? firstTurnWorking(replies[0]) : m.state === "delivered" || (m.state === "consumed" && turnRunning()));
      if (m.synthetic) chat.firstWorking = working;
      var reply = replyItem(m, replies[m.seq], working);
      if (reply) list.appendChild(reply);
    });
    addFoldButtons(list);
    $("chat-form").hidden = !open;
    $("chat-delivery").hidden = !(open && t.conversation === "live" && !chat.steerUnsupported);
    $("chat-interrupt").hidden = !(open && t.conversation === "live" && (turnRunning() || chat.firstWorking));
    renderApprovals();
    if (follow) keepNewestInView();
    if (state.earlier !== null && state.earlier !== undefined && !chat.loadingEarlier) {
      chat.loadingEarlier = true; // the whole transcript, so each turn finds its message
      loadEarlier().then(function () { chat.loadingEarlier = false; });
    }
  }

  /* A synthetic message 0 (the task's prompt) has no message row to say its turn ended:
   * it is working while nothing came back yet or a tool call is the last word. */
  function firstTurnWorking(turn) {
    if (!turn) return true;
    var rest = turn.entries.filter(function (e) { return e.kind !== "prompt"; });
    if (!rest.length) return true;
    var last = rest[rest.length - 1];
    return !turn.stopped && (last.kind === "tool_call" || last.kind === "tool_result");
  }

  /* The newest bubble stays above the message box (sticky at the bottom of the screen). */
  function nearEnd() { return Chat.nearEnd($("chat-log"), $("chat-form")); }
  function keepNewestInView() { chat.scrolls += Chat.keepNewestInView($("chat-log"), $("chat-form")); }

  function loadMessages() {
    if (!isConversation(state.task)) return Promise.resolve();
    return C.api("GET", taskPath("messages/")).then(function (res) {
      if (res.status !== 200) return;
      res.data.results.forEach(keepMessage);
      renderChat(state.task);
    }).catch(function () { /* the next event or reconnect reads them again */ });
  }

  function sendMessage(e) {
    if (e) e.preventDefault();
    if (chat.sending) return; // a double tap: the key would replay anyway (A2)
    var text = $("chat-text").value, status = $("chat-status");
    if (!text.trim()) { C.tell(status, "Write a message first.", true); return; }
    // C9: "next" (queue, the default) or "now" (steer), as the composer's choice says.
    var choice = document.querySelector("#chat-delivery input[name=delivery]:checked");
    var delivery = !$("chat-delivery").hidden && choice ? choice.value : "queue";
    chat.sending = true;
    $("chat-send").disabled = true;
    C.tell(status, "Sending…", false);
    C.api("POST", taskPath("messages/"), { text: text, delivery: delivery }, { "Idempotency-Key": chat.key })
      .then(function (res) {
        if (res.status === 201) {
          chat.key = C.newKey(); // the next message is a new request
          // Empty the box only if it still holds what was sent: what the owner typed
          // while it was sending is the next message, not to be lost.
          if ($("chat-text").value === text) $("chat-text").value = "";
          var next = document.querySelector("#chat-delivery input[value=queue]");
          if (next) next.checked = true; // C9: "now" is for one message; the default is "next" again
          C.tell(status, "", false);
          keepMessage(res.data);
          renderChat(state.task);
          keepNewestInView();
          return;
        }
        if (res.data && res.data.error === "idempotency_key_reused") chat.key = C.newKey();
        if (res.data && res.data.error === "steer_unsupported") { // nothing was stored: send it as next
          chat.steerUnsupported = true;
          renderChat(state.task);
          C.tell(status, "This agent cannot take a message into a running turn: it will go next. Send again.", true);
          return;
        }
        C.tell(status, C.errorText(res.status, res.data), true);
      })
      .catch(function () { C.tell(status, "Network error: send again (the agent gets it once).", true); })
      .then(function () { chat.sending = false; $("chat-send").disabled = false; });
  }

  function chatAction(path, doing, done) {
    var status = $("chat-status");
    C.tell(status, doing, false);
    return C.api("POST", taskPath(path), {}).then(function (res) {
      if (res.status === 200 || res.status === 202) {
        C.tell(status, done, false);
        if (res.data && res.data.version >= state.version) { state.task = res.data; state.version = res.data.version; render(); }
        return;
      }
      C.tell(status, C.errorText(res.status, res.data), true);
    }).catch(function () { C.tell(status, "The service did not answer: try again.", true); });
  }

  /* Q2 in the chat: what will change, in words (chat.js). */
  function renderApprovals() {
    var list = $("chat-approvals");
    list.textContent = "";
    chat.approvals.forEach(function (a) { list.appendChild(Chat.approvalItem(a, decide)); });
    list.hidden = chat.approvals.size === 0;
  }

  function keepApproval(a) {
    if (a.task !== taskId) return;
    if (a.state === "pending") chat.approvals.set(a.id, a); else chat.approvals.delete(a.id);
  }

  function loadApprovals() {
    if (!isConversation(state.task)) return Promise.resolve();
    return C.api("GET", "/api/approvals/?state=pending&task=" + encodeURIComponent(taskId)).then(function (res) {
      if (res.status !== 200) return;
      chat.approvals.clear();
      res.data.results.forEach(keepApproval);
      renderApprovals();
    }).catch(function () { /* the next event or reconnect reads them again */ });
  }

  function decide(a, behavior) {
    return Chat.decide(a, behavior, chat.keys).then(function (r) {
      if (r.approval) { keepApproval(r.approval); renderApprovals(); return; }
      C.tell($("chat-status"), r.error, true);
    });
  }

  function renderTimeline() {
    var ul = el("ul", { className: "timeline" });
    state.timeline.forEach(function (item) {
      ul.appendChild(el("li", { className: "tl-" + item.kind, "data-kind": item.kind }, timeEl(item.at), " ", item.text));
    });
    fill("timeline-body", ul);
  }

  /* Receipts as a readable list (inside "Run details" on a conversation): each fact a
   * "name: value" line, nested facts by their dotted path, no JSON. */
  var RECEIPT_ROWS = 24;
  /* The agent's raw output (its stream's last lines) is the run's "raw" view, not a fact to read here. */
  var RECEIPT_SKIP = { output_tail: true };
  function factRows(facts, prefix, rows) {
    Object.keys(facts || {}).forEach(function (k) {
      var v = facts[k], name = prefix ? prefix + "." + k : k;
      if (rows.length > RECEIPT_ROWS || v === null || v === undefined || v === "" || RECEIPT_SKIP[name]) return;
      if (Array.isArray(v)) {
        if (!v.length) return;
        rows.push([name, v.map(function (x) { return typeof x === "object" ? Object.values(x || {}).join(" ") : String(x); })
                          .join(", ").slice(0, 300)]);
      } else if (typeof v === "object") factRows(v, name, rows);
      else rows.push([name, String(v).slice(0, 300)]);
    });
    return rows;
  }

  function renderReceipts() {
    var ul = el("ul", { className: "plain receipts" });
    state.receipts.forEach(function (r) {
      var rows = factRows(r.facts, "", []);
      ul.appendChild(el("li", { "data-kind": r.kind },
        el("div", { className: "line" }, el("strong", { text: r.kind }), " ", timeEl(r.received_at),
           r.slept_s ? el("span", { className: "muted", text: " slept " + fmtSeconds(r.slept_s) }) : null),
        rows.length ? kv(rows) : null));
    });
    fill("receipts-body", ul);
    var ids = $("run-ids"), t = state.task;
    if (ids) fill("run-ids", kv([["task", t.id], ["agent session", t.agent_session_id || null]]));
  }

  function render() {
    var t = state.task;
    renderHeader(t); renderRun(t); renderResult(t); renderBranch(t); renderGit(t); renderReply(t); renderChat(t);
    renderTimeline();
    renderReceipts();
    $("decide").hidden = t.state !== "unknown";
  }

  function reload() {
    return C.api("GET", "/tasks/" + encodeURIComponent(taskId) + "/data/")
      .then(function (res) {
        if (res.status !== 200) return;
        var d = res.data;
        if (d.task.version >= state.version) {
          state.task = d.task; state.timeline = d.timeline; state.receipts = d.receipts; state.git_line = d.git_line;
          state.queue = d.queue || [];
          addEntries(d.entries);
          if (state.earlier === null && d.entries_next && !state.entries.has(d.entries_next.before - 1)) {
            state.earlier = d.entries_next.before;
          }
          state.version = d.task.version; state.progressVersion = Math.max(state.progressVersion, d.task.version);
          render();
        }
        return Promise.all([loadMessages(), loadApprovals()]);
      }).catch(function () { /* next event or reconnect tries again */ });
  }

  function onEvent(ev) {
    if (ev.type === "task" && ev.task && ev.task.id === taskId && ev.version > state.version) {
      var shown = state.task.evidence && state.task.evidence.git, told = ev.task.evidence && ev.task.evidence.git;
      if (shown && shown.files && told && !told.files && told.end_head === shown.end_head) {
        ev.task.evidence = state.task.evidence; // events carry no files or diff (G7): keep the full ones
      }
      state.task = Object.assign({}, state.task, ev.task);
      state.version = ev.version;
      render();
      reload();
    } else if (ev.type === "message" && ev.message && ev.message.task === taskId) {
      keepMessage(ev.message);
      renderChat(state.task);
    } else if (ev.type === "approval" && ev.approval && ev.approval.task === taskId) {
      keepApproval(ev.approval);
      renderApprovals();
    } else if (ev.type === "task.progress" && ev.task_id === taskId && ev.version > state.progressVersion) {
      state.progressVersion = ev.version;
      state.progressEvents++;
      state.task = Object.assign({}, state.task, { progress: ev.progress });
      var before = lastN(), fresh = (ev.progress && ev.progress.entries) || [];
      addEntries(fresh);
      renderRun(state.task);
      if (fresh.length && before && fresh[0].n > before + 1) catchUp(before);
    }
  }

  function setConn(s, text) { var c = $("conn"); if (c) { c.dataset.state = s; c.textContent = text; } }
  function connect() {
    Chat.connectBoard({ onOpen: reload, onState: setConn,
                        onEvent: function (ev) { state.messages++; if (ev) onEvent(ev); } });
  }

  addEntries(page.entries);
  $("load-earlier").addEventListener("click", loadEarlier);
  $("reply-form").addEventListener("submit", sendReply);
  $("chat-form").addEventListener("submit", sendMessage);
  $("chat-text").addEventListener("keydown", function (e) {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) sendMessage(e);
  });
  $("chat-interrupt").addEventListener("click", function () {
    chatAction("interrupt/", "Stopping this turn…", "Stop sent: the agent ends this turn and waits for you.");
  });
  $("chat-end").addEventListener("click", function () {
    chatAction("end/", "Ending…", "Ended: the agent finishes what it is doing, then stops.");
  });
  $("raw-toggle").addEventListener("click", function () { state.raw = !state.raw; renderRun(state.task); });
  $("merge-button").addEventListener("click", function () { integrate("merge"); });
  $("discard-button").addEventListener("click", function () {
    if (!discardArmed) { // a discard throws the work away: a second tap confirms it
      discardArmed = true;
      $("discard-button").textContent = "Tap again to discard";
      C.tell($("integrate-note"), "Discard removes the branch and its worktree.", false);
      return;
    }
    discardArmed = false;
    $("discard-button").textContent = "Discard";
    integrate("discard");
  });
  render();
  connect();
})();
