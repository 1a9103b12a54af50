"""The notify loop (SPEC N3): sends due ``Delivery`` rows after commit, with R4's backoff
(``machine.protocol.Backoff``: exponential with equal jitter, capped at 60 s), drops what is older than 24 h, and removes a
push subscription that its push service answered 404/410.

One step claims a batch of due deliveries in a short transaction
(``select_for_update(skip_locked=True)``, moving ``next_attempt_at`` forward by the claim
window), commits, then sends them concurrently from a small thread pool, each with its
own timeout, and records each outcome by compare-and-set on the claim. Several loops may
run at once (O2). A delivery is sent at most once per event id unless a loop dies between
sending and recording; then it goes again after the claim window with the same
``X-RunStead-Delivery``, by which a receiver can tell.

Every send goes through K5's guarded client (``notifications.outbound``): an address
that turned inward since the URL was saved drops the delivery, logged, never retried.

Runs as ``manage.py notify [--once]`` or inside daphne (``config/server_hooks.py``).

When it looks (issue 44: an idle service costs next to no transactions): at once when this
process committed a delivery or scheduled a retry (``services.wake_loops``); with
PostgreSQL, at once when any process committed one (``LISTEN``, ``listen_for_deliveries``)
and otherwise when the earliest pending delivery falls due, at least every
``LISTEN_POLL_S``; without it (SQLite), every ``interval_s`` as well.
"""
import asyncio
import hashlib
import hmac
import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import Min

from core import clock
from notifications import outbound, services
from notifications.models import Channel, Delivery, DeliveryStatus, NotificationSettings, PushSubscription
from machine.protocol import Backoff

log = logging.getLogger("runstead.notify")

BATCH = 50
LISTEN_POLL_S = 30.0  # with PostgreSQL's LISTEN: the loop looks by itself at least this often
LISTEN_RETRY_S = 5.0  # a listener whose connection failed connects again after this
SEND_THREADS = 4
SEND_TIMEOUT_S = 10.0  # per HTTP request (connect + read)
CLAIM_S = 60.0  # > SEND_TIMEOUT_S: a claimed delivery is not due again before its send ended
BACKOFF = Backoff(base_s=1.0)  # R4: the first retry after 0.5-1 s, doubling to 30-60 s
MAX_AGE_S = 24 * 3600.0  # N3: dropped after 24 h
PUSH_TTL_S = 24 * 3600  # how long a push service keeps it for an offline browser
USER_AGENT = "RunStead-notify/1"


@dataclass
class Outcome:
    """``sent``, ``retry`` (transient: 429, 5xx, network) or ``drop`` (final); ``gone``:
    the push service says the subscription no longer exists (404/410)."""

    result: str
    error: str = ""
    gone: bool = False


def webhook_signature(secret: str, body: bytes) -> str:
    """``sha256=<hex HMAC-SHA256 of the raw body>`` (H)."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def _status_outcome(status: int, text: str) -> Outcome:
    if 200 <= status < 300:
        return Outcome("sent")
    error = f"HTTP {status}: {text[:200]}"
    if status == 429 or status >= 500 or status == 408:
        return Outcome("retry", error)
    return Outcome("drop", error)


def send_webhook(delivery: Delivery, *, secret: str, timeout_s: float = SEND_TIMEOUT_S) -> Outcome:
    """POST the notification's payload as JSON to the webhook URL, signed (H)."""
    body = json.dumps(delivery.notification.payload, separators=(",", ":"), sort_keys=True).encode("utf-8")
    headers = {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "X-RunStead-Event": delivery.notification.kind,
        "X-RunStead-Delivery": str(delivery.notification_id),
        "X-RunStead-Signature": webhook_signature(secret, body),
    }
    try:
        with outbound.guarded_client(timeout_s) as client:
            response = client.post(delivery.url, content=body, headers=headers)
    except outbound.OutboundRefused as exc:
        return _refused(delivery, exc)
    except httpx.InvalidURL as exc:
        return Outcome("drop", f"url_not_allowed: {exc}"[:300])
    except httpx.HTTPError as exc:
        return Outcome("retry", f"{type(exc).__name__}: {exc}"[:300])
    return _status_outcome(response.status_code, response.text)


