/* RunStead session page (SPEC T6): a chat with a session started in a terminal, phone first.
 *
 * The page embeds the session (GET /api/sessions/{id}/ shape); this script reads its
 * messages (GET /api/sessions/{id}/messages/, T2) and its pending approvals
 * (GET /api/approvals/?state=pending&session=ID, Q6), then listens on the board's socket
 * (/ws/board/, B2: `session.message`, `session.status`, `approval`, `session.deleted`)
 * and re-reads all three on every (re)connect (B4).
 * The thread: each owner message with its state in words (sent, with the agent, answered,
 * not delivered, withdrawn; a waiting one has "withdraw", C10), and under the last message
 * a turn answered, that turn's last assistant message (`reply`, from Claude Code's Stop
 * hook). The box (POST .../messages/, one Idempotency-Key per message until it is
 * accepted, Ctrl/Cmd+Enter sends) says how a message reaches the session now (T1:
 * `reach`); "Stop this turn" (POST .../interrupt/, T5) shows for a session under the
 * terminal wrapper while a turn runs. The rendering parts are chat.js's, shared with the
 * task page's chat; everything written by the agent or the owner is textContent.
 */
(function () {
  "use strict";
  var dataEl = document.getElementById("session-data");
  if (!dataEl) return;
  var C = window.RunStead, Chat = window.RunSteadChat;
  var $ = C.$, el = C.el;
  var session = JSON.parse(dataEl.textContent), id = session.id;
  var state = { session: session, messages: new Map(), approvals: new Map(), key: C.newKey(), sending: false,
                keys: {}, unfolded: new Set(), events: 0, reloads: 0, scrolls: 0, deleted: false };
  window.runsteadSession = state; // tests read it
  var REACHABLE = { terminal: true, hook: true };

  function path(rest) { return "/api/sessions/" + encodeURIComponent(id) + "/" + rest; }
  function reachable(s) { return !!s.machine && !!REACHABLE[s.channel]; }

  function renderHeader() {
    var s = state.session;
    var badge = $("session-status");
    badge.textContent = state.deleted ? "ended" : s.status;
    badge.className = "badge " + (state.deleted ? "" : s.status);
    $("session-title").textContent = s.title || "session";
    $("session-agent").textContent = s.agent || "";
    $("session-cwd").textContent = s.cwd || "";
    var reach = $("reach");
    reach.textContent = reachable(s) ? "A message arrives " + s.reach + "." : s.reach;
    reach.dataset.channel = s.channel;
    $("chat-send").disabled = state.sending || !reachable(s) || state.deleted;
    $("chat-interrupt").hidden = !(s.channel === "terminal" && s.machine && (s.status === "busy" || turnRunning()));
  }

  function turnRunning() {
    var running = false;
    state.messages.forEach(function (m) { if (m.state === "delivered") running = true; });
    return running;
  }

  function keepMessage(m) {
    if (!m || m.session_id !== id) return;
    var known = state.messages.get(m.id);
    if (!known || m.version >= known.version) state.messages.set(m.id, m);
  }

  function messageItem(m) {
    var waiting = m.state === "sent";
    return el("li", { className: "msg", "data-seq": m.seq, "data-state": m.state, "data-id": m.id },
      Chat.foldable("msg-text", m.text || "", "m:" + m.seq, state.unfolded),
      el("span", { className: "msg-state", title: Chat.TITLES[m.state] || "", text: Chat.LABELS[m.state] || m.state }),
      waiting ? withdrawButton(m) : null);
  }

  function withdrawButton(m) {
    var b = el("button", { type: "button", className: "msg-withdraw link", text: "withdraw" });
    b.addEventListener("click", function () {
      b.disabled = true;
      var status = $("chat-status");
      C.api("POST", path("messages/" + m.seq + "/withdraw/"), {}).then(function (res) {
        if (res.status === 200) { keepMessage(res.data); renderChat(); C.tell(status, "Withdrawn: the agent will not see it.", false); return; }
        C.tell(status, res.data && res.data.error === "message_not_sent" ? "Too late: the agent already has it."
          : C.errorText(res.status, res.data), true);
      }).catch(function () { C.tell(status, "The service did not answer: try again (it decides once).", true); });
    });
    return b;
  }

  function renderChat() {
    var list = $("chat-log"), form = $("chat-form");
    var follow = Chat.nearEnd(list, form);
    var messages = Array.from(state.messages.values()).sort(function (a, b) { return a.seq - b.seq; });
    list.textContent = "";
    messages.forEach(function (m, i) {
      list.appendChild(messageItem(m));
      // One turn can answer several messages (all those it took): its reply goes under the last.
      var next = messages[i + 1];
      var lastOfTurn = !next || next.answered_at !== m.answered_at || next.reply !== m.reply;
      if (m.state === "answered" && m.reply && lastOfTurn) {
        list.appendChild(el("li", { className: "reply", "data-seq": m.seq },
          Chat.foldable("reply-text", m.reply, "r:" + m.seq, state.unfolded)));
      } else if (m.state === "delivered" && !next) {
        list.appendChild(el("li", { className: "reply", "data-seq": m.seq },
          el("div", { className: "reply-working muted", text: "the agent is working…" })));
      }
    });
    Chat.addFoldButtons(list, state.unfolded);
    $("chat-empty").hidden = messages.length > 0;
    renderHeader();
    if (follow) state.scrolls += Chat.keepNewestInView(list, form);
  }

  function keepApproval(a) {
    if (!a || a.session !== id) return;
    if (a.state === "pending") state.approvals.set(a.id, a); else state.approvals.delete(a.id);
  }
  function renderApprovals() {
    var list = $("chat-approvals");
    list.textContent = "";
    state.approvals.forEach(function (a) { list.appendChild(Chat.approvalItem(a, decide)); });
    list.hidden = state.approvals.size === 0;
  }
  function decide(a, behavior) {
    return Chat.decide(a, behavior, state.keys).then(function (r) {
      if (r.approval) { keepApproval(r.approval); renderApprovals(); return; }
      C.tell($("chat-status"), r.error, true);
    });
  }

  function reload() {
    state.reloads++;
    var s = C.api("GET", path("")).then(function (res) {
      if (res.status === 404) { state.deleted = true; renderHeader(); return; }
      if (res.status === 200 && res.data.version >= state.session.version) { state.session = res.data; renderHeader(); }
    });
    var m = C.api("GET", path("messages/")).then(function (res) {
      if (res.status !== 200) return;
      res.data.results.forEach(keepMessage);
      renderChat();
    });
    var a = C.api("GET", "/api/approvals/?state=pending&session=" + encodeURIComponent(id)).then(function (res) {
      if (res.status !== 200) return;
      state.approvals.clear();
      res.data.results.forEach(keepApproval);
      renderApprovals();
    });
    return Promise.all([s, m, a]).catch(function () { /* the next event or reconnect reads again */ });
  }

  function onEvent(ev) {
    state.events++;
    if (!ev) return;
    if (ev.type === "session.message" && ev.session_id === id) {
      keepMessage(ev);
      renderChat();
    } else if (ev.type === "session.status" && ev.session_id === id && ev.version >= state.session.version) {
      var s = Object.assign({}, state.session);
      Object.keys(ev).forEach(function (k) { if (k !== "type" && k !== "session_id" && k !== "announced" && k !== "server_time") s[k] = ev[k]; });
      state.session = s;
      renderHeader();
    } else if (ev.type === "session.deleted" && ev.session_id === id) {
      state.deleted = true;
      renderHeader();
    } else if (ev.type === "approval" && ev.approval && ev.approval.session === id) {
      keepApproval(ev.approval);
      renderApprovals();
    }
  }

  function send(e) {
    if (e) e.preventDefault();
    if (state.sending) return; // a double tap: the key would replay anyway (A2)
    var text = $("chat-text").value, status = $("chat-status");
    if (!text.trim()) { C.tell(status, "Write a message first.", true); return; }
    state.sending = true;
    $("chat-send").disabled = true;
    C.tell(status, "Sending…", false);
    C.api("POST", path("messages/"), { text: text }, { "Idempotency-Key": state.key })
      .then(function (res) {
        if (res.status === 201) {
          state.key = C.newKey(); // the next message is a new request
          if ($("chat-text").value === text) $("chat-text").value = ""; // keep what was typed meanwhile
          C.tell(status, "", false);
          keepMessage(res.data);
          renderChat();
          state.scrolls += Chat.keepNewestInView($("chat-log"), $("chat-form"));
          return;
        }
        if (res.data && res.data.error === "idempotency_key_reused") state.key = C.newKey();
        C.tell(status, C.errorText(res.status, res.data), true);
      })
      .catch(function () { C.tell(status, "Network error: send again (the agent gets it once).", true); })
      .then(function () { state.sending = false; renderHeader(); });
  }

  function interrupt() {
    var status = $("chat-status");
    C.tell(status, "Stopping this turn…", false);
    return C.api("POST", path("interrupt/"), {}).then(function (res) {
      if (res.status === 200 || res.status === 202) {
        C.tell(status, "Stop sent: the agent ends this turn and waits for you.", false);
        return;
      }
      C.tell(status, C.errorText(res.status, res.data), true);
    }).catch(function () { C.tell(status, "The service did not answer: try again.", true); });
  }

  function setConn(s, text) { var c = $("conn"); if (c) { c.dataset.state = s; c.textContent = text; } }

  $("chat-form").addEventListener("submit", send);
  $("chat-text").addEventListener("keydown", function (e) {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) send(e);
  });
  $("chat-interrupt").addEventListener("click", interrupt);
  renderHeader();
  renderChat();
  Chat.connectBoard({ onOpen: reload, onEvent: onEvent, onState: setConn });
})();
