/*
 * RunStead service worker (SPEC N2): makes the board an installable web app and shows
 * Web Push notifications. Served at /sw.js (scope "/"). It caches only the app shell's
 * static files and an offline page; the board's data always comes from the network.
 *
 * Push payload (JSON, encrypted by the service, RFC 8291): {id, kind, title, body, url,
 * created_at, session_id? | task_id?, state?, approval_id?, approval_state?, tag?}. The
 * notification's tag is the payload's `tag` when given, else the event id, so the open
 * board's Web Notification for the same event replaces it instead of doubling, and an
 * approval's answer (Q6: same tag, the approval id) replaces its question quietly.
 */
"use strict";

var CACHE = "runstead-shell-v1";
var SHELL = ["/static/board.css", "/static/icons/icon-192.png"];

self.addEventListener("install", function (event) {
  event.waitUntil(caches.open(CACHE).then(function (c) { return c.addAll(SHELL); }).then(function () { return self.skipWaiting(); }));
});

self.addEventListener("activate", function (event) {
  event.waitUntil(caches.keys().then(function (keys) {
    return Promise.all(keys.filter(function (k) { return k !== CACHE; }).map(function (k) { return caches.delete(k); }));
  }).then(function () { return self.clients.claim(); }));
});

self.addEventListener("fetch", function (event) {
  var req = event.request;
  if (req.method !== "GET") return;
  var url = new URL(req.url);
  if (url.origin !== self.location.origin) return;
  if (req.mode === "navigate") {
    // Network first; offline, say so instead of the browser's error page.
    event.respondWith(fetch(req).catch(function () {
      return new Response("<!doctype html><meta name=viewport content='width=device-width'><title>RunStead</title>" +
        "<p style='font:16px system-ui;padding:20px'>Offline. The board reconnects when the network is back.</p>",
        { headers: { "Content-Type": "text/html; charset=utf-8" } });
    }));
    return;
  }
  if (SHELL.indexOf(url.pathname) >= 0) {
    event.respondWith(caches.match(req).then(function (hit) { return hit || fetch(req); }));
  }
});

self.addEventListener("push", function (event) {
  var data = {};
  try { data = event.data ? event.data.json() : {}; } catch (e) { data = { title: "RunStead", body: event.data ? event.data.text() : "" }; }
  var title = data.title || "RunStead";
  // Q6: an approval's answer replaces its question without alerting again.
  var answer = data.kind === "approval" && data.approval_state && data.approval_state !== "pending";
  event.waitUntil(self.registration.showNotification(title, {
    body: data.body || "",
    tag: data.tag || data.id || undefined,
    renotify: false,
    silent: !!answer,
    requireInteraction: data.kind === "approval" && !answer,
    icon: "/static/icons/icon-192.png",
    badge: "/static/icons/icon-192.png",
    data: { url: data.url || "/", id: data.id, kind: data.kind, approval_id: data.approval_id },
  }));
});

self.addEventListener("notificationclick", function (event) {
  event.notification.close();
  var target = new URL((event.notification.data && event.notification.data.url) || "/", self.location.origin).href;
  event.waitUntil(self.clients.matchAll({ type: "window", includeUncontrolled: true }).then(function (list) {
    for (var i = 0; i < list.length; i++) {
      if (list[i].url === target && "focus" in list[i]) return list[i].focus();
    }
    return self.clients.openWindow(target);
  }));
});
