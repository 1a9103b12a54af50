"""No request turned inward (SPEC K5): every connection the service opens on an owner's
behalf (webhooks, Web Push endpoints) goes only to a public address or one inside
``RUNSTEAD_OUTBOUND_ALLOW``.

The check sits between name resolution and connect, in one place used by both senders:
``GuardedBackend.connect_tcp`` (the httpcore network backend of ``guarded_client``)
resolves the host itself, checks every address it got, and connects to the checked
address literal, so a name that resolves inward, or rebinds between the check at save
and the send, is caught at the connection it would have made. Web Push goes through the
same client (``PushSession``, handed to pywebpush as its session). Redirects are never
followed and environment proxies never used.

Policy (``address_refusal``): an address is allowed when it is inside an allowed network,
or global (``ipaddress``'s IANA special-purpose registry) and neither multicast nor
reserved; an IPv6 address that embeds an IPv4 one (IPv4-mapped, 6to4, Teredo) must pass
for the embedded one too, and the deprecated IPv4-compatible ``::/96`` never passes. A
host passes only when *every* address it resolves to passes: a name answering both a
public and an inward address is refused outright (a rebinding tell), never raced.
"""
import ipaddress
import socket
from urllib.parse import urlsplit

import httpcore
import httpx
from django.conf import settings

from core.errors import ApplicationError

# Resolution goes through this name so a test can answer for names of its own without
# the network (tests/conftest.py); production resolves with the system's resolver.
getaddrinfo = socket.getaddrinfo

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


class OutboundRefused(Exception):
    """A connection K5 refused before it was made: ``host`` as given, ``address`` the
    resolved one that failed, ``reason`` (``loopback``, ``private``, ...). Not an
    ``OSError``, so no HTTP library retries it or turns it into a network error."""

    def __init__(self, host: str, address: str, reason: str):
        super().__init__(f"{host} resolves to {address} ({reason}), refused by K5")
        self.host, self.address, self.reason = host, address, reason


def allowed_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """``RUNSTEAD_OUTBOUND_ALLOW`` (CIDR strings, checked by the settings) as networks."""
    return [ipaddress.ip_network(cidr) for cidr in settings.RUNSTEAD_OUTBOUND_ALLOW]


def address_refusal(address: Address, allow: list) -> str | None:
    """None when K5 lets a connection go to ``address``; else why not (``loopback``,
    ``private``, ``link_local``, ``multicast``, ``unspecified``, ``reserved``,
    ``not_global``)."""
    if any(address.version == net.version and address in net for net in allow):
        return None
    if address.version == 6:
        if address.ipv4_mapped is not None:  # the socket goes to the IPv4 address itself
            return address_refusal(address.ipv4_mapped, allow)
        for inner in (address.sixtofour, *(address.teredo or ())):
            if inner is not None and (reason := address_refusal(inner, allow)):
                return reason
    for reason, flag in (("unspecified", address.is_unspecified), ("loopback", address.is_loopback),
                         ("link_local", address.is_link_local), ("multicast", address.is_multicast),
                         ("private", address.is_private), ("reserved", address.is_reserved)):
        if flag:
            return reason
    if address.version == 6 and address in _IPV4_COMPATIBLE:
        return "reserved"
    return None if address.is_global else "not_global"


def resolve(host: str, port: int) -> list[str]:
    """The addresses (text) ``host`` resolves to for a TCP connection, in the resolver's
    order, duplicates removed. Raises ``socket.gaierror`` when it does not resolve. IP
    literals in any spelling the C library accepts (``2130706433``, ``0177.0.0.1``,
    ``[::1]``) come back as the address they mean, without a DNS query."""
    infos = getaddrinfo(host, port, type=socket.SOCK_STREAM)
    seen: list[str] = []
    for _family, _type, _proto, _name, sockaddr in infos:
        if sockaddr[0] not in seen:
            seen.append(sockaddr[0])
    return seen


