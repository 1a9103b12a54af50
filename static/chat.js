/* The chat both pages draw (a conversation task's, task.js; a terminal session's,
 * session.js, T6): loaded after common.js, exposed as window.RunSteadChat.
 *
 *   LABELS, TITLES                    a message state in words, and what it means (C3, C9, C10, T2)
 *   DELIVERY, DELIVERY_TITLES         a message's delivery in words: "now" (steer) or "next"
 *                                     (queue), and what it means (C9)
 *   landed(m) -> text | null          where a message landed (C9 `turn_seq`): "its own turn",
 *                                     "joined the turn of message N", "joined your first turn"
 *   GIVEN                             the states of a message the agent has (delivered,
 *                                     consumed, answered)
 *   foldable(className, text, key, unfolded)  a dir="auto" text that folds after its CSS
 *                                     height (task.css .fold), unfolded when `unfolded` has key
 *   addFoldButtons(root, unfolded)    "Show all" under each folded text of root
 *   approvalItem(a, decide)           one pending approval (Q2) in words: what will change,
 *                                     Allow / Deny calling decide(a, "allow" | "deny")
 *   decide(a, behavior, keys)         POST its decision (one Idempotency-Key per approval and
 *                                     answer, kept in keys) -> Promise<{approval} | {error}>
 *   nearEnd(list, form), keepNewestInView(list, form) -> scrolls made: the newest bubble
 *                                     stays above the sticky message box
 *   connectBoard({onOpen, onEvent, onState})  the board socket (/ws/board/, B2) with backoff;
 *                                     onOpen runs on every (re)connect: re-read there (B4)
 * Everything the agent or the owner wrote is set as textContent (common.js el).
 */