def _refused(delivery: Delivery, exc: outbound.OutboundRefused) -> Outcome:
    """K5: the address turned inward after the URL was saved: the delivery is dropped
    (final, never retried) with a log line; nothing was sent."""
    log.warning("delivery %s (%s) dropped: %s", delivery.pk, delivery.channel, exc)
    return Outcome("drop", f"url_not_allowed: {exc}"[:300])


def push_headers(payload: dict) -> dict:
    """RFC 8030 ``Topic`` for a notification that a later one replaces (Q6: an approval's
    question, then its answer, tagged with the approval id): a push service that still
    holds the question for an offline device replaces it. A topic is at most 32
    characters of the base64url alphabet: the tag's UUID without dashes."""
    tag = str(payload.get("tag") or "").replace("-", "")
    return {"Topic": tag} if tag and len(tag) <= 32 and tag.isalnum() else {}


def send_push(delivery: Delivery, *, timeout_s: float = SEND_TIMEOUT_S) -> Outcome:
    """Encrypt the payload for the subscription (RFC 8291, aes128gcm) and POST it to its
    push service with a VAPID JWT (RFC 8292) signed by the deployment's key, through K5's
    guarded client (``outbound.PushSession``)."""
    from py_vapid import Vapid, VapidException
    from pywebpush import WebPushException, webpush

    sub = delivery.subscription
    key = services.vapid_key()
    try:
        webpush(
            subscription_info={"endpoint": sub.endpoint, "keys": {"p256dh": sub.p256dh, "auth": sub.auth}},
            data=json.dumps(delivery.notification.payload, separators=(",", ":")),
            vapid_private_key=Vapid.from_pem(key.private_pem.encode("ascii")),
            vapid_claims={"sub": settings.RUNSTEAD_VAPID_SUBJECT},
            ttl=PUSH_TTL_S,
            timeout=timeout_s,
            headers=push_headers(delivery.notification.payload),
            requests_session=outbound.PushSession(timeout_s),
        )
    except outbound.OutboundRefused as exc:
        return _refused(delivery, exc)
    except httpx.InvalidURL as exc:
        return Outcome("drop", f"url_not_allowed: {exc}"[:300])
    except VapidException as exc:  # e.g. an IPv6-literal endpoint py_vapid cannot name as "aud": never better
        return Outcome("drop", f"vapid: {exc}"[:300])
    except WebPushException as exc:
        response = exc.response
        if response is None:
            return Outcome("retry", str(exc)[:300])
        outcome = _status_outcome(response.status_code, response.text or "")
        outcome.gone = response.status_code in (404, 410)
        return outcome
    except httpx.HTTPError as exc:
        return Outcome("retry", f"{type(exc).__name__}: {exc}"[:300])
    return Outcome("sent")


def deliveries_claim(*, now: datetime, batch: int = BATCH) -> list[Delivery]:
    """Claim up to ``batch`` due pending deliveries (drops those past 24 h first). Returns
    them with ``notification`` and ``subscription`` loaded; each claimed row's
    ``next_attempt_at`` is its claim token for ``delivery_record``."""
    expired_before = now - timedelta(seconds=MAX_AGE_S)
    with transaction.atomic():
        Delivery.objects.filter(status=DeliveryStatus.PENDING, created_at__lt=expired_before).update(
            status=DeliveryStatus.DROPPED, dropped_at=now, last_error="expired after 24 h (N3)"
        )
        rows = list(
            Delivery.objects.select_for_update(skip_locked=True, of=("self",))
            .select_related("notification", "subscription")
            .filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=now)
            .order_by("next_attempt_at")[:batch]
        )
        claim_until = now + timedelta(seconds=CLAIM_S)
        for row in rows:
            row.attempts += 1
            row.next_attempt_at = claim_until
        Delivery.objects.bulk_update(rows, ["attempts", "next_attempt_at"])
    return rows


