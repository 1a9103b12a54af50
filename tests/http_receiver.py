"""A local HTTP server for notification tests: records every request and answers from a
script of status codes (``"hang"`` holds the request until the test releases it; a
``(status, headers)`` pair answers with those headers, e.g. a redirect)."""
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    """``Receiver(answers=[500, 200])``: the n-th request gets ``answers[n]`` (the last
    one repeats). ``requests``: ``[{"path", "headers" (lower-case keys), "body"}]``."""

    def __init__(self, answers=(200,)):
        self.answers = list(answers)
        self.requests: list[dict] = []
        self.release = threading.Event()
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                with receiver.arrived:
                    index = len(receiver.requests)
                    receiver.requests.append(
                        {"path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
                    )
                    receiver.arrived.notify_all()
                answer = receiver.answers[min(index, len(receiver.answers) - 1)]
                if answer == "hang":
                    receiver.release.wait(30)
                    answer = 200
                status, headers = answer if isinstance(answer, tuple) else (answer, {})
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, count: int, timeout_s: float = 10.0) -> list[dict]:
        """Block until ``count`` requests arrived (or fail after ``timeout_s``)."""
        with self.arrived:
            if not self.arrived.wait_for(lambda: len(self.requests) >= count, timeout=timeout_s):
                raise AssertionError(f"{len(self.requests)} requests arrived, expected {count}")
        return self.requests

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
