/*
 * Notifications on the board (SPEC N1, N2): the settings panel, this device's
 * notification permission and Web Push subscription, the service worker (PWA), and the
 * open board's Web Notifications.
 *
 * The service sends a `notification` board event (after commit, to the owner's group
 * only) for each notification event of a kind the owner wants, when the board channel is
 * on; a session's `session_idle` is written only at true idle (S3), never at a blip. The
 * page raises one Web Notification per event id (tag = id, so a push of the same event on
 * this device replaces it rather than doubling). board.js re-dispatches every socket
 * message as a `runstead:event` DOM event; nothing here touches the board's state.
 */
(function () {
  "use strict";

  var state = { shown: 0, ids: new Set(), pushEndpoint: null };
  window.runsteadNotify = state;

  var C = window.RunStead; // common.js
  var $ = C.$, api = C.api;

  // ------------------------------------------------------------ Web Notifications (board channel)
  function onEvent(e) {
    var ev = e.detail;
    if (!ev || ev.type !== "notification" || !ev.notification) return;
    var n = ev.notification;
    if (!n.id || state.ids.has(n.id)) return; // once per event id
    state.ids.add(n.id);
    if (!("Notification" in window) || window.Notification.permission !== "granted") return;
    // Q6: an approval's notifications share its id as their tag: the answer replaces the
    // question, quietly.
    var options = { body: n.body || "", tag: n.tag || n.id, icon: "/static/icons/icon-192.png",
                    silent: n.kind === "approval" && !!n.approval_state && n.approval_state !== "pending" };
    try {
      var shown = new window.Notification(n.title || "RunStead", options);
      shown.onclick = function () { window.focus(); if (n.url && n.url !== "/") window.location.href = n.url; };
      state.shown++;
    } catch (err) {
      // Some mobile browsers allow notifications only from the service worker.
      if (navigator.serviceWorker && navigator.serviceWorker.ready) {
        navigator.serviceWorker.ready.then(function (reg) {
          reg.showNotification(n.title || "RunStead", options);
          state.shown++;
        });
      }
    }
  }

  function renderPermission() {
    var p = $("notify-permission");
    if (!p) return;
    var allow = $("notify-allow");
    if (!("Notification" in window)) { p.textContent = "This browser has no notifications."; if (allow) allow.hidden = true; return; }
    var perm = window.Notification.permission;
    p.textContent = perm === "granted" ? "Notifications are allowed on this device." :
      perm === "denied" ? "Notifications are blocked for this site in the browser's settings." :
      "Notifications are not allowed on this device yet.";
    if (allow) allow.hidden = perm !== "default";
  }

  // ------------------------------------------------------------ Web Push (N2)
  function b64urlToBytes(text) {
    var pad = "=".repeat((4 - (text.length % 4)) % 4);
    var raw = window.atob((text + pad).replace(/-/g, "+").replace(/_/g, "/"));
    return Uint8Array.from(raw, function (c) { return c.charCodeAt(0); });
  }

  function enablePush() {
    var status = $("notify-status");
    if (!("serviceWorker" in navigator) || !("PushManager" in window)) {
      status.textContent = "This browser cannot receive push (on iPhone: add the board to the home screen first).";
      return;
    }
    status.textContent = "Setting up push…";
    Promise.all([navigator.serviceWorker.ready, api("GET", "/api/push/vapid-public-key/"),
                 window.Notification ? window.Notification.requestPermission() : "denied"])
      .then(function (res) {
        if (res[2] !== "granted") throw new Error("notifications not allowed");
        return res[0].pushManager.subscribe({ userVisibleOnly: true, applicationServerKey: b64urlToBytes(res[1].data.public_key) });
      })
      .then(function (sub) {
        var json = sub.toJSON();
        return api("POST", "/api/push/subscriptions/", { endpoint: json.endpoint, expirationTime: json.expirationTime || null, keys: json.keys });
      })
      .then(function (r) {
        status.textContent = r.status < 300 ? "Push is on for this device." : "Push: " + (r.data.detail || r.status);
        renderPermission();
      })
      .catch(function (err) { status.textContent = "Push could not be set up: " + err.message; renderPermission(); });
  }

  // ------------------------------------------------------------ settings (N1)
  var KINDS = ["approval", "session_idle", "attention", "unknown", "task_succeeded", "task_failed"];

  function fill(form, s) {
    KINDS.forEach(function (k) { form.elements[k].checked = !!s.kinds[k]; });
    form.elements.board.checked = !!s.board;
    form.elements.push.checked = !!s.push;
    form.elements.webhook_url.value = s.webhook_url || "";
  }

  function save(e) {
    e.preventDefault();
    var form = e.target;
    var kinds = {};
    KINDS.forEach(function (k) { kinds[k] = form.elements[k].checked; });
    var url = form.elements.webhook_url.value.trim();
    var body = { kinds: kinds, board: form.elements.board.checked, push: form.elements.push.checked, webhook_url: url || null };
    var status = $("notify-status");
    status.textContent = "Saving…";
    api("PUT", "/api/notifications/settings/", body).then(function (r) {
      if (r.status !== 200) {
        status.textContent = (r.data.error || r.status) + ": " + JSON.stringify(r.data.fields || r.data.detail || "");
        return;
      }
      fill(form, r.data);
      status.textContent = "Saved.";
      var box = $("webhook-secret");
      if (r.data.webhook_secret) {
        $("webhook-secret-value").textContent = r.data.webhook_secret;
        box.hidden = false;
      } else box.hidden = true;
    });
  }

  function start() {
    document.addEventListener("runstead:event", onEvent);
    if ("serviceWorker" in navigator) {
      navigator.serviceWorker.register("/sw.js", { scope: "/" }).catch(function () { /* http on a LAN address: no PWA */ });
    }
    renderPermission();
    var allow = $("notify-allow");
    if (allow) allow.addEventListener("click", function () {
      window.Notification.requestPermission().then(renderPermission);
    });
    var push = $("push-enable");
    if (push) push.addEventListener("click", enablePush);
    var form = $("notify-form");
    if (form) {
      form.addEventListener("submit", save);
      api("GET", "/api/notifications/settings/").then(function (r) { if (r.status === 200) fill(form, r.data); });
    }
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