def deliveries_claim_next(*, now: datetime, batch: int = BATCH) -> tuple[list[Delivery], datetime | None]:
    """``deliveries_claim`` and, in the same transaction, when the earliest delivery still
    pending after it falls due (None: none pending): the loop sleeps until then."""
    with transaction.atomic():
        rows = deliveries_claim(now=now, batch=batch)
        next_at = Delivery.objects.filter(status=DeliveryStatus.PENDING).aggregate(at=Min("next_attempt_at"))["at"]
    return rows, next_at


def delivery_record(delivery: Delivery, outcome: Outcome, *, now: datetime) -> None:
    """Store one send's outcome, by compare-and-set on the claim (a row claimed again by
    another loop in the meantime is left to it). A ``gone`` push subscription is removed
    (its other pending deliveries with it)."""
    claimed = Delivery.objects.filter(pk=delivery.pk, status=DeliveryStatus.PENDING, next_attempt_at=delivery.next_attempt_at)
    if outcome.result == "sent":
        claimed.update(status=DeliveryStatus.SENT, sent_at=now, last_error="")
    elif outcome.result == "retry":
        if claimed.update(next_attempt_at=now + timedelta(seconds=BACKOFF.delay(delivery.attempts - 1)),
                          last_error=outcome.error):
            transaction.on_commit(services.wake_loops, robust=True)  # this process's loop sleeps until it is due
    else:
        claimed.update(status=DeliveryStatus.DROPPED, dropped_at=now, last_error=outcome.error)
    if outcome.gone and delivery.subscription_id:
        PushSubscription.objects.filter(pk=delivery.subscription_id).delete()
        log.info("push subscription %s removed: %s", delivery.subscription_id, outcome.error)


def _send_one(delivery: Delivery) -> Outcome:
    try:
        if delivery.channel == Channel.PUSH:
            return send_push(delivery)
        prefs = NotificationSettings.objects.filter(owner_id=delivery.notification.owner_id).first()
        if prefs is None or prefs.webhook_url != delivery.url or not prefs.webhook_secret:
            return Outcome("drop", "webhook URL changed or removed")
        return send_webhook(delivery, secret=prefs.webhook_secret)
    except Exception as exc:  # noqa: BLE001 - one bad delivery must not stop the others
        log.exception("delivery %s failed", delivery.pk)
        return Outcome("retry", f"{type(exc).__name__}: {exc}"[:300])


def _send_and_record(row: Delivery) -> Outcome:
    outcome = _send_one(row)
    try:
        delivery_record(row, outcome, now=clock.now())
    finally:
        close_old_connections()
    return outcome


def notify_step(*, now: datetime | None = None) -> int:
    """One pass, waiting for its sends: claim due deliveries, send them concurrently,
    record the outcomes. Returns how many were attempted (0 = no work found; one indexed
    query). For ``--once`` and tests; the loops use ``Sender``."""
    rows = deliveries_claim(now=now or clock.now())
    if rows:
        with ThreadPoolExecutor(SEND_THREADS, thread_name_prefix="notify") as pool:
            list(pool.map(_send_and_record, rows))
    return len(rows)


class Sender:
    """The loops' sender: claims due deliveries and hands each to a thread pool, without
    waiting for earlier sends, so one slow or hanging receiver (bounded by
    ``SEND_TIMEOUT_S``) never holds back the others. At most ``max_in_flight`` sends are
    queued or running."""

    def __init__(self, threads: int = SEND_THREADS, max_in_flight: int = 4 * SEND_THREADS):
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="notify")
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.lock = threading.Lock()
        self.next_at: datetime | None = None  # the earliest pending delivery's due time at the last step

    def _done(self, _future):
        with self.lock:
            self.in_flight -= 1

    def step(self) -> int:
        """Claim what is due (up to the free capacity) and submit it; returns how many."""
        with self.lock:
            room = self.max_in_flight - self.in_flight
        if room <= 0:
            return 0
        try:
            rows, self.next_at = deliveries_claim_next(now=clock.now(), batch=min(BATCH, room))
        except Exception:  # noqa: BLE001 - the loop must outlive one bad pass
            log.exception("notify claim failed")
            self.next_at = None
            return 0
        finally:
            close_old_connections()
        for row in rows:
            with self.lock:
                self.in_flight += 1
            self.pool.submit(_send_and_record, row).add_done_callback(self._done)
        return len(rows)

    def wait_s(self, poll_s: float) -> float:
        """How long the loop may sleep (seconds): until the earliest pending delivery is
        due, at most ``poll_s``."""
        if self.next_at is None:
            return poll_s
        return max(0.0, min(poll_s, (self.next_at - clock.now()).total_seconds()))

    def close(self):
        self.pool.shutdown(wait=False, cancel_futures=True)


