"""TCP proxies the tests share: ``Balancer`` (several daphnes behind one address, D1:
``tests/test_several_daphnes.py`` and the history run) and ``BlackholeProxy`` (a link
that goes half-open on demand: ``tests/test_longpoll.py`` and the history run's
partitions). A connection whose two directions have both ended is closed at once (a
long run opens tens of thousands: the history run's 30 minutes ran out of descriptors
when they were only closed with the proxy)."""
import socket
import threading

from tests.live import local_listener


def _one_way_ended(connection: dict, dst: socket.socket) -> None:
    """The pump of ``connection`` into ``dst`` ended: ``dst`` is told (its write half
    shut); once both pumps have ended, both sockets are closed."""
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    with connection["lock"]:
        connection["pumps"] -= 1
        last = connection["pumps"] == 0
    if last:
        for sock in connection["sockets"]:
            sock.close()


class Balancer:
    """A TCP balancer in front of ``ports``: each new connection goes to the next port in
    turn that accepts it (a dead process refuses, so it is skipped, as the proxy's
    passive health check does); when either side closes, so does the other."""

    def __init__(self, ports):
        self.ports, self.turn = list(ports), 0
        self.listener = local_listener(512)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = []  # {"port", "open", ...}: where each connection went, and whether it still is
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = None
            for _ in range(len(self.ports)):
                port = self.ports[self.turn % len(self.ports)]
                self.turn += 1
                try:
                    upstream = socket.create_connection(("127.0.0.1", port), timeout=2)
                    upstream.settimeout(None)
                    break
                except OSError:
                    continue
            if upstream is None:
                client.close()
                continue
            connection = {"port": port, "open": True, "sockets": (client, upstream), "pumps": 2, "lock": threading.Lock()}
            self.connections.append(connection)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b, connection), daemon=True).start()

    def open_to(self, port) -> int:
        """Connections to ``port`` not yet closed."""
        return sum(1 for c in list(self.connections) if c["port"] == port and c["open"])

    @staticmethod
    def _pump(src, dst, connection):
        """Either side's close closes the other (its last pump closes both sockets)."""
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        connection["open"] = False
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        _one_way_ended(connection, dst)

    def close(self):
        self.listener.close()
        for connection in list(self.connections):
            for sock in connection["sockets"]:
                sock.close()


class BlackholeProxy:
    """A TCP proxy to ``port``; ``blackhole()`` stops forwarding both ways on the
    connections open then (or only those whose last request starts with ``request``) and
    closes nothing: a half-open connection, as after a Wi-Fi drop. Later connections pass."""

    def __init__(self, port):
        self.target = port
        self.listener = local_listener()
        self.port = self.listener.getsockname()[1]
        self.connections = []  # [{"sockets", "request": last request's first bytes, "holed"}]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            connection = {"sockets": (client, upstream), "request": b"", "holed": threading.Event(), "pumps": 2,
                          "lock": threading.Lock()}
            self.connections.append(connection)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b, connection, a is client), daemon=True).start()

    def _pump(self, src, dst, connection, from_client):
        """Forward ``src`` to ``dst`` until it ends; an end is passed on (a holed
        connection's is not: it stays half-open)."""
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                if not connection["holed"].is_set():
                    _one_way_ended(connection, dst)
                return
            if self.cutting():
                connection["holed"].set()
            if connection["holed"].is_set():
                continue  # dropped on the floor; the connection stays open
            if from_client and data[:4] in (b"GET ", b"POST", b"PUT ", b"PATC", b"DELE"):
                connection["request"] = data[:80]
            try:
                dst.sendall(data)
            except OSError:
                if not connection["holed"].is_set():
                    _one_way_ended(connection, dst)
                return

    def cutting(self) -> bool:
        """Whether every connection is being holed as its next bytes arrive (none here; a
        partition switch overrides it)."""
        return False

    def blackhole(self, request: bytes = b"") -> int:
        """Hole the open connections (whose last request starts with ``request``); how many."""
        chosen = [c for c in list(self.connections) if c["request"].startswith(request)]
        for connection in chosen:
            connection["holed"].set()
        return len(chosen)

    def close(self):
        self.listener.close()
        for connection in self.connections:
            for s in connection["sockets"]:
                s.close()
