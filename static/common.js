/*
 * Helpers shared by the board's panels (board.js, history.js, machines.js, notify.js) and
 * the task page (task.js). Plain JS, no build step; loaded first (templates/board.html,
 * templates/task.html) and exposed as one namespace, window.RunStead.
 *
 *   $(id)                       document.getElementById
 *   el(tag, attrs, ...children) an element; attrs: text -> textContent, className, else
 *                               attributes (true -> "", null/undefined/false -> left out);
 *                               children: nodes or strings (text), null/undefined/false skipped
 *   ms(iso)                     epoch milliseconds of an ISO 8601 time, or null
 *   fmtTime(iso, nowMs)         local wall time in the browser's time zone (B6), the date
 *                               too when not the day of nowMs (default: the browser clock)
 *   fmtDuration(seconds)        "42s", "3m 5s", "2h 10m", "1d 4h"; "" for none
 *   newKey()                    a fresh Idempotency-Key (A1): 128 random bits, hex
 *   api(method, path, body, headers) -> Promise<{status, data}>: JSON fetch on this origin
 *                               with the page's CSRF token (X-CSRFToken); data is {} when
 *                               the answer is not JSON; rejects only on a network error
 *   errorText(status, data)     "code: detail {fields}" of a 4xx body ({error, detail})
 *   tell(node, text, isError)   a status line's text, class "error" or "muted"
 */
(function () {
  "use strict";

  function $(id) { return document.getElementById(id); }

  function el(tag, attrs) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) {
      var v = attrs[k];
      if (v === null || v === undefined || v === false) return;
      if (k === "text") node.textContent = v;
      else if (k === "className") node.className = v;
      else node.setAttribute(k, v === true ? "" : String(v));
    });
    for (var i = 2; i < arguments.length; i++) {
      var c = arguments[i];
      if (c === null || c === undefined || c === false) continue;
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    }
    return node;
  }

  function ms(iso) { var t = iso ? Date.parse(iso) : NaN; return isNaN(t) ? null : t; }

  function fmtTime(iso, nowMs) {
    var t = ms(iso);
    if (t === null) return "";
    var d = new Date(t);
    var today = new Date(nowMs === undefined ? Date.now() : nowMs);
    return d.toDateString() === today.toDateString() ? d.toLocaleTimeString() : d.toLocaleString();
  }

  function fmtDuration(seconds) {
    if (seconds === null || seconds === undefined || isNaN(seconds)) return "";
    var s = Math.max(0, Math.round(seconds));
    if (s < 60) return s + "s";
    if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
    if (s < 86400) return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
    return Math.floor(s / 86400) + "d " + Math.floor((s % 86400) / 3600) + "h";
  }

  /* getRandomValues works outside secure contexts too, unlike randomUUID. */
  function newKey() {
    var bytes = new Uint8Array(16);
    window.crypto.getRandomValues(bytes);
    return Array.from(bytes, function (b) { return b.toString(16).padStart(2, "0"); }).join("");
  }

  /* Every form and panel of a page carries the same token in data-csrf. */
  function csrf() { var holder = document.querySelector("[data-csrf]"); return holder ? holder.dataset.csrf : ""; }

  function api(method, path, body, headers) {
    var h = Object.assign({ Accept: "application/json", "X-CSRFToken": csrf() }, headers || {});
    if (body !== undefined) h["Content-Type"] = "application/json";
    return fetch(path, { method: method, credentials: "same-origin", cache: "no-store", headers: h,
                         body: body === undefined ? undefined : JSON.stringify(body) })
      .then(function (r) { return r.json().catch(function () { return {}; }).then(function (d) { return { status: r.status, data: d }; }); });
  }

  function errorText(status, data) {
    var d = data || {};
    return (d.error || "HTTP " + status) + ": " + (d.detail || "") + (d.fields ? " " + JSON.stringify(d.fields) : "");
  }

  function tell(node, text, isError) {
    node.textContent = text;
    node.className = isError ? "error" : "muted";
  }

  window.RunStead = { $: $, el: el, ms: ms, fmtTime: fmtTime, fmtDuration: fmtDuration, newKey: newKey,
                      api: api, errorText: errorText, tell: tell };
})();