def checked_addresses(host: str, port: int) -> list[str]:
    """K5's check between resolution and connect: ``host`` resolved, every address
    checked. Returns the addresses to connect to; raises ``OutboundRefused`` when any is not allowed, ``socket.gaierror`` when the name does not resolve."""
    allow = allowed_networks()
    addresses = resolve(host, port)
    for text in addresses:
        reason = address_refusal(ipaddress.ip_address(text.split("%", 1)[0]), allow)
        if reason:
            raise OutboundRefused(host, text, reason)
    return addresses


class GuardedBackend(httpcore.SyncBackend):
    """httpcore's socket backend with K5's check: resolves ``host``, checks every
    address (``checked_addresses``), then connects to the checked literal, so no second
    resolution can differ from the one checked. TLS still verifies the URL's host name
    (httpcore passes it as ``server_hostname``)."""

    def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        try:
            addresses = checked_addresses(host, port)
        except socket.gaierror as exc:
            raise httpcore.ConnectError(f"{host}: {exc}") from exc
        error = None
        for address in addresses:
            try:
                return super().connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error


class GuardedTransport(httpx.HTTPTransport):
    """An ``httpx`` transport whose connections go through ``GuardedBackend``; no
    proxies from the environment (a proxy would make the checked address the proxy's)."""

    def __init__(self):
        super().__init__(trust_env=False)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(trust_env=False), network_backend=GuardedBackend()
        )


def guarded_client(timeout_s: float) -> httpx.Client:
    """An ``httpx.Client`` for requests sent on an owner's behalf (K5): guarded
    connections, redirects not followed (a 3xx is the answer), environment ignored.
    ``timeout_s`` applies to connect, each read and each write. A refused connection
    raises ``OutboundRefused`` out of the request call."""
    return httpx.Client(transport=GuardedTransport(), timeout=timeout_s, follow_redirects=False, trust_env=False)


class PushResponse:
    """The part of a ``requests.Response`` pywebpush reads (status, reason, text,
    headers), from an ``httpx.Response``."""

    def __init__(self, response: httpx.Response):
        self.status_code = response.status_code
        self.reason = response.reason_phrase
        self.text = response.text
        self.headers = response.headers


class PushSession:
    """What pywebpush calls as its ``requests_session`` (``post(url, data=, headers=,
    timeout=)``), sending through ``guarded_client``: Web Push gets K5's check and no
    redirects, like webhooks."""

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def post(self, url, data=None, headers=None, timeout=None):
        with guarded_client(self.timeout_s) as client:
            return PushResponse(client.post(url, content=data, headers=headers))


def url_check(url: str) -> None:
    """At save (K5): refuse a webhook or push endpoint URL whose host is an address K5
    refuses or resolves to one. Raises ApplicationError 400 ``url_not_allowed``. A name
    that does not resolve now is accepted: the check at each connection still holds, and
    a name may resolve later (its delivery is then retried by R4, or dropped by K5)."""
    try:
        parsed = httpx.URL(url)
        host, port = parsed.host, parsed.port or (443 if parsed.scheme == "https" else 80)
    except httpx.InvalidURL as exc:
        # e.g. "0177.0.0.1", which the C library reads as 127.0.0.1 and httpx refuses
        raise ApplicationError("url_not_allowed", f"not a URL the service can send to: {exc}")
    if not host or parsed.scheme not in ("http", "https"):
        raise ApplicationError("url_not_allowed", "only http and https URLs with a host")
    try:
        checked_addresses(host, port)
    except OutboundRefused as exc:
        raise ApplicationError("url_not_allowed", f"{exc.host} is or resolves to {exc.address} ({exc.reason}); "
                               "RunStead sends only to public addresses (K5)")
    except (socket.gaierror, UnicodeError):
        pass


def url_syntax_ok(url: str) -> bool:
    """A URL's shape as the save paths accept it (K3; K5 decides about its host after):
    ``http`` or ``https`` with a host. Any host spelling passes here, so an inward one is
    answered ``url_not_allowed`` rather than a generic ``invalid``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not any(c.isspace() for c in url)
