/*
 * Machines on the board (SPEC B10): pair a machine (a one-time code with its expiry
 * countdown and the exact `pair_worker` command, server URL filled in, with a copy
 * button), re-pair, unpair, grant and revoke folders. Every action asks for a
 * confirmation and calls the same API (so the same service functions) as any client.
 * Reads machines and grants from the board's state (board.js, window.runsteadBoard) and
 * re-renders after every board render; a newly paired machine appears from its
 * `machine` event (B2).
 */
(function () {
  "use strict";

  var pairing = null; // {code, expiresMs, name, machineId (re-pair) | null, knownIds: Set}
  var timer = null;

  var C = window.RunStead; // common.js
  var $ = C.$, el = C.el, api = C.api;
  function board() { return window.runsteadBoard; }

  function say(text, isError) { C.tell($("manage-status"), text, isError); }

  function failed(r) { return C.errorText(r.status, r.data); }

  function nowMs() { return Date.now() + ((board() && board().offsetMs) || 0); }

  /** A shell word: as is when plain, else single-quoted. */
  function shellWord(text) { return /^[A-Za-z0-9._\/:@=+-]+$/.test(text) ? text : "'" + String(text).replace(/'/g, "'\\''") + "'"; }

  // ------------------------------------------------------------ pairing
  function startPairing(body, name, machineId) {
    return api("POST", "/api/machines/pairing-codes/", body).then(function (r) {
      if (r.status !== 201) { say(failed(r), true); return; }
      pairing = { code: r.data.code, expiresMs: Date.parse(r.data.expires_at), name: name, machineId: machineId,
                  knownIds: new Set(Array.from(board().machines.keys())),
                  generation: machineId && board().machines.get(machineId) ? board().machines.get(machineId).generation : null };
      var cmd = "python manage.py pair_worker --server " + shellWord(window.location.origin) + " --code " + r.data.code;
      if (name) cmd += " --name " + shellWord(name);
      $("pair-code").textContent = r.data.code;
      $("pair-command").textContent = cmd;
      $("pair-result").textContent = "Waiting for the machine…";
      $("pairing").hidden = false;
      $("pair-command").parentNode.hidden = false;
      tick();
      if (!timer) timer = setInterval(tick, 1000);
      $("pairing").scrollIntoView({ block: "nearest" });
    });
  }

  function tick() {
    if (!pairing) return;
    var left = Math.max(0, Math.round((pairing.expiresMs - nowMs()) / 1000));
    var expiry = $("pair-expiry");
    if (pairing.done) return;
    if (left <= 0) {
      expiry.textContent = "expired";
      $("pair-command").parentNode.hidden = true;
      $("pair-result").textContent = "The code expired; pair again for a new one.";
      return;
    }
    expiry.textContent = "expires in " + Math.floor(left / 60) + ":" + String(left % 60).padStart(2, "0");
  }

  function checkPaired() {
    if (!pairing || pairing.done) return;
    var found = null;
    board().machines.forEach(function (m, id) {
      if (pairing.machineId ? (id === pairing.machineId && m.generation > pairing.generation) : !pairing.knownIds.has(id)) found = m;
    });
    if (!found) return;
    pairing.done = true;
    $("pair-expiry").textContent = "";
    $("pair-command").parentNode.hidden = true;
    $("pair-result").textContent = "Paired: " + found.name + " is connected.";
    $("pair-result").dataset.machineId = found.id;
  }

  function copyCommand() {
    var text = $("pair-command").textContent;
    var done = function () { $("pair-copy").textContent = "Copied"; setTimeout(function () { $("pair-copy").textContent = "Copy"; }, 1500); };
    if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(text).then(done, fallback);
    else fallback();
    function fallback() {
      var range = document.createRange();
      range.selectNodeContents($("pair-command"));
      var sel = window.getSelection();
      sel.removeAllRanges();
      sel.addRange(range);
      try { document.execCommand("copy"); done(); } catch (e) { /* the text stays selected */ }
    }
  }

  // ------------------------------------------------------------ actions
  function act(question, method, path, body, okText) {
    if (!window.confirm(question)) return;
    api(method, path, body).then(function (r) {
      if (r.status >= 300) { say(failed(r), true); return; }
      say(okText, false);
      board().hydrate(); // grants are in the snapshot; machines also come by event
    });
  }

  function renderMachine(m) {
    var grants = board().grants.filter(function (g) { return g.machine === m.id; });
    var li = el("li", { className: "row", "data-manage-machine": m.id },
      el("div", { className: "line" }, el("strong", { text: m.name }),
        el("span", { className: "muted", text: (m.paired === false ? "unpaired" : "paired") + " · generation " + m.generation })));
    var actions = el("div", { className: "actions" });
    var repair = el("button", { type: "button", className: "secondary", "data-action": "repair", text: m.paired === false ? "Pair again" : "Re-pair" });
    repair.addEventListener("click", function () {
      if (window.confirm("Re-pair " + m.name + "? Its current token stops working once the new code is used.")) {
        startPairing({ machine: m.id }, m.name, m.id);
      }
    });
    actions.appendChild(repair);
    if (m.paired !== false) {
      var unpair = el("button", { type: "button", className: "danger", "data-action": "unpair", text: "Unpair" });
      unpair.addEventListener("click", function () {
        act("Unpair " + m.name + "? Its waiting tasks will not start and its token stops working.", "POST",
            "/api/machines/" + m.id + "/unpair/", undefined, m.name + " unpaired.");
      });
      actions.appendChild(unpair);
    }
    li.appendChild(actions);
    var list = el("ul", { className: "list grants" });
    grants.forEach(function (g) {
      var revoke = el("button", { type: "button", className: "danger", "data-action": "revoke", text: "Revoke" });
      revoke.addEventListener("click", function () {
        act("Revoke " + m.name + "'s access to " + g.path + "? Its waiting tasks there will not start.", "POST",
            "/api/grants/" + g.id + "/revoke/", undefined, "Revoked " + g.path + ".");
      });
      list.appendChild(el("li", { className: "row line", "data-grant-path": g.path }, el("span", { className: "mono wrap", text: g.path }), revoke));
    });
    li.appendChild(list);
    if (m.paired !== false) {
      var form = el("form", { className: "grant-form", autocomplete: "off" },
        el("label", {}, document.createTextNode("Grant a folder"),
          el("input", { type: "text", name: "path", placeholder: "/Users/me/projects", spellcheck: "false", required: true })),
        el("button", { type: "submit", text: "Grant" }));
      form.addEventListener("submit", function (e) {
        e.preventDefault();
        var path = form.elements.path.value.trim();
        act("Let " + m.name + " run agents in " + path + " and below?", "POST", "/api/grants/", { machine: m.id, path: path },
            "Granted " + path + " to " + m.name + ".");
      });
      li.appendChild(form);
    }
    return li;
  }

  var lastSignature = "";

  function render() {
    if (!board()) return;
    checkPaired();
    var machines = Array.from(board().machines.values()).sort(function (a, b) { return String(a.name).localeCompare(String(b.name)); });
    var signature = JSON.stringify([machines.map(function (m) { return [m.id, m.name, m.paired, m.generation]; }), board().grants]);
    if (signature === lastSignature) return; // keep focus and typed text while nothing changed
    lastSignature = signature;
    var list = $("manage-list");
    list.textContent = "";
    machines.forEach(function (m) { list.appendChild(renderMachine(m)); });
  }

  function start() {
    var form = $("pair-form");
    if (!form) return;
    form.addEventListener("submit", function (e) {
      e.preventDefault();
      var name = form.elements.name.value.trim();
      if (!window.confirm("Create a pairing code" + (name ? " for " + name : "") + "? It works once, for 10 minutes.")) return;
      startPairing(name ? { name: name } : {}, name, null);
    });
    $("pair-copy").addEventListener("click", copyCommand);
    document.addEventListener("runstead:render", render);
    render();
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
