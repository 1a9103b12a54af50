"""No request turned inward (SPEC K5): webhook URLs and Web Push endpoints that are, or
resolve to, loopback, private, link-local, multicast or unspecified addresses are
refused at save (400 ``url_not_allowed``) and at every connection the notify loop would
make (the delivery is dropped, logged, never retried); redirects are not followed.

No test here sends traffic anywhere but its own 127.0.0.1 receivers (allowed through
``RUNSTEAD_OUTBOUND_ALLOW``): names resolve from the table of ``outbound_names``
(tests/conftest.py), public addresses are only ever resolved, never connected to, and
the ``wire`` fixture observes K5 where it acts: each check between resolution and
connect, each connection httpcore makes, each socket connect of the process.
"""
import ipaddress
import json
import logging
import os
import secrets
import socket
import subprocess
import sys

import httpcore
import pytest

from notifications import delivery, outbound
from notifications.models import Delivery, NotificationSettings, PushSubscription
from tests.http_receiver import Receiver
from tests.sessions_events import at, board, board_events, new_id  # noqa: F401
from tests.notify_support import ALL_ON, browser_keys, put_settings, subscribe, turn
from tests.live import BASE_DIR

pytestmark = pytest.mark.django_db(transaction=True)

PUBLIC = "93.184.216.34"  # resolved to in these tests, never connected to

# (URL, the address K5 sees, why it is refused); the address is None where httpx itself
# refuses the spelling before any resolution.
HOSTILE = [
    ("http://127.0.0.1:5432/x", "127.0.0.1", "loopback"),
    ("http://127.9.9.9:9/", "127.9.9.9", "loopback"),
    ("http://[::1]:6379/", "::1", "loopback"),
    ("http://[::ffff:127.0.0.1]:9/", "::ffff:127.0.0.1", "loopback"),
    ("http://0.0.0.0:8000/", "0.0.0.0", "unspecified"),
    ("http://[::]:9/", "::", "unspecified"),
    ("http://10.1.2.3:9/", "10.1.2.3", "private"),
    ("http://172.16.5.4:9/", "172.16.5.4", "private"),
    ("http://192.168.1.10:9/", "192.168.1.10", "private"),
    ("http://[fc00::1]:9/", "fc00::1", "private"),
    ("http://169.254.169.254/latest/meta-data/", "169.254.169.254", "link_local"),
    ("http://[fe80::1]:9/", "fe80::1", "link_local"),
    ("http://224.0.0.1:9/", "224.0.0.1", "multicast"),
    ("http://2130706433:9/", "127.0.0.1", "loopback"),  # decimal spelling of 127.0.0.1
    ("http://0x7f.0.0.1:9/", "127.0.0.1", "loopback"),  # hexadecimal
    ("http://0177.0.0.1:9/", None, None),  # octal: the C library reads 127.0.0.1, httpx refuses it
    ("http://localhost:6379/", "127.0.0.1", "loopback"),
    ("https://inward.test:9/hook", "10.0.0.5", "private"),  # a name that resolves inward
    ("https://mixed.test:9/hook", "127.0.0.1", "loopback"),  # one public and one inward answer
]
IDS = [url for url, _, _ in HOSTILE]


@pytest.fixture(autouse=True)
def names(outbound_names):
    outbound_names.update({"inward.test": ["10.0.0.5"], "mixed.test": [PUBLIC, "127.0.0.1"]})
    return outbound_names


class Wire:
    """What K5 did, in order: ``("check", host, addresses | "refused:<reason>")`` at the
    check between resolution and connect; ``("connect", address, port)`` for each
    connection httpcore opens; ``("socket", address, port)`` for every socket connect in
    this process."""

    def __init__(self):
        self.events: list[tuple] = []

    def of(self, kind):
        return [e for e in self.events if e[0] == kind]


@pytest.fixture
def wire(monkeypatch):
    record = Wire()
    real_check = outbound.checked_addresses

    def checked_addresses(host, port):
        try:
            addresses = real_check(host, port)
        except outbound.OutboundRefused as exc:
            record.events.append(("check", host, f"refused:{exc.reason}"))
            raise
        record.events.append(("check", host, addresses))
        return addresses

    real_connect = httpcore.SyncBackend.connect_tcp

    def connect_tcp(self, host, port, *args, **kwargs):
        record.events.append(("connect", host, port))
        return real_connect(self, host, port, *args, **kwargs)

    real_socket_connect = socket.socket.connect

    def socket_connect(sock, address):
        record.events.append(("socket", address[0], address[1]))
        return real_socket_connect(sock, address)

    monkeypatch.setattr(outbound, "checked_addresses", checked_addresses)
    monkeypatch.setattr(httpcore.SyncBackend, "connect_tcp", connect_tcp)
    monkeypatch.setattr(socket.socket, "connect", socket_connect)
    return record


@pytest.fixture
def receivers(settings):
    settings.RUNSTEAD_OUTBOUND_ALLOW = ["127.0.0.0/8"]
    made = []

    def make(answers=(200,)):
        made.append(Receiver(answers))
        return made[-1]

    yield make
    for r in made:
        r.close()


