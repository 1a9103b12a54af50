/*
 * The approval inbox (SPEC Q6): every pending approval of the owner, across machines and
 * sessions, above everything else on the board, answered from the list: Allow, "Allow for
 * this session" (or "for this run", a task's) and Deny with an optional instruction to
 * the agent (a text field revealed by Deny).
 *
 * State is board.js's (window.runsteadBoard.approvals: `approval` events on create and
 * decision, and the B4 snapshot's pending list on every (re)connect); this module
 * re-renders after every board render. Rows are keyed by approval id and updated in
 * place, so a half-typed instruction or a focused button survives the board's 1 s tick.
 *
 * Answers: POST /api/approvals/{id}/decision/ with one Idempotency-Key per (approval,
 * action) per page (A1, Q2), so a double tap or a retry after a lost answer decides once;
 * 409 already_decided carries the approval as decided: the row shows the winner's answer.
 * A row answered from this page (or whose tap lost to another answer) loses its buttons
 * and shows what happened for LINGER_MS, then goes; one that stops being pending
 * elsewhere (another device, the terminal, expiry, withdrawal) goes at once (Q4).
 *
 * Everything the agent sent (tool name, input, folder, session title) is set as text,
 * never as HTML.
 */
(function () {
  "use strict";

  var LINGER_MS = 5000;
  var PREVIEW_KEYS = ["command", "file_path", "path", "url", "pattern"];

  var C = window.RunStead; // common.js
  var $ = C.$, el = C.el;
  function board() { return window.runsteadBoard; }

  // id -> {li, approval (last known), keys: {action: Idempotency-Key}, busy, mine, conflict, error, goneAt}
  var rows = new Map();
  var baseTitle = null;

  var AGENT_NAMES = { claude: "Claude Code", codex: "Codex", gemini: "Gemini CLI", opencode: "opencode", aider: "aider" };

  function nowMs() { var b = board(); return b && b.now ? b.now() : Date.now(); }

  function folderName(cwd) {
    var parts = String(cwd || "").replace(/\/+$/, "").split("/");
    return parts[parts.length - 1] || cwd || "";
  }

  function who(decidedBy) {
    var by = String(decidedBy || "");
    return by.indexOf("owner:") === 0 ? by.slice(6) : by;
  }

  /** What became of a decided approval, in words ("Allowed by you"). */
  function outcome(a, mine) {
    var by = mine ? "you" : who(a.decided_by);
    switch (a.state) {
      case "allowed":
        return "Allowed" + (a.scope === "session" ? (a.task ? " for this run" : " for this session") : "") + (by ? " by " + by : "");
      case "denied":
        return "Denied" + (by ? " by " + by : "") + (a.message ? ": “" + a.message + "”" : "");
      case "answered_in_terminal": return "Answered in the terminal";
      case "expired": return "Expired: nobody answered in time";
      case "withdrawn": return "Withdrawn: the task ended";
      default: return "No longer waiting";
    }
  }

  /** The input as a person reads it: a command or path first, the rest as JSON. */
  function inputText(input) {
    if (!input || typeof input !== "object" || Array.isArray(input)) return JSON.stringify(input, null, 2);
    for (var i = 0; i < PREVIEW_KEYS.length; i++) {
      var k = PREVIEW_KEYS[i];
      if (typeof input[k] === "string" && input[k].trim()) {
        var rest = Object.assign({}, input);
        delete rest[k];
        delete rest.description;
        var more = Object.keys(rest).length ? "\n\n" + JSON.stringify(rest, null, 2) : "";
        return input[k] + more;
      }
    }
    return JSON.stringify(input, null, 2);
  }

  function whereText(a) {
    if (a.task) {
      var m = a.machine && board().machines.get(a.machine);
      return "task on " + (m ? m.name : "machine " + String(a.machine || "").slice(0, 8));
    }
    var s = board().sessions.get(a.session);
    return (s && s.title) || a.title || "session " + String(a.session || "").slice(0, 8);
  }

  // ------------------------------------------------------------ one row
  function build(a) {
    var id = a.id;
    var canSession = !!a.task || (a.suggestions && a.suggestions.length > 0);
    var li = el("li", { className: "row approval", "data-approval-id": id, "data-state": a.state },
      el("div", { className: "line" },
        el("strong", { className: "tool", text: a.tool_name }),
        el("span", { className: "agent", "data-agent": a.agent, text: AGENT_NAMES[a.agent] || a.agent }),
        a.task ? el("a", { className: "where", href: "/tasks/" + encodeURIComponent(a.task) + "/" }) : el("span", { className: "where" }),
        el("span", { className: "muted age" })),
      a.cwd ? el("div", { className: "mono wrap folder muted", title: a.cwd, text: a.cwd }) : null,
      a.tool_input && typeof a.tool_input.description === "string" && a.tool_input.description
        ? el("div", { className: "description", text: a.tool_input.description }) : null,
      el("pre", { className: "approval-input", tabindex: "0", "aria-label": "input of " + a.tool_name, text: inputText(a.tool_input) }),
      a.tool_input_truncated ? el("div", { className: "muted", text: "(input cut to 4 KiB for display)" }) : null,
      el("div", { className: "actions approval-actions" },
        el("button", { type: "button", className: "allow", "data-action": "allow", text: "Allow" }),
        canSession ? el("button", { type: "button", className: "secondary allow-session", "data-action": "allow_session",
                                    text: a.task ? "Allow for this run" : "Allow for this session" }) : null,
        el("button", { type: "button", className: "danger deny", "data-action": "deny-open", "aria-expanded": "false", text: "Deny" })),
      el("div", { className: "deny-box", hidden: true },
        el("label", {}, "Instruction to the agent (optional)",
          el("textarea", { name: "message", rows: "2", maxlength: "2000", placeholder: "e.g. use make clean instead" })),
        el("div", { className: "actions" },
          el("button", { type: "button", className: "danger send-deny", "data-action": "deny", text: "Deny" }),
          el("button", { type: "button", className: "link", "data-action": "deny-cancel", text: "Cancel" }))),
      el("p", { className: "outcome", role: "status", "aria-live": "polite" }));
    li.addEventListener("click", function (e) {
      var button = e.target.closest("button[data-action]");
      if (button && !button.disabled) act(id, button.dataset.action);
    });
    return li;
  }

  function update(row, nowMs_) {
    var a = row.approval, li = row.li;
    var pending = a.state === "pending" && !row.goneAt;
    li.dataset.state = row.goneAt && a.state === "pending" ? "gone" : a.state;
    var where = whereText(a), folder = folderName(a.cwd);
    where += folder && folder !== where ? " · " + folder : "";
    if (li.querySelector(".where").textContent !== where) li.querySelector(".where").textContent = where;
    var age = li.querySelector(".age");
    var created = C.ms(a.created_at);
    var ageText = created === null ? "" : C.fmtDuration((nowMs_ - created) / 1000) + " ago";
    var expires = C.ms(a.expires_at);
    if (pending && expires !== null) {
      // After this the agent's own terminal dialog (or, headless, its refusal) decides.
      ageText += expires > nowMs_ ? " · " + C.fmtDuration((expires - nowMs_) / 1000) + " left" : " · expiring";
      age.title = "expires " + C.fmtTime(a.expires_at, nowMs_);
    }
    if (age.textContent !== ageText) age.textContent = ageText;
    // Deny first reveals the instruction field, with its own Deny (send) and Cancel.
    li.querySelector(".approval-actions").hidden = !pending || row.denyOpen;
    li.querySelector(".deny-box").hidden = !pending || !row.denyOpen;
    li.querySelectorAll("button[data-action]").forEach(function (b) { b.disabled = row.busy; });
    var text = "", cls = "outcome";
    if (row.busy) text = "Sending…"; // this page's own answer tells who won, not an event before it
    else if (!pending) {
      text = a.state === "pending" ? "No longer waiting (answered elsewhere)" : (row.conflict ? "Already decided: " : "") + outcome(a, row.mine);
      cls += " decided";
    } else if (row.error) {
      text = row.error;
      cls += " error";
    }
    var out = li.querySelector(".outcome");
    if (out.textContent !== text) out.textContent = text;
    out.className = cls;
  }

  // ------------------------------------------------------------ answering (Q2)
  function act(id, action) {
    var row = rows.get(id);
    if (!row || row.busy) return;
    var box = row.li.querySelector(".deny-box");
    var opener = row.li.querySelector("[data-action=deny-open]");
    if (action === "deny-open" || action === "deny-cancel") {
      row.denyOpen = action === "deny-open";
      opener.setAttribute("aria-expanded", String(row.denyOpen));
      update(row, nowMs());
      if (row.denyOpen) box.querySelector("textarea").focus();
      else opener.focus();
      return;
    }
    var body = action === "deny" ? { behavior: "deny", message: box.querySelector("textarea").value.trim() }
      : { behavior: "allow", scope: action === "allow_session" ? "session" : "once" };
    var key = row.keys[action] || (row.keys[action] = C.newKey());
    row.busy = true;
    row.error = "";
    update(row, nowMs());
    C.api("POST", "/api/approvals/" + encodeURIComponent(id) + "/decision/", body, { "Idempotency-Key": key })
      .then(function (res) {
        var d = res.data || {};
        if (res.status === 200 && d.id) {
          row.mine = true;
          settle(row, d);
        } else if (res.status === 409 && d.error === "already_decided" && d.approval) {
          row.conflict = !row.mine; // another key (device, button) decided first
          settle(row, d.approval);
        } else if (d.error === "idempotency_key_reused") {
          // This action was sent before with another instruction: a new key is a new
          // request, and the service still decides once (compare-and-set).
          delete row.keys[action];
          row.error = "The instruction changed since it was first sent: tap Deny again.";
        } else {
          row.error = C.errorText(res.status, d);
        }
      })
      .catch(function () { row.error = "The service did not answer: try again (it decides once)."; })
      .then(function () { row.busy = false; render(); });
  }

  function settle(row, approval) {
    row.approval = approval;
    board().applyApproval(approval); // other panels (sessions, tasks) see it too
  }

  // ------------------------------------------------------------ the list
  function render() {
    var b = board(), list = $("approval-list");
    if (!b || !list) return;
    var t = nowMs(), wall = Date.now();
    b.approvals.forEach(function (a, id) {
      var row = rows.get(id);
      if (!row) {
        if (a.state !== "pending") return; // answered before this page showed it
        row = { li: build(a), approval: a, keys: {}, busy: false, mine: false, conflict: false, error: "", goneAt: 0,
                denyOpen: false };
        rows.set(id, row);
      } else if (!row.busy || a.state !== "pending") row.approval = a;
    });
    rows.forEach(function (row, id) {
      if (!b.approvals.has(id) && row.approval.state === "pending" && !row.goneAt) row.goneAt = wall;
      if (row.approval.state !== "pending" && !row.decidedAt) row.decidedAt = wall;
      var since = row.decidedAt || row.goneAt;
      var linger = row.mine || row.conflict ? LINGER_MS : 0;
      if (since && !row.busy && wall - since >= linger) {
        row.li.remove();
        rows.delete(id);
      }
    });
    // Oldest first (Q6: the snapshot's order), each row in place.
    var ordered = Array.from(rows.values()).sort(function (x, y) {
      return (C.ms(x.approval.created_at) || 0) - (C.ms(y.approval.created_at) || 0) || (x.approval.id < y.approval.id ? -1 : 1);
    });
    ordered.forEach(function (row, i) {
      update(row, t);
      if (list.children[i] !== row.li) list.insertBefore(row.li, list.children[i] || null);
    });
    var waiting = ordered.filter(function (row) { return row.approval.state === "pending" && !row.goneAt; }).length;
    $("approvals").hidden = ordered.length === 0;
    $("approvals-count").textContent = waiting ? String(waiting) : "";
    document.body.dataset.approvalsPending = String(waiting);
    if (baseTitle === null) baseTitle = document.title;
    var title = waiting ? "(" + waiting + ") " + baseTitle : baseTitle; // a background tab shows it
    if (document.title !== title) document.title = title;
  }

  function start() {
    document.addEventListener("runstead:render", render);
    render();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
