/*
 * History (SPEC B11) and follow-ups (B12) on the board. Plain JS, no build step.
 *
 * The list is GET /api/tasks/ (newest first, ties broken by id, `?limit=`), filtered by
 * state, machine, session and a prompt search (`?q=`); "Load more" follows the page's
 * `next` link, the stable cursor, so a page never repeats a row of the one before even
 * while new tasks arrive. Live `task` events (board.js re-dispatches them as
 * `runstead:event`) update a shown row when newer (B2 versions) and put a new task that
 * matches the filters on top.
 *
 * A final task whose facts carry an `agent_session_id` gets a reply box: it submits a
 * follow-up (G6: `continue_task`, the same machine, folder and agent, and the same
 * session) with an Idempotency-Key of its own, kept until the service has answered, so a
 * double click or a resubmit after a lost answer creates one task (A1, A2, B8).
 * Machines and sessions for the filters come from the board's state (window.runsteadBoard)
 * and GET /api/sessions/; sessions show title, agent and folder, those that need their
 * owner (I6) first.
 */
(function () {
  "use strict";

  var PAGE_SIZE = 20;
  var PROMPT_SHOWN = 300; // characters of a prompt shown in a row
  var FINAL = { succeeded: true, failed: true, failed_lease_lost: true, cancelled: true, not_started: true, abandoned: true };
  var AGENT_NAMES = { claude: "Claude Code", codex: "Codex", gemini: "Gemini CLI", opencode: "opencode", aider: "aider" };

  var history = {
    rows: new Map(), // task id -> {task, li, reply (the follow-up <details> or null)}
    order: [], // task ids as listed
    next: null, // the next page's URL (path + query), or null
    query: "", // the filter query string of the list shown
    pages: 0, // pages loaded for this filter (tests read it)
    loading: null, // the page fetch in flight
    generation: 0, // bumped on every new filter; a late page of an old filter is dropped
    followUps: 0, // follow-ups accepted (tests read it)
    sessions: new Map(), // from GET /api/sessions/, merged with the board's
  };
  window.runsteadHistory = history;

  var C = window.RunStead; // common.js
  var $ = C.$, el = C.el, ms = C.ms, fmtTime = C.fmtTime, fmtDuration = C.fmtDuration, newKey = C.newKey,
    errorText = C.errorText;
  function board() { return window.runsteadBoard || { machines: new Map(), sessions: new Map() }; }

  function say(text, isError) { C.tell($("history-status"), text, isError); }

  // ------------------------------------------------------------ names
  function machineName(id) {
    var m = board().machines.get(id);
    return m ? m.name : "machine " + String(id || "").slice(0, 8);
  }

  function folderName(path) {
    var parts = String(path || "").replace(/\/+$/, "").split("/");
    return parts[parts.length - 1] || path || "";
  }

  function sessionInfo(id) {
    return board().sessions.get(id) || history.sessions.get(id) || null;
  }

  /** "title · agent · folder" of a session (B11, I6); what it does not report is left out. */
  function sessionLabel(s) {
    var parts = [s.title || "Session " + String(s.id).slice(0, 8)];
    if (s.agent) parts.push(AGENT_NAMES[s.agent] || s.agent);
    if (s.cwd) parts.push(folderName(s.cwd));
    return parts.join(" · ");
  }

  // ------------------------------------------------------------ filters
  function filterValues() {
    var f = $("history-filters").elements;
    var values = {};
    ["state", "machine", "session"].forEach(function (name) { if (f[name].value) values[name] = f[name].value; });
    if (f.q.value.trim()) values.q = f.q.value;
    return values;
  }

  function queryString(values) {
    return Object.keys(values).sort().map(function (k) { return k + "=" + encodeURIComponent(values[k]); }).join("&");
  }

  /** Does a task belong in the list under these filters? (The API's rules, for live rows.) */
  function matches(task, values) {
    if (values.state && task.state !== values.state) return false;
    if (values.machine && task.machine !== values.machine) return false;
    if (values.session && task.session !== values.session) return false;
    if (values.q && String(task.prompt || "").toLowerCase().indexOf(values.q.toLowerCase()) < 0) return false;
    return true;
  }

  function fillSelect(select, options, emptyText) {
    var signature = options.map(function (o) { return o.value + ":" + o.text; }).join("|");
    if (select.dataset.signature === signature) return;
    var chosen = select.value;
    select.textContent = "";
    select.appendChild(el("option", { value: "", text: emptyText }));
    options.forEach(function (o) { select.appendChild(el("option", { value: o.value, text: o.text })); });
    // A chosen value stays offered even when its machine or session left the board.
    if (chosen && !options.some(function (o) { return o.value === chosen; })) {
      select.appendChild(el("option", { value: chosen, text: chosen.slice(0, 8) }));
    }
    select.value = chosen;
    select.dataset.signature = signature;
  }

  function renderFilterOptions() {
    var f = $("history-filters").elements;
    var machines = Array.from(board().machines.values()).sort(function (a, b) { return String(a.name).localeCompare(String(b.name)); });
    fillSelect(f.machine, machines.map(function (m) { return { value: m.id, text: m.name + (m.paired === false ? " (unpaired)" : "") }; }), "any machine");
    var all = new Map(history.sessions);
    board().sessions.forEach(function (s, id) { all.set(id, Object.assign({}, all.get(id) || {}, s)); });
    var sessions = Array.from(all.values()).sort(function (a, b) {
      var an = a.attention === "permission", bn = b.attention === "permission"; // I6: needs you first
      if (an !== bn) return an ? -1 : 1;
      return (ms(b.status_since || b.created_at) || 0) - (ms(a.status_since || a.created_at) || 0);
    });
    fillSelect(f.session, sessions.map(function (s) {
      return { value: s.id, text: (s.attention === "permission" ? "needs you: " : "") + sessionLabel(s) };
    }), "any session");
  }

  function loadSessions() {
    return C.api("GET", "/api/sessions/?limit=100")
      .then(function (res) {
        (res.status === 200 && res.data.results || []).forEach(function (s) { history.sessions.set(s.id, s); });
        renderFilterOptions();
        history.order.forEach(function (id) { renderRow(id); }); // session labels in rows
      })
      .catch(function () { /* the board's sessions still fill the filter */ });
  }

  // ------------------------------------------------------------ rows
  function facts(t) {
    var out = [];
    if (t.runtime_s !== null && t.runtime_s !== undefined) out.push("runtime " + fmtDuration(t.runtime_s));
    if (t.exit_code !== null && t.exit_code !== undefined) out.push("exit code " + t.exit_code);
    if (t.signal !== null && t.signal !== undefined) out.push("signal " + t.signal);
    if (t.state_reason && t.stop_reason !== "exit") out.push(t.state_reason);
    return out;
  }

  function rowBody(t) {
    var body = el("div", { className: "history-body" },
      el("div", { className: "line" },
        el("span", { className: "badge state-" + t.state, text: t.state.replace(/_/g, " ") }),
        el("strong", { text: t.agent || "" }),
        el("span", { className: "muted" }, "on " + machineName(t.machine)),
        t.created_at ? el("time", { className: "muted", datetime: t.created_at, text: fmtTime(t.created_at) }) : null),
      el("div", { className: "mono wrap folder", text: t.folder || "" }));
    if (t.session) {
      var s = sessionInfo(t.session);
      body.appendChild(el("div", { className: "muted wrap session-of" }, "session: " + (s ? sessionLabel(s) : String(t.session).slice(0, 8))));
    }
    if (t.continue_task) body.appendChild(el("div", { className: "muted" }, "follow-up of " + String(t.continue_task).slice(0, 8)));
    if (t.prompt) {
      body.appendChild(el("div", { className: "prompt wrap",
        text: t.prompt.length > PROMPT_SHOWN ? t.prompt.slice(0, PROMPT_SHOWN) + "…" : t.prompt }));
    }
    if (t.state === "unknown" && t.needs_decision) { // N1, U2: only once the facts could not settle it
      body.appendChild(el("div", { className: "line" },
        el("a", { className: "decide", href: "/admin/tasks_app/task/" + encodeURIComponent(t.id) + "/change/", text: "needs your decision" })));
    }
    var f = facts(t);
    if (f.length) body.appendChild(el("div", { className: "facts muted", text: f.join(" · ") }));
    if (t.agent_result && t.agent_result.summary) {
      body.appendChild(el("div", { className: "last-message wrap",
        text: (t.agent_result.is_error ? "agent error: " : "") + String(t.agent_result.summary).slice(0, PROMPT_SHOWN) }));
    }
    return body;
  }

  /** B12: a final task that names its agent's session can be answered. */
  function canFollowUp(t) { return !!(FINAL[t.state] && t.agent_session_id); }

  function renderRow(id) {
    var row = history.rows.get(id);
    if (!row) return;
    var t = row.task;
    var li = row.li || el("li", { className: "row task history-row" });
    li.setAttribute("data-history-task-id", t.id); // not data-task-id: the Tasks card owns that selector
    li.setAttribute("data-state", t.state);
    var body = rowBody(t);
    if (li.firstChild && li.firstChild.className === "history-body") li.replaceChild(body, li.firstChild);
    else li.insertBefore(body, li.firstChild);
    if (canFollowUp(t) && !row.reply) {
      row.reply = replyBox(t);
      li.appendChild(row.reply);
    }
    row.li = li;
  }

  function putRow(task, atTop) {
    var row = history.rows.get(task.id);
    if (row) {
      if (row.task.version !== undefined && task.version !== undefined && !(task.version > row.task.version)) return false;
      row.task = Object.assign({}, row.task, task);
      renderRow(task.id);
      return true;
    }
    history.rows.set(task.id, { task: Object.assign({}, task), li: null, reply: null });
    renderRow(task.id);
    var list = $("history-list");
    var li = history.rows.get(task.id).li;
    if (atTop) { history.order.unshift(task.id); list.insertBefore(li, list.firstChild); sayCount(); }
    else { history.order.push(task.id); list.appendChild(li); }
    $("history-empty").hidden = true;
    return true;
  }

  // ------------------------------------------------------------ B12 follow-up box
  function replyBox(t) {
    var details = el("details", { className: "follow-up" });
    var form = el("form", { className: "follow-up-form", autocomplete: "off" });
    var textarea = el("textarea", { name: "prompt", rows: "3", required: true, "aria-label": "Follow-up prompt" });
    var button = el("button", { type: "submit", text: "Send follow-up" });
    var status = el("p", { className: "muted", role: "status", "aria-live": "polite" });
    details.appendChild(el("summary", { text: "↩ Reply to " + (AGENT_NAMES[t.agent] || t.agent || "the agent") }));
    form.appendChild(el("label", null, "Your answer (resumes the agent's session on " + machineName(t.machine) + ")", textarea));
    form.appendChild(el("div", { className: "actions" }, button));
    form.appendChild(status);
    details.appendChild(form);
    form.dataset.idempotencyKey = newKey(); // one per form (B8, B12)
    var sending = false;

    function tell(text, isError) { C.tell(status, text, isError); }

    form.addEventListener("submit", function (e) {
      e.preventDefault();
      if (sending) return; // the double click's second click; the key would replay anyway
      var source = history.rows.get(t.id).task;
      var body = { machine: source.machine, folder: source.folder, agent: source.agent, prompt: textarea.value,
                   continue_task: source.id, deep_research: !!source.deep_research };
      if (source.session) body.session = source.session;
      if (source.max_runtime_s) body.max_runtime_s = source.max_runtime_s;
      if (source.exclusive === false) body.exclusive = false;
      sending = true;
      button.disabled = true;
      tell("Sending…", false);
      C.api("POST", "/api/tasks/", body, { "Idempotency-Key": form.dataset.idempotencyKey })
        .then(function (res) {
          if (res.status === 201) {
            history.followUps++;
            form.dataset.idempotencyKey = newKey(); // the next answer is a new request
            textarea.value = "";
            // G8: while an earlier follow-up still runs, this one waits for its turn.
            tell(res.data && res.data.state === "queued" ? "Queued: it runs when the one before it has finished."
                 : "Follow-up accepted.", false);
            var created = res.data;
            if (created && created.id && matches(created, history.filters || {})) putRow(created, true);
            return;
          }
          if (res.data && res.data.error === "idempotency_key_reused") {
            form.dataset.idempotencyKey = newKey(); // a changed answer after an accepted one is a new request
            tell("This box was already sent with other text; send again for a new follow-up.", true);
            return;
          }
          tell(errorText(res.status, res.data), true);
        })
        .catch(function () {
          // The service may have accepted it: keep the key so sending again replays (A2).
          tell("Network error; send again (it will not create a second task).", true);
        })
        .then(function () { sending = false; button.disabled = false; });
    });
    return details;
  }

  // ------------------------------------------------------------ paging
  function sayCount() {
    var n = history.order.length;
    say(n + " task" + (n === 1 ? "" : "s") + " shown" + (history.next ? "" : ", all of them"), false);
  }

  function load(reset) {
    if (reset) {
      history.generation++;
      history.filters = filterValues();
      history.query = queryString(history.filters);
      history.next = "/api/tasks/?" + (history.query ? history.query + "&" : "") + "limit=" + PAGE_SIZE;
      history.rows = new Map();
      history.order = [];
      history.pages = 0;
      $("history-list").textContent = "";
      history.loading = null;
    }
    if (history.loading || !history.next) return history.loading;
    var generation = history.generation;
    var more = $("history-more");
    more.disabled = true;
    say("Loading…", false);
    history.loading = C.api("GET", history.next)
      .then(function (res) {
        if (generation !== history.generation) return;
        if (res.status !== 200) { say(errorText(res.status, res.data), true); return; }
        (res.data.results || []).forEach(function (t) { putRow(t, false); });
        history.pages++;
        history.next = res.data.next ? relative(res.data.next) : null;
        $("history-empty").hidden = history.order.length > 0;
        sayCount();
      })
      .catch(function () { if (generation === history.generation) say("Could not load the history; try again.", true); })
      .then(function () {
        if (generation !== history.generation) return;
        history.loading = null;
        more.disabled = false;
        more.hidden = !history.next;
      });
    return history.loading;
  }

  /** A task not shown yet goes on top only if it is newer than the top row; an older one
   *  belongs on a later page, which "Load more" brings in its place. */
  function newerThanShown(task) {
    if (!history.order.length) return !history.next;
    var top = history.rows.get(history.order[0]).task;
    return (ms(task.created_at) || 0) > (ms(top.created_at) || 0) ||
      (task.created_at === top.created_at && String(task.id) > String(top.id));
  }

  /** The `next` link is absolute; fetch it on this page's origin. */
  function relative(url) {
    var u = new URL(url, window.location.href);
    return u.pathname + u.search;
  }

  // ------------------------------------------------------------ start
  function start() {
    if (!$("history-panel")) return;
    var form = $("history-filters");
    form.addEventListener("submit", function (e) { e.preventDefault(); load(true); });
    ["state", "machine", "session"].forEach(function (name) {
      form.elements[name].addEventListener("change", function () { load(true); });
    });
    form.elements.q.addEventListener("search", function () { load(true); }); // the field's clear button
    $("history-clear").addEventListener("click", function () { form.reset(); load(true); });
    $("history-more").addEventListener("click", function () { load(false); });
    document.addEventListener("runstead:event", function (e) {
      var ev = e.detail || {};
      if (ev.type !== "task" || !ev.task) return;
      var task = Object.assign({}, ev.task, { version: ev.version !== undefined ? ev.version : ev.task.version });
      if (history.rows.has(task.id)) putRow(task, false);
      else if (history.pages > 0 && matches(task, history.filters || {}) && newerThanShown(task)) putRow(task, true);
    });
    document.addEventListener("runstead:render", renderFilterOptions);
    renderFilterOptions();
    loadSessions();
    load(true);
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