def store_webhook(owner, url):
    """A webhook URL stored without the save path's check (as one saved before K5 was
    built, or one whose name rebinds later)."""
    NotificationSettings.objects.update_or_create(owner=owner, defaults={
        "kinds": dict(ALL_ON), "webhook_url": url, "webhook_secret": secrets.token_hex(32), "board": True,
        "push": False, "updated_at": at_now()})


def at_now():
    from core import clock
    return clock.now()


def store_subscription(owner, endpoint):
    _, keys, _ = browser_keys()
    PushSubscription.objects.create(owner=owner, endpoint=endpoint, p256dh=keys["p256dh"], auth=keys["auth"],
                                    created_at=at_now())


# --- the policy --------------------------------------------------------------------------------------


@pytest.mark.parametrize("address, allow, refused", [
    ("8.8.8.8", [], None),
    ("2606:4700::1", [], None),
    ("127.0.0.1", [], "loopback"),
    ("127.0.0.1", ["127.0.0.0/8"], None),
    ("::ffff:127.0.0.1", ["127.0.0.0/8"], None),  # the socket goes to 127.0.0.1, which is allowed
    ("::1", ["127.0.0.0/8"], "loopback"),
    ("10.0.0.1", ["127.0.0.0/8"], "private"),
    ("100.64.0.1", [], "not_global"),  # carrier-grade NAT
    ("192.0.2.1", [], "private"),  # documentation range
    ("255.255.255.255", [], "private"),
    ("2002:7f00:1::", [], "loopback"),  # 6to4 around 127.0.0.1
    ("2002:808:808::", [], None),  # 6to4 around 8.8.8.8
    ("64:ff9b::7f00:1", [], "reserved"),
    ("::127.0.0.1", [], "reserved"),  # deprecated IPv4-compatible
    ("ff02::1", [], "multicast"),
])
def test_k5_address_policy(address, allow, refused):
    networks = [ipaddress.ip_network(n) for n in allow]
    assert outbound.address_refusal(ipaddress.ip_address(address), networks) == refused