(function () {
  "use strict";
  var C = window.RunStead, el = C.el;

  var LABELS = { sent: "sent", delivered: "with the agent", consumed: "taken in", answered: "answered",
                 undelivered: "not delivered", withdrawn: "withdrawn" };
  var TITLES = { sent: "waiting on your machine for the current turn to end",
                 delivered: "the agent has it", consumed: "the agent took it into a turn",
                 answered: "its turn ended",
                 undelivered: "the conversation ended before it was written to the agent",
                 withdrawn: "you took it back before the agent saw it" };

  var DELIVERY = { steer: "now", queue: "next" };
  var DELIVERY_TITLES = { steer: "steered: into the turn that runs, as soon as the agent can take it",
                          queue: "queued: its own turn, after the current one" };
  var GIVEN = { delivered: true, consumed: true, answered: true };
  function landed(m) {
    if (m.turn_seq === null || m.turn_seq === undefined) return null;
    if (m.turn_seq === m.seq) return m.delivery === "steer" ? "became its own turn" : null;
    return m.turn_seq === 0 ? "joined the first turn" : "joined the turn of message " + m.turn_seq;
  }

  function foldable(className, text, key, unfolded) {
    var body = el("div", { className: className + " fold", dir: "auto", text: text, "data-fold": key });
    if (unfolded.has(key)) body.classList.add("unfolded");
    return body;
  }
  function addFoldButtons(root, unfolded) {
    root.querySelectorAll(".fold:not(.unfolded)").forEach(function (body) {
      if (body.scrollHeight <= body.clientHeight + 2) return;
      body.classList.add("folded");
      var more = el("button", { type: "button", className: "link show-all", text: "Show all" });
      more.addEventListener("click", function () {
        unfolded.add(body.dataset.fold);
        body.classList.remove("folded"); body.classList.add("unfolded"); more.remove();
      });
      body.after(more);
    });
  }

  /* Q2 in the chat: what will change, in words: the command (and what it says it does),
   * the file and its edit as - / + lines, or the input's fields one a line; never JSON. */
  var CHANGE_LINES = 12;
  function clip(text) {
    var lines = String(text).split("\n");
    return lines.length > CHANGE_LINES ? lines.slice(0, CHANGE_LINES).join("\n") + "\n… (" + (lines.length - CHANGE_LINES) + " more lines)" : lines.join("\n");
  }
  function change(a) {
    var input = a.tool_input || {}, target = null, body = null;
    function prefixed(text, mark) { return String(text).split("\n").map(function (l) { return mark + l; }).join("\n"); }
    if (typeof input.command === "string") { target = input.description || null; body = "$ " + input.command; }
    else if (typeof input.file_path === "string" || typeof input.notebook_path === "string") {
      target = input.file_path || input.notebook_path;
      if (Array.isArray(input.edits)) {
        body = input.edits.map(function (e) { return prefixed(e.old_string || "", "- ") + "\n" + prefixed(e.new_string || "", "+ "); }).join("\n");
      } else if (typeof input.old_string === "string" || typeof input.new_string === "string") {
        body = prefixed(input.old_string || "", "- ") + "\n" + prefixed(input.new_string || "", "+ ");
      } else if (typeof input.content === "string") body = prefixed(input.content, "+ ");
      else if (typeof input.new_source === "string") body = prefixed(input.new_source, "+ ");
    } else {
      body = Object.keys(input).map(function (k) {
        var v = input[k];
        return k + ": " + (typeof v === "string" ? v : JSON.stringify(v));
      }).join("\n");
    }
    return { target: target, body: body ? clip(body) : null };
  }

  function approvalItem(a, decide) {
    var allow = el("button", { type: "button", className: "approve", text: "Allow" });
    var deny = el("button", { type: "button", className: "secondary deny", text: "Deny" });
    allow.addEventListener("click", function () { decide(a, "allow"); });
    deny.addEventListener("click", function () { decide(a, "deny"); });
    var c = change(a);
    return el("li", { className: "chat-approval", "data-id": a.id },
      el("div", { className: "line" }, el("span", { text: "The agent asks to use" }),
         el("strong", { dir: "auto", text: a.tool_name }),
         c.target ? el("span", { className: "mono wrap", dir: "auto", text: c.target }) : null),
      c.body ? el("pre", { className: "tail approval-change", dir: "auto", text: c.body }) : null,
      el("div", { className: "decisions" }, allow, deny));
  }

  function decide(a, behavior, keys) {
    var slot = a.id + ":" + behavior, key = keys[slot] || (keys[slot] = C.newKey());
    return C.api("POST", "/api/approvals/" + encodeURIComponent(a.id) + "/decision/", { behavior: behavior },
                 { "Idempotency-Key": key })
      .then(function (res) {
        if (res.status === 200) return { approval: res.data };
        if (res.status === 409 && res.data && res.data.approval) return { approval: res.data.approval };
        return { error: C.errorText(res.status, res.data) };
      }, function () { return { error: "The service did not answer: tap again (it decides once)." }; });
  }

  function nearEnd(list, form) {
    var last = list.lastElementChild;
    if (!last || form.hidden) return false;
    return last.getBoundingClientRect().bottom <= form.getBoundingClientRect().top + 80;
  }
  function keepNewestInView(list, form) {
    var last = list.lastElementChild, scrolls = 0;
    if (!last || form.hidden) return 0;
    for (var i = 0; i < 2; i++) { // the box moves with the page at its end: measure again
      var over = last.getBoundingClientRect().bottom - (form.getBoundingClientRect().top - 8);
      if (over <= 0) break;
      scrolls++;
      window.scrollBy(0, over);
    }
    return scrolls;
  }

  var BACKOFF_MIN_MS = 500, BACKOFF_MAX_MS = 30000;
  function connectBoard(opts) {
    var backoff = BACKOFF_MIN_MS, ws = null;
    function connect() {
      var proto = window.location.protocol === "https:" ? "wss:" : "ws:";
      var sock = new WebSocket(proto + "//" + window.location.host + "/ws/board/");
      ws = sock;
      opts.onState("connecting", "connecting…");
      sock.onopen = function () { backoff = BACKOFF_MIN_MS; opts.onState("live", "live"); opts.onOpen(); };
      sock.onmessage = function (e) {
        var ev; try { ev = JSON.parse(e.data); } catch (err) { ev = null; }
        opts.onEvent(ev);
      };
      sock.onclose = function () {
        if (ws !== sock) return;
        opts.onState("offline", "reconnecting…");
        var delay = backoff * (0.5 + Math.random() * 0.5);
        backoff = Math.min(BACKOFF_MAX_MS, backoff * 2);
        setTimeout(connect, delay);
      };
    }
    connect();
  }

  window.RunSteadChat = { LABELS: LABELS, TITLES: TITLES, DELIVERY: DELIVERY, DELIVERY_TITLES: DELIVERY_TITLES,
                          GIVEN: GIVEN, landed: landed, foldable: foldable, addFoldButtons: addFoldButtons,
                          change: change, approvalItem: approvalItem, decide: decide, nearEnd: nearEnd,
                          keepNewestInView: keepNewestInView, connectBoard: connectBoard };
})();
