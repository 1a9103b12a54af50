"""Notifications through a real daphne (N3): the embedded notify loop delivers after
commit, and a webhook that never answers does not delay the request that caused the
event."""
import time
import uuid

import httpx
import pytest

from tests.http_receiver import Receiver
from tests.live import live_daphne  # noqa: F401  (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ALL_ON = {"session_idle": True, "attention": True, "unknown": True, "task_succeeded": True, "task_failed": True,
          "approval": True}


def test_n3_hanging_webhook_does_not_delay_the_request_and_embedded_loop_sends(live_daphne, owner):
    hook = Receiver(["hang", 200])
    try:
        url = live_daphne(RUNSTEAD_EMBEDDED_NOTIFY="1", RUNSTEAD_NOTIFY_INTERVAL_S="0.2",
                          RUNSTEAD_OUTBOUND_ALLOW="127.0.0.0/8")  # K5: the local receiver
        with httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=10) as api:
            put = api.put("/api/notifications/settings/", json={
                "kinds": ALL_ON, "webhook_url": hook.url + "/hook", "board": True, "push": True})
            assert put.status_code == 200, put.text
            sid = str(uuid.uuid4())
            marker = {"turn_id": "t1", "device_id": "d1", "state": "running"}
            assert api.put(f"/api/sessions/{sid}/marker/", json=marker).status_code == 200
            started = time.monotonic()
            ended = api.put(f"/api/sessions/{sid}/marker/", json={**marker, "state": "ended"})
            first_request_s = time.monotonic() - started
            assert ended.status_code == 200 and ended.json()["outcome"] == "applied"
            (held,) = hook.wait_for(1)  # the loop sent it after commit, and the hook hangs...
            assert held["headers"]["x-runstead-event"] == "session_idle"
            # ...while the next request that causes an event still answers at once.
            assert api.put(f"/api/sessions/{sid}/marker/", json={**marker, "turn_id": "t2"}).status_code == 200
            started = time.monotonic()
            again = api.put(f"/api/sessions/{sid}/marker/", json={**marker, "turn_id": "t2", "state": "ended"})
            second_request_s = time.monotonic() - started
            assert again.status_code == 200
            requests = hook.wait_for(2)
            assert requests[1]["headers"]["x-runstead-delivery"] != requests[0]["headers"]["x-runstead-delivery"]
        assert first_request_s < 1.0, first_request_s
        assert second_request_s < 1.0, second_request_s
    finally:
        hook.close()


@pytest.mark.postgres
def test_n3_a_delivery_another_process_commits_is_sent_at_once_not_at_the_next_poll(live_daphne, owner):
    """Issue 44: with PostgreSQL the notify loop LISTENs, so an idle service need not claim
    every second: the daphne's loop polls here only every 60 s, yet a delivery committed by
    this test's process (the daphne's in-process waker never hears of it) goes out at once."""
    from django.db import connection, transaction

    from core import clock
    from notifications.services import DELIVERIES_CHANNEL, notification_emit
    from tests.wait import wait_for

    hook = Receiver([200])
    try:
        url = live_daphne(RUNSTEAD_EMBEDDED_NOTIFY="1", RUNSTEAD_NOTIFY_INTERVAL_S="60",
                          RUNSTEAD_OUTBOUND_ALLOW="127.0.0.0/8")
        with httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=10) as api:
            put = api.put("/api/notifications/settings/", json={
                "kinds": ALL_ON, "webhook_url": hook.url + "/hook", "board": True, "push": True})
            assert put.status_code == 200, put.text

        def listening() -> bool:
            with connection.cursor() as cursor:
                cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE query = %s AND datname = current_database()",
                               [f"LISTEN {DELIVERIES_CHANNEL}"])
                return cursor.fetchone()[0] == 1

        wait_for(listening, timeout_s=20, what="the daphne's notify loop listening")
        started = time.monotonic()
        with transaction.atomic():
            assert notification_emit(owner_id=owner.id, kind="session_idle", event_key=f"test:{uuid.uuid4()}",
                                     title="idle", body="", url="/", subject={}, now=clock.now()) is not None
        (sent,) = hook.wait_for(1, timeout_s=20)
        took_s = time.monotonic() - started
        assert sent["headers"]["x-runstead-event"] == "session_idle"
        assert took_s < 5.0, f"sent {took_s:.1f} s after the commit: found by a poll, not announced"
    finally:
        hook.close()
