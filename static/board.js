/*
 * RunStead board (SPEC B1-B8). Plain JS, no build step.
 *
 * State comes from the snapshot embedded in the page, then from one WebSocket
 * (/ws/board/, B2) and from GET /api/board/ on every (re)connect and every 60 s (B4).
 * Every row carries a `version`; an event older than (or equal to) what is shown is
 * ignored (B2). RUNNING badges are re-evaluated by M3 every second on the browser clock
 * corrected by the last `server_time` seen (B3), so an expired marker disappears with no
 * message from the server. Times are shown in the browser's time zone (B6).
 *
 * Approvals (Q6) live here too (`approval` events, the snapshot's pending list); the
 * inbox that shows and answers them is static/approvals.js, which reads this state.
 */
(function () {
  "use strict";

  var HYDRATE_EVERY_MS = 60000; // B4 safety net
  var TICK_MS = 1000; // M3 re-evaluation, ages, offline machines
  var BACKOFF_MIN_MS = 1000;
  var BACKOFF_MAX_MS = 30000;
  var MUTE_KEY = "runstead.board.muted";
  var OUTPUT_LINES = 6; // L10: last output lines shown per task
  var SLEEP_SHOWN_S = 1; // L9: slept_s worth mentioning
  var WAITING = { accepted: true, delivered: true };
  var UNFINISHED = { queued: true, accepted: true, delivered: true, starting: true, running: true, unknown: true };
  var LEASED = { starting: true, running: true };
  var SLEEP_STATES = { starting: true, running: true, unknown: true, failed_lease_lost: true };

  var board = {
    sessions: new Map(), // id -> {id, title, status, status_since, version, touched, markers: Map(device_id -> marker)}
    tasks: new Map(), // id -> task (as GET /api/tasks/{id}/) + version, touched
    machines: new Map(), // id -> machine + version, touched
    approvals: new Map(), // id -> approval (Q6, any state: the inbox shows an answer briefly) + version, touched
    grants: [],
    pools: new Map(), // C8: id -> the owner's machine pool (the task form's choices) + version, touched
    poolsDeleted: new Map(), // pool id -> {version, seq} of its pool.deleted event
    deleted: new Map(), // session id -> {version, seq} of its session.deleted event
    offsetMs: 0, // server clock - browser clock, from the last server_time (M3)
    graceS: 60,
    seq: 0, // local change counter; rows touched after a hydrate started survive it
    loaded: false,
    messages: 0, // WebSocket messages received (tests read it)
    socketOpens: [], // Date.now() of each WebSocket attempt (tests read the spacing)
    rateLimited: 0, // sockets the service refused as over its handshake rate (K3)
    hydrations: 0, // snapshots fetched from /api/board/
    doneCount: 0, // busy -> idle transitions seen (B5)
    beeps: 0, // of which played aloud (not muted)
  };
  window.runsteadBoard = board;
  board.hydrate = function () { return hydrate(); }; // other panels re-read after their own writes
  board.now = function () { return now(); }; // the browser clock corrected by server_time (M3)
  /** Q6: an approval as an answer to this page's own request carried it (approvals.js). */
  board.applyApproval = function (a) { if (a && a.id && applyRow(board.approvals, a, a.version)) render(); };

  // ---------------------------------------------------------------- helpers (common.js)
  var C = window.RunStead;
  var $ = C.$, el = C.el, ms = C.ms, fmtDuration = C.fmtDuration, newKey = C.newKey;

  function now() { return Date.now() + board.offsetMs; }

  function noteServerTime(iso) {
    var t = ms(iso);
    if (t !== null) board.offsetMs = t - Date.now();
  }

  function fmtAge(iso) {
    var t = ms(iso);
    return t === null ? "" : fmtDuration((now() - t) / 1000);
  }

  /** Local wall time in the browser's time zone (B6); the date only when not today. */
  function fmtTime(iso) { return C.fmtTime(iso, now()); }

  function timeEl(iso, text) {
    return el("time", { datetime: iso, title: iso ? new Date(ms(iso)).toString() : null, text: text });
  }

  function isNewer(current, version) {
    return !current || version === null || version === undefined ||
      current.version === null || current.version === undefined || version > current.version;
  }

  function idOf(value) { return value && typeof value === "object" ? value.id : value; }

  // ---------------------------------------------------------------- M3 and B7 readers
  /** M3: RUNNING while state == running and now < expires_at + grace. */
  function markerRunning(m, nowMs) {
    var exp = ms(m.expires_at);
    return m.state === "running" && exp !== null && nowMs < exp + board.graceS * 1000;
  }

  /** B7 as the server decides it (tasks_app/shapes.py): ``offline`` at the message's
   *  server_time, or past ``offline_at``, when it turns offline without a message. */
  function machineOffline(m, nowMs) {
    var at = ms(m.offline_at);
    return m.offline === true || (at !== null && nowMs > at);
  }

  // ---------------------------------------------------------------- applying state
  function touch(row) { row.touched = ++board.seq; return row; }

  function ensureSession(id) {
    if (board.deleted.has(id)) return null; // the next snapshot tells whether it came back
    var s = board.sessions.get(id);
    if (!s) {
      s = touch({ id: id, title: "", status: "idle", status_since: null, version: null, markers: new Map() });
      board.sessions.set(id, s);
      scheduleHydrate(); // learn its title
    }
    return s;
  }

  // I6: agent, title, folder and "needs you" travel in the snapshot and in every
  // session.status event; a field an event does not carry keeps its value.
  var SESSION_INFO = ["title", "agent", "cwd", "attention", "attention_message", "attention_since",
                      "machine", "channel", "reach"]; // T1: how a message reaches it, in words
  function copySessionInfo(s, source) {
    SESSION_INFO.forEach(function (key) { if (source[key] !== undefined) s[key] = source[key]; });
  }

  // B5, N1: the done sound for busy -> idle, unless the service says nobody saw it end
  // (`announced: false`: a marker that expired).
  function setSessionStatus(s, status, since, announced) {
    var was = s.status;
    s.status = status;
    if (since) s.status_since = since;
    if (board.loaded && was === "busy" && status === "idle" && announced !== false) sessionDone(s);
  }

  function applyEvent(ev) {
    if (!ev || typeof ev !== "object") return;
    noteServerTime(ev.server_time);
    if (ev.type === "session.status") {
      var cur = board.sessions.get(ev.session_id);
      if (cur && !isNewer(cur, ev.version)) return;
      var gone = board.deleted.get(ev.session_id);
      if (gone && !(ev.version > gone.version)) return;
      board.deleted.delete(ev.session_id);
      var s = ensureSession(ev.session_id);
      setSessionStatus(s, ev.status, ev.since || ev.status_since || ev.server_time, ev.announced);
      copySessionInfo(s, ev);
      s.version = ev.version;
      touch(s);
    } else if (ev.type === "session.deleted") {
      var shownSession = board.sessions.get(ev.session_id);
      if (shownSession && !isNewer(shownSession, ev.version)) return;
      board.sessions.delete(ev.session_id);
      board.deleted.set(ev.session_id, { version: ev.version, seq: ++board.seq });
    } else if (ev.type === "marker") {
      var sess = ensureSession(ev.session_id);
      if (!sess) { scheduleHydrate(); return; }
      var m = sess.markers.get(ev.device_id);
      if (m && !isNewer(m, ev.version)) return;
      var marker = Object.assign({}, ev);
      delete marker.type;
      delete marker.server_time;
      sess.markers.set(ev.device_id, touch(marker));
    } else if (ev.type === "task" && ev.task) {
      var shown = board.tasks.get(ev.task.id);
      var task = ev.task;
      // Events carry no start time: keep the snapshot's, or take the service time of the
      // event that moved the task into a leased state (for the live runtime).
      if (!task.started_at) {
        var started = shown && shown.started_at;
        if (!started && LEASED[task.state] && !(shown && LEASED[shown.state])) started = ev.server_time;
        if (started) task = Object.assign({}, task, { started_at: started });
      }
      applyRow(board.tasks, task, ev.version);
    } else if (ev.type === "task.progress" && ev.task_id) {
      // G4: live progress of a running task; older than what is shown -> ignored.
      var current = board.tasks.get(ev.task_id);
      if (!current) { scheduleHydrate(); return; }
      if (!isNewer(current, ev.version)) return;
      board.tasks.set(ev.task_id, touch(Object.assign({}, current, { progress: ev.progress, version: ev.version })));
    } else if (ev.type === "machine" && ev.machine) {
      applyRow(board.machines, ev.machine, ev.version);
    } else if (ev.type === "approval" && ev.approval) {
      applyRow(board.approvals, ev.approval, ev.version); // Q6: on create and on every decision
    } else if (ev.type === "pool" && ev.pool) {
      // C8: a pool created, renamed or given other machines; the task form follows (render).
      var poolGone = board.poolsDeleted.get(ev.pool.id);
      if (poolGone && !(ev.version > poolGone.version)) return;
      applyRow(board.pools, ev.pool, ev.version);
    } else if (ev.type === "pool.deleted" && ev.pool_id) {
      var shownPool = board.pools.get(ev.pool_id);
      if (shownPool && !isNewer(shownPool, ev.version)) return;
      board.pools.delete(ev.pool_id);
      board.poolsDeleted.set(ev.pool_id, { version: ev.version, seq: ++board.seq });
    }
  }

  /** "3 turns · 2 tool calls · $0.0123" from a usage object (G3, G4). */
  function usageText(u) {
    if (!u) return "";
    var parts = [];
    if (u.turns !== null && u.turns !== undefined) parts.push(u.turns + " turn" + (u.turns === 1 ? "" : "s"));
    if (u.tool_calls !== null && u.tool_calls !== undefined) parts.push(u.tool_calls + " tool call" + (u.tool_calls === 1 ? "" : "s"));
    if (u.cost_usd !== null && u.cost_usd !== undefined) parts.push("$" + Number(u.cost_usd).toFixed(u.cost_usd < 1 ? 4 : 2));
    return parts.join(" · ");
  }

  function applyRow(map, row, version) {
    var v = version !== undefined && version !== null ? version : row.version;
    var cur = map.get(row.id);
    if (cur && !isNewer(cur, v)) return false;
    map.set(row.id, touch(Object.assign({}, row, { version: v })));
    return true;
  }

  /** Merge a snapshot: a row shown with a higher version than the snapshot's stays;
   *  rows absent from the snapshot go unless an event touched them after the fetch began. */
  function mergeRows(map, items, startSeq, build) {
    var next = new Map();
    items.forEach(function (item) {
      var cur = map.get(item.id);
      if (cur && !isNewer(cur, item.version)) next.set(item.id, cur);
      else next.set(item.id, build(item, cur));
    });
    map.forEach(function (cur, id) {
      if (!next.has(id) && cur.touched > startSeq) next.set(id, cur);
    });
    return next;
  }

  function applySnapshot(snap, startSeq) {
    noteServerTime(snap.server_time);
    if (typeof snap.marker_grace_s === "number") board.graceS = snap.marker_grace_s;
    var previous = board.sessions;
    // A snapshot read before a deletion we already applied must not bring the session back.
    var items = (snap.sessions || []).filter(function (item) {
      var gone = board.deleted.get(item.id);
      return !(gone && gone.seq > startSeq && !(item.version > gone.version));
    });
    var sessions = mergeRows(previous, items, startSeq, function (item, cur) {
      var markers = new Map();
      (item.markers || []).forEach(function (m) {
        var shown = cur && cur.markers.get(m.device_id);
        markers.set(m.device_id, shown && !isNewer(shown, m.version) ? shown : Object.assign({}, m));
      });
      if (cur) {
        cur.markers.forEach(function (m, device) {
          if (!markers.has(device) && m.touched > startSeq) markers.set(device, m);
        });
      }
      var s = { id: item.id, title: item.title, status: cur ? cur.status : item.status,
                status_since: item.status_since, version: item.version, markers: markers, touched: 0 };
      copySessionInfo(s, item);
      setSessionStatus(s, item.status, item.status_since);
      return s;
    });
    board.sessions = sessions;
    board.deleted.forEach(function (gone, id) { if (gone.seq <= startSeq) board.deleted.delete(id); });
    board.tasks = mergeRows(board.tasks, snap.tasks || [], startSeq, function (item) { return Object.assign({}, item); });
    board.machines = mergeRows(board.machines, snap.machines || [], startSeq, function (item) { return Object.assign({}, item); });
    // Q6: the snapshot lists what is still pending; one shown as pending that it lacks was
    // answered while this page was not listening (the inbox says so, then drops it).
    board.approvals = mergeRows(board.approvals, snap.approvals || [], startSeq, function (item) { return Object.assign({}, item); });
    board.grants = snap.grants || [];
    // C8: as sessions: a snapshot read before a pool.deleted we applied keeps it deleted.
    var pools = (snap.pools || []).filter(function (item) {
      var gone = board.poolsDeleted.get(item.id);
      return !(gone && gone.seq > startSeq && !(item.version > gone.version));
    });
    board.poolsDeleted.forEach(function (gone, id) { if (gone.seq <= startSeq) board.poolsDeleted.delete(id); });
    board.pools = mergeRows(board.pools, pools, startSeq, function (item) { return Object.assign({}, item); });
  }

  // ---------------------------------------------------------------- B4 hydration
  var hydrating = null;
  var hydrateSoon = null;

  function hydrate() {
    if (hydrating) return hydrating;
    var startSeq = board.seq;
    hydrating = fetch("/api/board/", { credentials: "same-origin", cache: "no-store", headers: { Accept: "application/json" } })
      .then(function (r) {
        if (r.status === 401 || r.status === 403) {
          window.location.href = "/accounts/login/?next=/";
          return null;
        }
        if (!r.ok) throw new Error("snapshot: HTTP " + r.status);
        return r.json();
      })
      .then(function (snap) {
        if (!snap) return;
        applySnapshot(snap, startSeq);
        board.hydrations++;
        render();
      })
      .catch(function () { /* the next (re)connect or the 60 s timer tries again */ })
      .then(function () { hydrating = null; });
    return hydrating;
  }

  function scheduleHydrate() {
    if (hydrateSoon || !board.loaded) return;
    hydrateSoon = setTimeout(function () { hydrateSoon = null; hydrate(); }, 300);
  }

  // ---------------------------------------------------------------- B2 WebSocket
  var ws = null;
  var backoff = BACKOFF_MIN_MS;
  var reconnectTimer = null;
  var LAYER_DOWN_CLOSE_CODE = 4503; // board/consumers.py
  var RATE_LIMITED_CLOSE_CODE = 4429; // board/consumers.py: too many handshakes (K3)
  var STABLE_MS = 5000; // a socket that stayed open this long resets the backoff
  var notBefore = 0; // no new socket before this time (Date.now(); a rate limit's retry_after_s)

  function setConn(state, text) {
    var c = $("conn");
    if (!c) return;
    c.dataset.state = state;
    c.textContent = text;
  }

  function connect() {
    if (reconnectTimer) { clearTimeout(reconnectTimer); reconnectTimer = null; }
    if (ws && (ws.readyState === WebSocket.OPEN || ws.readyState === WebSocket.CONNECTING)) return;
    var wait = notBefore - Date.now();
    if (wait > 0) { // a rate limit said when: visibility or "online" do not bring that forward
      reconnectTimer = setTimeout(connect, wait);
      return;
    }
    var proto = window.location.protocol === "https:" ? "wss:" : "ws:";
    var sock = new WebSocket(proto + "//" + window.location.host + "/ws/board/");
    ws = sock;
    board.socketOpens.push(Date.now());
    setConn("connecting", "connecting…");
    sock.onopen = function () {
      sock.openedAt = Date.now();
      setConn("live", "live");
      hydrate(); // B4: events may have been lost while disconnected
    };
    sock.onmessage = function (e) {
      board.messages++;
      var ev;
      try { ev = JSON.parse(e.data); } catch (err) { return; }
      if (ev.type === "rate_limited") { sock.retryAfterMs = (ev.retry_after_s || 1) * 1000; return; }
      applyEvent(ev);
      render();
      // Other modules (notify.js, machines.js) listen; they never change the board's state.
      document.dispatchEvent(new CustomEvent("runstead:event", { detail: ev }));
    };
    sock.onclose = function (e) {
      if (ws !== sock) return;
      ws = null;
      if (sock.openedAt && Date.now() - sock.openedAt >= STABLE_MS) backoff = BACKOFF_MIN_MS;
      if (e && e.code === LAYER_DOWN_CLOSE_CODE) {
        // The service is up but its push (channel layer) is not: show it, keep the page current over HTTP.
        setConn("degraded", "live updates paused (server push down), retrying…");
        hydrate();
      } else if (e && e.code === RATE_LIMITED_CLOSE_CODE) {
        board.rateLimited++;
        setConn("degraded", "live updates paused (too many connections), retrying…");
        hydrate();
      } else {
        setConn("offline", "reconnecting…");
      }
      var delay = backoff * (0.5 + Math.random() * 0.5); // jitter
      backoff = Math.min(BACKOFF_MAX_MS, backoff * 2);
      if (sock.retryAfterMs) { // K3: never sooner than the service said (jittered, so pages spread out)
        delay = Math.max(delay, sock.retryAfterMs * (1 + Math.random() * 0.5));
        notBefore = Date.now() + delay;
      }
      reconnectTimer = setTimeout(connect, delay);
    };
  }

  // ---------------------------------------------------------------- B5 done sound
  var audioCtx = null;

  function muted() {
    try { return window.localStorage.getItem(MUTE_KEY) === "1"; } catch (e) { return false; }
  }

  function renderMute() {
    var b = $("mute");
    if (!b) return;
    var m = muted();
    b.textContent = m ? "Sound: off" : "Sound: on";
    b.setAttribute("aria-pressed", m ? "true" : "false");
  }

  function unlockAudio() {
    // Browsers allow audio only after a user gesture: create/resume the context then.
    var AC = window.AudioContext || window.webkitAudioContext;
    if (!audioCtx && AC) { try { audioCtx = new AC(); } catch (e) { audioCtx = null; } }
    if (audioCtx && audioCtx.state === "suspended") audioCtx.resume();
  }

  function beep() {
    unlockAudio();
    if (!audioCtx) return;
    var t0 = audioCtx.currentTime;
    [[880, 0], [1320, 0.16]].forEach(function (tone) {
      var osc = audioCtx.createOscillator();
      var gain = audioCtx.createGain();
      osc.type = "sine";
      osc.frequency.value = tone[0];
      gain.gain.setValueAtTime(0.0001, t0 + tone[1]);
      gain.gain.exponentialRampToValueAtTime(0.2, t0 + tone[1] + 0.02);
      gain.gain.exponentialRampToValueAtTime(0.0001, t0 + tone[1] + 0.15);
      osc.connect(gain).connect(audioCtx.destination);
      osc.start(t0 + tone[1]);
      osc.stop(t0 + tone[1] + 0.16);
    });
  }

  /** A session went busy -> idle (B5). S3 keeps the service from publishing a blip. */
  function sessionDone(session) {
    board.doneCount++;
    document.body.dataset.doneCount = String(board.doneCount);
    if (muted()) return;
    board.beeps++;
    document.body.dataset.beeps = String(board.beeps);
    beep();
  }

  // ---------------------------------------------------------------- rendering
  function sessionTitle(s) { return s.title || "Session " + String(s.id).slice(0, 8); }

  function machineName(id) {
    var m = board.machines.get(id);
    return m ? m.name : "machine " + String(id || "").slice(0, 8);
  }

  var AGENT_NAMES = { claude: "Claude Code", codex: "Codex", gemini: "Gemini CLI", opencode: "opencode", aider: "aider" };
  var AGENT_ICONS = { claude: "✳", codex: "◎", gemini: "✦", opencode: "▣", aider: "◆" };

  function folderName(cwd) {
    var parts = String(cwd || "").replace(/\/+$/, "").split("/");
    return parts[parts.length - 1] || cwd;
  }

  /** I6, Q3: a session needs its owner for a permission prompt or a pending approval. */
  function needsYou(s) { return s.attention === "permission" || s.attention === "approval"; }

  function renderSession(s, nowMs) {
    var needsYou_ = needsYou(s);
    var li = el("li", { className: "row session" + (needsYou_ ? " needs-you" : ""), "data-session-id": s.id,
                        "data-status": s.status, "data-attention": s.attention || "" },
      el("div", { className: "line" },
        el("span", { className: "badge " + s.status, text: s.status }),
        s.agent ? el("span", { className: "agent", "data-agent": s.agent, title: AGENT_NAMES[s.agent] || s.agent },
          (AGENT_ICONS[s.agent] ? AGENT_ICONS[s.agent] + " " : "") + (AGENT_NAMES[s.agent] || s.agent)) : null,
        el("a", { className: "session-link", href: "/sessions/" + encodeURIComponent(s.id) + "/" }, // T6: its chat
          el("strong", { className: "title", text: sessionTitle(s) })),
        s.cwd ? el("span", { className: "muted folder", title: s.cwd, text: folderName(s.cwd) }) : null,
        s.status_since ? el("span", { className: "muted" }, "since ", timeEl(s.status_since, fmtTime(s.status_since))) : null));
    if (needsYou_) {
      li.appendChild(el("div", { className: "line attention" },
        s.attention === "approval" ? el("a", { className: "badge needs-you", href: "#approvals", text: "needs you" })
          : el("span", { className: "badge needs-you", text: "needs you" }),
        el("span", { className: "attention-message", text: s.attention_message ||
          (s.attention === "approval" ? "an approval is pending" : "permission needed") }),
        s.attention_since ? el("span", { className: "muted" }, " since ", timeEl(s.attention_since, fmtTime(s.attention_since))) : null));
    }
    if (s.reach) { // T1: when a message sent now reaches it, in the service's words
      var reachable = !!s.machine && (s.channel === "terminal" || s.channel === "hook");
      li.appendChild(el("div", { className: "line reach muted", "data-channel": s.channel || "none" },
        reachable ? "A message arrives " + s.reach + "." : s.reach));
    }
    var badges = el("div", { className: "line markers" });
    var running = 0;
    Array.from(s.markers.values()).sort(function (a, b) { return (ms(a.started_at) || 0) - (ms(b.started_at) || 0); })
      .forEach(function (m) {
        if (!markerRunning(m, nowMs)) return;
        running++;
        badges.appendChild(el("span", { className: "badge running", "data-device-id": m.device_id, title: "turn " + m.turn_id },
          "RUNNING · " + (m.device_name || m.device_id) + " · " + fmtAge(m.started_at)));
      });
    if (running) li.appendChild(badges);
    return li;
  }

  /* ---- C6 on the card: a live conversation between turns is "waiting for you", not a
   * running timer. The task says where its turn stands (`turn`: "open" while one of its
   * messages is sent or with the agent, "waiting" between turns; republished with every
   * message state), so the card reads it from the task alone. */
  function liveConversation(t) {
    return t.mode === "conversation" && t.conversation === "live" && LEASED[t.state] && !t.conversation_ended_at;
  }

  function taskFacts(t) {
    var facts = [];
    if (t.runtime_s !== null && t.runtime_s !== undefined) facts.push("runtime " + fmtDuration(t.runtime_s));
    else if (liveConversation(t)) {
      if (t.turn !== "waiting") facts.push(t.turn === "open" ? "the agent is working on your message" : "conversation");
    } else {
      var started = t.started_at || (t.lease && t.lease.granted_at);
      if (started && LEASED[t.state]) facts.push("running for " + fmtAge(started));
    }
    if (t.exit_code !== null && t.exit_code !== undefined) facts.push("exit code " + t.exit_code);
    if (t.signal !== null && t.signal !== undefined) facts.push("signal " + t.signal);
    if (t.stop_reason) facts.push("stop: " + t.stop_reason);
    if (t.state_reason && t.stop_reason !== "exit") facts.push(t.state_reason);  // "exit N" repeats the exit code
    if (t.cancel_requested_at && UNFINISHED[t.state]) facts.push("cancel requested");
    if (t.survivors && t.survivors.length) facts.push(t.survivors.length + " process(es) survived");
    return facts;
  }

  /** A structured stream (a line of it is a JSON object): the transcript on the task page
   *  is its readable form, so the card shows none of it. */
  function isJsonStream(text) {
    return text.split("\n").some(function (line) {
      var l = line.trim();
      if (l.slice(0, 2) === '{"') return true; // a JSON object's line, maybe cut short
      if (l.charAt(0) !== "{") return false;
      try { return typeof JSON.parse(l) === "object"; } catch (e) { return false; }
    });
  }

  var FINAL = { succeeded: true, failed: true, failed_lease_lost: true, cancelled: true, not_started: true,
                abandoned: true };

  /* G7: a worktree task's branch and what became of it, one line for the card. */
  function branchText(t, g) {
    var i = t.integration, paths = i && (i.paths || []).join(", ");
    var what = !i ? (FINAL[t.state] ? "ready to merge or discard" : "its own branch")
      : !i.outcome ? i.action + " requested"
      : i.outcome === "merged" ? "merged " + String(i.commit || "").slice(0, 12)
      : i.outcome === "discarded" ? "discarded"
      : i.outcome === "conflict" ? "conflict in " + paths
      : i.outcome === "base_dirty" ? "not merged: uncommitted changes in " + paths
      : "not merged: " + (i.detail || i.outcome);
    return g.branch + " · " + what;
  }

  /* G8: the follow-ups queued behind task t, in the order they will run. */
  function queueOf(t) {
    var out = [], cur = t.id;
    while (out.length < 100) {
      var next = null;
      board.tasks.forEach(function (q) { if (q.state === "queued" && q.queued_behind === cur) next = q; });
      if (!next) break;
      out.push(next);
      cur = next.id;
    }
    return out;
  }

  function renderTask(t, nowMs) {
    var machineId = idOf(t.machine);
    var li = el("li", { className: "row task", "data-task-id": t.id, "data-state": t.state },
      el("div", { className: "line" },
        el("span", { className: "badge state-" + t.state, text: t.state.replace(/_/g, " ") }),
        el("a", { className: "task-link", href: "/tasks/" + encodeURIComponent(t.id) + "/" }, el("strong", { text: t.agent || "" })),
        el("span", { className: "muted" }, "on " + machineName(machineId)),
        t.created_at ? el("span", { className: "muted" }, timeEl(t.created_at, fmtTime(t.created_at))) : null),
      el("div", { className: "mono wrap folder", text: t.folder || "" }));
    if (t.prompt) li.appendChild(el("div", { className: "prompt wrap", text: t.prompt.length > 240 ? t.prompt.slice(0, 240) + "…" : t.prompt }));
    if (t.state === "queued" && t.queued_behind) {
      li.appendChild(el("div", { className: "note queued-note" }, "will run after ",
        el("a", { href: "/tasks/" + encodeURIComponent(t.queued_behind) + "/", text: "the task it follows" })));
    }
    var queue = UNFINISHED[t.state] ? queueOf(t) : [];
    if (queue.length) { // G8: the next instructions, on the card of the task they wait for
      var next = queue[0].prompt || "";
      li.appendChild(el("div", { className: "line queue" },
        el("a", { className: "badge queued-count", href: "/tasks/" + encodeURIComponent(queue[0].id) + "/",
                  text: queue.length + " queued" }),
        el("span", { className: "queued-prompt muted wrap", text: "next: " + (next.length > 120 ? next.slice(0, 120) + "…" : next) })));
    }
    if (t.state === "unknown" && t.needs_decision) {
      li.appendChild(el("div", { className: "line" },
        el("a", { className: "decide", href: "/tasks/" + encodeURIComponent(t.id) + "/", text: "needs your decision" }),
        el("span", { className: "muted", text: "outcome unknown: the service will not guess" })));
    } else if (t.state === "unknown") {
      // N1, U2: the worker's record may still settle it; the owner is asked only if it cannot.
      li.appendChild(el("div", { className: "line" },
        el("span", { className: "muted awaiting-report", text: "outcome unknown: asking the worker for its record" })));
    }
    var g = t.evidence && t.evidence.git;
    if (g && g.branch) {
      li.appendChild(el("div", { className: "facts branch mono wrap", "data-outcome": (t.integration &&
        t.integration.outcome) || "", text: branchText(t, g) }));
    }
    var facts = taskFacts(t);
    if (facts.length) li.appendChild(el("div", { className: "facts muted", text: facts.join(" · ") }));
    if (SLEEP_STATES[t.state] && typeof t.slept_s === "number" && t.slept_s >= SLEEP_SHOWN_S) {
      li.appendChild(el("div", { className: "note sleep", text: "paused by sleep for " + fmtDuration(t.slept_s) }));
    }
    if (WAITING[t.state]) {
      var m = board.machines.get(machineId);
      if (m && m.paired === false) {
        li.appendChild(el("div", { className: "note offline", text: "waiting for " + m.name + ", which is unpaired" }));
      } else if (m && machineOffline(m, nowMs)) {
        li.appendChild(el("div", { className: "note offline" }, "waiting for " + m.name + ", offline " +
          (m.last_heard_at ? "since " : ""), m.last_heard_at ? timeEl(m.last_heard_at, fmtTime(m.last_heard_at)) : "(never heard from)"));
      }
    }
    // B9 on the card: "waiting for you", the agent's last message (two lines), its usage;
    // the raw output only for a plain-text agent, and never its JSON lines.
    if (!t.attention && liveConversation(t) && t.turn === "waiting") {
      li.appendChild(el("div", { className: "line attention conversation-waiting" },
        el("a", { className: "badge needs-you", href: "/tasks/" + encodeURIComponent(t.id) + "/", text: "waiting for you" }),
        el("span", { className: "muted", text: "the agent answered: reply in the chat" })));
    }
    if (t.attention) {
      li.appendChild(el("div", { className: "line attention" },
        el("a", { className: "badge needs-you", href: "/tasks/" + encodeURIComponent(t.id) + "/", text: "waiting for you" }),
        el("span", { className: "muted", text: t.attention === "approval" ? "an approval is pending" : t.attention })));
    }
    var usage = (t.progress && LEASED[t.state] ? t.progress.usage : null) || t.usage;
    var lastMessage = t.progress && t.progress.last_message;
    var said = null;
    if (t.agent_result && t.agent_result.summary && !LEASED[t.state]) {
      said = (t.agent_result.is_error ? "agent error: " : "") + t.agent_result.summary;
    } else if (lastMessage) said = lastMessage;
    if (said) li.appendChild(el("div", { className: "last-message clamp2", title: said.slice(0, 1000), text: said.slice(0, 600) }));
    if (usage) li.appendChild(el("div", { className: "facts usage", text: usageText(usage) }));
    var tail = ((t.progress && LEASED[t.state] && t.progress.output_tail) || t.output_tail || "").replace(/\s+$/, "");
    if (!said && tail && !isJsonStream(tail)) {
      li.appendChild(el("pre", { className: "tail", text: tail.split("\n").slice(-OUTPUT_LINES).join("\n") }));
    }
    return li;
  }

  function renderMachine(m, nowMs) {
    var offline = machineOffline(m, nowMs);
    var li = el("li", { className: "row machine", "data-machine-id": m.id, "data-online": offline ? "false" : "true" },
      el("div", { className: "line" },
        el("span", { className: "badge " + (offline ? "offline" : "online"), text: offline ? "offline" : "online" }),
        el("strong", { text: m.name }),
        m.paired === false ? el("span", { className: "muted", text: "unpaired" }) : null));
    var heard = el("div", { className: "muted" });
    if (m.last_heard_at) {
      heard.appendChild(document.createTextNode("last heard "));
      heard.appendChild(timeEl(m.last_heard_at, fmtTime(m.last_heard_at)));
      heard.appendChild(document.createTextNode(" (" + fmtAge(m.last_heard_at) + " ago)"));
      if (offline) {
        heard.appendChild(document.createTextNode(" · offline since "));
        heard.appendChild(timeEl(m.last_heard_at, fmtTime(m.last_heard_at)));
      }
    } else heard.textContent = "never heard from";
    li.appendChild(heard);
    return li;
  }

  function replaceList(id, items, emptyId) {
    var list = $(id);
    var fresh = el("ul", { id: id, className: list.className });
    items.forEach(function (i) { fresh.appendChild(i); });
    if (fresh.innerHTML !== list.innerHTML) list.replaceWith(fresh);
    if (emptyId) $(emptyId).hidden = items.length > 0;
  }

  function byTime(field) {
    return function (a, b) { return (ms(b[field]) || 0) - (ms(a[field]) || 0); };
  }

  function render() {
    var nowMs = now();
    var sessions = Array.from(board.sessions.values()).sort(function (a, b) {
      var an = needsYou(a), bn = needsYou(b); // I6: "needs you" first
      if (an !== bn) return an ? -1 : 1;
      if ((a.status === "busy") !== (b.status === "busy")) return a.status === "busy" ? -1 : 1;
      return (ms(b.status_since) || 0) - (ms(a.status_since) || 0);
    });
    replaceList("session-list", sessions.map(function (s) { return renderSession(s, nowMs); }), "session-empty");

    var tasks = Array.from(board.tasks.values());
    // B1, N1: only the tasks whose owner was asked (U2 left them unsettled) come first.
    var needsDecision = function (t) { return t.state === "unknown" && !!t.needs_decision; };
    var unknown = tasks.filter(needsDecision).sort(byTime("created_at"));
    var open = tasks.filter(function (t) { return UNFINISHED[t.state] && !needsDecision(t); }).sort(byTime("created_at"));
    var done = tasks.filter(function (t) { return !UNFINISHED[t.state]; }).sort(function (a, b) {
      return (ms(b.final_at || b.updated_at) || 0) - (ms(a.final_at || a.updated_at) || 0);
    });
    replaceList("decision-list", unknown.map(function (t) { return renderTask(t, nowMs); }));
    $("decisions").hidden = unknown.length === 0;
    replaceList("task-list", open.concat(done).map(function (t) { return renderTask(t, nowMs); }), "task-empty");

    var machines = Array.from(board.machines.values()).sort(function (a, b) { return String(a.name).localeCompare(String(b.name)); });
    replaceList("machine-list", machines.map(function (m) { return renderMachine(m, nowMs); }), "machine-empty");
    renderFormOptions(machines);
    document.dispatchEvent(new CustomEvent("runstead:render")); // machines.js re-renders its panel
  }

  // ---------------------------------------------------------------- B8 task form
  var form = null;
  var submitting = false;

  function renderFormOptions(machines) {
    if (!form) return;
    var select = form.elements.machine;
    var paired = machines.filter(function (m) { return m.paired !== false; });
    var pools = Array.from(board.pools.values()).sort(function (a, b) { return String(a.name).localeCompare(String(b.name)); });
    var signature = paired.map(function (m) { return m.id + ":" + m.name; }).join("|") + "#" +
      pools.map(function (p) { return p.name + ":" + p.machines.join(","); }).join("|");
    if (select.dataset.signature !== signature) {
      var chosen = select.value;
      var chosenOption = select.options[select.selectedIndex];
      var chosenPool = chosenOption ? chosenOption.getAttribute("data-pool") : null;
      select.textContent = "";
      paired.forEach(function (m) { select.appendChild(el("option", { value: m.id, text: m.name })); });
      // C8: acceptance picks a paired, recently heard machine with the folder's repository and room.
      if (paired.length) select.appendChild(el("option", { value: ANY_MACHINE, text: "any machine" }));
      // C8: or one of the machines of a pool the owner named (its name is the task's "machine").
      pools.forEach(function (p) { select.appendChild(el("option", { value: p.name, text: "pool " + p.name, "data-pool": p.id })); });
      // A chosen pool renamed elsewhere (a pool event) stays chosen under its new name.
      var renamed = pools.filter(function (p) { return p.id === chosenPool; })[0];
      if (renamed) chosen = renamed.name;
      var known = chosen === ANY_MACHINE || paired.some(function (m) { return m.id === chosen; }) ||
        pools.some(function (p) { return p.name === chosen; });
      if (chosen && known) select.value = chosen;
      select.dataset.signature = signature;
    }
    // B10: the chosen machine's reported profiles and its granted folders; for "any
    // machine" (C8), those of every paired machine; for a pool, those of its paired machines.
    var pool = pools.filter(function (p) { return p.name === select.value; })[0];
    var any = select.value === ANY_MACHINE || !!pool;
    var candidates = pool ? paired.filter(function (m) { return pool.machines.indexOf(m.id) >= 0; }) : paired;
    var machine = board.machines.get(select.value);
    var profiles = any ? anyProfiles(candidates) : (machine && machine.profiles) || [];
    var agent = form.elements.agent;
    var profileSig = select.value + "|" + profiles.map(function (p) { return p.name + ":" + (p.preset || ""); }).join("|");
    if (agent.dataset.signature !== profileSig) {
      var chosenProfile = agent.value;
      agent.textContent = "";
      profiles.forEach(function (p) {
        agent.appendChild(el("option", { value: p.name, text: p.preset && p.preset !== p.name ? p.name + " (" + p.preset + ")" : p.name }));
      });
      if (profiles.some(function (p) { return p.name === chosenProfile; })) agent.value = chosenProfile;
      agent.dataset.signature = profileSig;
      $("profile-note").hidden = !select.value || profiles.length > 0;
    }
    // C1: a conversation only with a profile that can hold one (live or by follow-ups).
    var picked = profiles.filter(function (p) { return p.name === agent.value; })[0];
    var converses = !!picked && (picked.conversation === "live" || picked.conversation === "resume");
    form.elements.conversation.disabled = !converses;
    if (!converses) form.elements.conversation.checked = false;
    var folder = form.elements.folder;
    var pairedIds = candidates.map(function (m) { return m.id; });
    var paths = board.grants.filter(function (g) { return any ? pairedIds.indexOf(g.machine) >= 0 : g.machine === select.value; })
      .map(function (g) { return g.path; })
      .filter(function (p, i, all) { return all.indexOf(p) === i; });
    var sig = select.value + "|" + paths.join("|");
    if (folder.dataset.signature !== sig) {
      var chosenFolder = folder.value;
      folder.textContent = "";
      paths.forEach(function (p) { folder.appendChild(el("option", { value: p, text: p })); });
      if (paths.indexOf(chosenFolder) >= 0) folder.value = chosenFolder;
      folder.dataset.signature = sig;
    }
  }

  var ANY_MACHINE = "any";

  function anyProfiles(machines) {
    var seen = {};
    var all = [];
    machines.forEach(function (m) {
      (m.profiles || []).forEach(function (p) { if (!seen[p.name]) { seen[p.name] = true; all.push(p); } });
    });
    return all.sort(function (a, b) { return String(a.name).localeCompare(String(b.name)); });
  }

  var WHY_NOT = { unpaired: "unpaired", offline: "offline", profile_not_reported: "no such profile",
    limits_not_reported: "its worker has not reported its limits", repository_not_found: "does not have this repository",
    folder_not_granted: "folder not granted", full: "at its max_concurrent", folder_locked: "folder in use" };

  function noMachineText(d) {
    // C8: why each machine could not take the task.
    return "No machine can take this task now: " + (d.machines || []).map(function (m) {
      return m.name + " (" + (WHY_NOT[m.reason] || m.reason) + ")";
    }).join(", ") + ".";
  }

  function formStatus(text, isError) { C.tell($("form-status"), text, isError); }

  function submitTask(e) {
    e.preventDefault();
    if (submitting) return; // a double click sends once; a resubmit reuses the key anyway
    var key = form.dataset.idempotencyKey;
    var body = {
      machine: form.elements.machine.value,
      folder: form.elements.folder_other.value.trim() || form.elements.folder.value,
      agent: form.elements.agent.value.trim(),
      prompt: form.elements.prompt.value,
      deep_research: form.elements.deep_research.checked,
    };
    var conversation = form.elements.conversation.checked;
    if (conversation) body.mode = "conversation"; // C1: the task page becomes its chat
    submitting = true;
    var button = form.querySelector("button[type=submit]");
    button.disabled = true;
    formStatus("Sending…", false);
    C.api("POST", "/api/tasks/", body, { "Idempotency-Key": key })
      .then(function (res) {
        if (res.status >= 200 && res.status < 300) {
          if (res.data && res.data.id) applyRow(board.tasks, res.data, res.data.version);
          form.elements.prompt.value = "";
          form.dataset.idempotencyKey = newKey(); // the next task is a new request
          if (conversation && res.data && res.data.id) {
            window.location.assign("/tasks/" + encodeURIComponent(res.data.id) + "/");
            return;
          }
          formStatus("Task accepted.", false);
          render();
          return;
        }
        var d = res.data || {};
        if (d.error === "idempotency_key_reused") {
          // This form was already accepted with other content; a changed form is a new request.
          form.dataset.idempotencyKey = newKey();
          formStatus("This form was already submitted with different content; check the task list, then submit again for a new task.", true);
          return;
        }
        formStatus(d.error === "no_machine_available" ? noMachineText(d) : C.errorText(res.status, d), true);
      })
      .catch(function () {
        // The service may have accepted it: keep the key so a resubmit replays (A2).
        formStatus("Network error; submit again (it will not create a second task).", true);
      })
      .then(function () { submitting = false; button.disabled = false; });
  }

  // ---------------------------------------------------------------- start
  function start() {
    form = $("task-form");
    if (form) {
      form.dataset.idempotencyKey = newKey();
      form.addEventListener("submit", submitTask);
      form.elements.machine.addEventListener("change", function () { render(); });
    }
    var muteButton = $("mute");
    if (muteButton) {
      muteButton.addEventListener("click", function () {
        try { window.localStorage.setItem(MUTE_KEY, muted() ? "0" : "1"); } catch (e) { /* private mode */ }
        renderMute();
      });
    }
    renderMute();
    document.addEventListener("pointerdown", unlockAudio);
    document.addEventListener("keydown", unlockAudio);

    var embedded = $("board-snapshot");
    if (embedded) {
      try { applySnapshot(JSON.parse(embedded.textContent), 0); } catch (e) { /* hydrate fixes it */ }
    }
    board.loaded = true;
    render();
    connect();
    setInterval(render, TICK_MS);
    setInterval(hydrate, HYDRATE_EVERY_MS);
    document.addEventListener("visibilitychange", function () {
      if (document.visibilityState === "visible") { connect(); hydrate(); }
    });
    window.addEventListener("online", function () { backoff = BACKOFF_MIN_MS; connect(); });
  }

  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