def allow_setting(**env):
    """``RUNSTEAD_OUTBOUND_ALLOW`` as a fresh interpreter reads it from ``env``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RUNSTEAD_")}
    clean.update(DJANGO_SETTINGS_MODULE="config.settings", RUNSTEAD_VAR_DIR=str(BASE_DIR / "var"), **env)
    return subprocess.run([sys.executable, "-c", "import django, json; django.setup(); from django.conf import "
                           "settings as s; print(json.dumps(s.RUNSTEAD_OUTBOUND_ALLOW))"],
                          cwd=BASE_DIR, env=clean, capture_output=True, text=True)


def test_k5_allow_list_setting_is_strict_and_empty_by_default():
    assert json.loads(allow_setting().stdout) == []  # nothing inward is reachable by default
    ok = allow_setting(RUNSTEAD_OUTBOUND_ALLOW=" 127.0.0.0/8, ::1 ,10.0.0.0/8")
    assert json.loads(ok.stdout) == ["127.0.0.0/8", "::1/128", "10.0.0.0/8"], ok.stderr
    bad = allow_setting(RUNSTEAD_OUTBOUND_ALLOW="127.0.0.1/8")
    assert bad.returncode != 0 and "RUNSTEAD_OUTBOUND_ALLOW" in bad.stderr


# --- at save: 400 url_not_allowed, nothing stored, nothing connected -----------------------------------


@pytest.mark.parametrize("url, address, reason", HOSTILE, ids=IDS)
def test_k5_hostile_webhook_url_refused_at_save(owner_client, wire, url, address, reason):
    response = put_settings(owner_client, webhook_url=url)
    assert response.status_code == 400, response.content
    assert response.json()["error"] == "url_not_allowed"
    assert owner_client.get("/api/notifications/settings/").json()["webhook_url"] is None
    assert not NotificationSettings.objects.exists()
    if reason:
        assert wire.events == [("check", wire.events[0][1], f"refused:{reason}")]
    assert not wire.of("connect") and not wire.of("socket")


@pytest.mark.parametrize("url, address, reason", HOSTILE, ids=IDS)
def test_k5_hostile_push_endpoint_refused_at_save(owner_client, wire, url, address, reason):
    _, keys, _ = browser_keys()
    response = subscribe(owner_client, url, keys)
    assert response.status_code == 400, response.content
    assert response.json()["error"] == "url_not_allowed"
    assert PushSubscription.objects.count() == 0
    assert not wire.of("connect") and not wire.of("socket")


def test_k5_public_and_unresolvable_urls_are_saved_without_connecting(owner_client, wire, names):
    names["hooks.public.test"] = [PUBLIC]
    assert put_settings(owner_client, webhook_url="https://hooks.public.test/x").status_code == 200
    assert put_settings(owner_client, webhook_url="https://ntfy.example/topic").status_code == 200  # no answer now
    assert wire.events == [("check", "hooks.public.test", [PUBLIC])]  # the second did not resolve: no check ran


# --- at delivery: dropped before any connection, logged, never retried ------------------------------------


@pytest.mark.parametrize("url, address, reason", HOSTILE, ids=IDS)
def test_k5_inward_webhook_dropped_before_connect(board, board_events, owner, wire, caplog, at, url, address, reason):
    store_webhook(owner, url)
    turn(board, new_id())
    with caplog.at_level(logging.WARNING, logger="runstead.notify"):
        assert delivery.notify_step() == 1
    row = Delivery.objects.get()
    assert (row.status, row.attempts) == ("dropped", 1)
    assert row.last_error.startswith("url_not_allowed")
    if reason:
        assert wire.events == [("check", wire.events[0][1], f"refused:{reason}")]
        assert f"{address} ({reason})" in caplog.text and str(row.pk) in caplog.text
    assert not wire.of("connect") and not wire.of("socket")
    at(3600)
    assert delivery.notify_step() == 0  # final: never retried
    assert Delivery.objects.get().attempts == 1


@pytest.mark.parametrize("url, address, reason", HOSTILE, ids=IDS)
def test_k5_inward_push_endpoint_dropped_before_connect(board, board_events, owner, wire, url, address, reason):
    store_subscription(owner, url)
    turn(board, new_id())
    assert delivery.notify_step() == 1
    row = Delivery.objects.get()
    assert (row.status, row.attempts) == ("dropped", 1)
    if url.startswith("http://["):  # py_vapid cannot name an IPv6 literal as the JWT's "aud": dropped earlier
        assert row.last_error.startswith("vapid") and not wire.events
    else:
        assert row.last_error.startswith("url_not_allowed")
        if reason:
            assert wire.events == [("check", wire.events[0][1], f"refused:{reason}")]
    assert not wire.of("connect") and not wire.of("socket")
    assert PushSubscription.objects.count() == 1  # not "gone": nothing answered


@pytest.mark.parametrize("channel", ["webhook", "push"])
def test_k5_name_rebinding_inward_after_save_is_caught_at_connect(board, board_events, owner_client, wire, names,
                                                                   caplog, at, channel):
    names["rebind.test"] = [PUBLIC]
    url = "https://rebind.test:8443/in"
    if channel == "webhook":
        assert put_settings(owner_client, webhook_url=url, push=False).status_code == 200
    else:
        _, keys, _ = browser_keys()
        assert subscribe(owner_client, url, keys).status_code == 201
    assert wire.events == [("check", "rebind.test", [PUBLIC])]  # saved: resolved public, not connected
    names["rebind.test"] = ["127.0.0.1"]  # the name's owner rebinds it
    turn(board, new_id())
    with caplog.at_level(logging.WARNING, logger="runstead.notify"):
        assert delivery.notify_step() == 1
    assert wire.events[1:] == [("check", "rebind.test", "refused:loopback")]
    assert "dropped" in caplog.text and "127.0.0.1 (loopback)" in caplog.text
    row = Delivery.objects.get()
    assert (row.channel, row.status, row.attempts) == (channel, "dropped", 1)
    at(3600)
    assert delivery.notify_step() == 0


# --- allowed receivers: checked, then connected; redirects never followed -----------------------------


def test_k5_allowed_receiver_is_checked_then_connected(board, board_events, owner_client, receivers, wire):
    hook = receivers([200])
    port = int(hook.url.rsplit(":", 1)[1])
    assert put_settings(owner_client, webhook_url=hook.url + "/hook").status_code == 200
    turn(board, new_id())
    assert delivery.notify_step() == 1
    hook.wait_for(1)
    assert wire.events == [
        ("check", "127.0.0.1", ["127.0.0.1"]),  # the save
        ("check", "127.0.0.1", ["127.0.0.1"]), ("connect", "127.0.0.1", port), ("socket", "127.0.0.1", port),
    ]
    assert Delivery.objects.get().status == "sent"


@pytest.mark.parametrize("channel", ["webhook", "push"])
@pytest.mark.parametrize("target", ["receiver", "metadata"])
def test_k5_redirect_is_not_followed(board, board_events, owner_client, receivers, wire, channel, target):
    second = receivers([200])
    location = second.url + "/next" if target == "receiver" else "http://169.254.169.254/latest/meta-data/"
    first = receivers([(302, {"Location": location})])
    if channel == "webhook":
        assert put_settings(owner_client, webhook_url=first.url + "/hook", push=False).status_code == 200
    else:
        _, keys, _ = browser_keys()
        assert subscribe(owner_client, first.url + "/push", keys).status_code == 201
    turn(board, new_id())
    assert delivery.notify_step() == 1
    first.wait_for(1)
    row = Delivery.objects.get()
    assert (row.status, row.last_error[:8]) == ("dropped", "HTTP 302")  # a 3xx is the answer, final
    first_port = int(first.url.rsplit(":", 1)[1])
    assert wire.of("connect") == [("connect", "127.0.0.1", first_port)]  # one connection, to the first only
    assert {e[2] for e in wire.of("socket")} == {first_port}
    assert not second.requests
    assert all(e[1] == "127.0.0.1" for e in wire.of("check"))  # 169.254.169.254 never even resolved