def notify_drain(*, max_passes: int = 100) -> int:
    """``--once``: passes until nothing is due now; returns deliveries attempted."""
    total = 0
    for _ in range(max_passes):
        attempted = notify_step()
        if not attempted:
            break
        total += attempted
    return total


listening = threading.Event()  # a listener of this process is connected: the loops may sleep long


def listen_for_deliveries(wake, stop: threading.Event) -> None:
    """PostgreSQL: call ``wake()`` whenever any process commits deliveries
    (``services.announce_deliveries``), and once after each (re)connection (what was
    committed while nobody listened), until ``stop`` is set. Runs on its own thread with
    its own connection (outside Django's pool: it stays checked out for the process's
    life); a failed connection is retried every ``LISTEN_RETRY_S`` seconds, while the loop
    falls back to polling every ``interval_s``."""
    import psycopg  # the PostgreSQL driver; only imported where PostgreSQL is the database

    params = connection.get_connection_params()
    params.pop("cursor_factory", None)
    while not stop.is_set():
        try:
            with psycopg.connect(**params, autocommit=True) as conn:
                conn.execute(f"LISTEN {services.DELIVERIES_CHANNEL}")
                listening.set()
                wake()
                while not stop.is_set():
                    for _ in conn.notifies(timeout=1.0, stop_after=1):
                        wake()
        except Exception:  # noqa: BLE001 - the listener must outlive a database restart
            log.warning("notify listener lost its connection; polling until it is back", exc_info=True)
        finally:
            listening.clear()
        stop.wait(LISTEN_RETRY_S)



def _start_listener(wake, stop: threading.Event) -> None:
    """``listen_for_deliveries`` on a daemon thread, with PostgreSQL only."""
    if connection.vendor == "postgresql":
        threading.Thread(target=listen_for_deliveries, args=(wake, stop), name="notify-listen", daemon=True).start()


def _poll_s(interval_s: float) -> float:
    return LISTEN_POLL_S if listening.is_set() else interval_s


def notify_forever(stop: threading.Event, interval_s: float) -> None:
    """The loop of ``manage.py notify``: claim and submit, then wait until woken (module
    docstring: a delivery committed, here or, with PostgreSQL, anywhere; a retry due) or
    stopped, looking by itself every ``interval_s`` (``LISTEN_POLL_S`` while listening)."""
    wake = threading.Event()
    services.add_waker(wake.set)
    _start_listener(wake.set, stop)
    sender = Sender()
    try:
        while not stop.is_set():
            if sender.step():
                continue  # more may be due at once
            wake.wait(sender.wait_s(_poll_s(interval_s)))
            wake.clear()
    finally:
        stop.set()
        services.remove_waker(wake.set)
        sender.close()


async def notify_loop(interval_s: float) -> None:
    """The loop as a task on daphne's event loop; each pass runs in a worker thread (sends
    block on the network, never the server). It waits as ``notify_forever`` does."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def waker():
        loop.call_soon_threadsafe(wake.set)

    services.add_waker(waker)
    stop = threading.Event()
    _start_listener(waker, stop)
    sender = Sender()
    try:
        while True:
            attempted = await sync_to_async(sender.step, thread_sensitive=False)()
            if attempted:
                continue
            try:
                await asyncio.wait_for(wake.wait(), timeout=sender.wait_s(_poll_s(interval_s)))
            except TimeoutError:
                pass
            wake.clear()
    finally:
        stop.set()
        services.remove_waker(waker)
        sender.close()
