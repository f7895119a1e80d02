"""A loopback HTTP proxy in front of the tests' moto server that answers some requests itself
with the errors a real S3 gives under load (503 SlowDown, 500 InternalError) instead of
forwarding them: what shardkit's retries are tested against (tests/system/s3/test_s3_locations.py); or never answers
some (a hung connection: tests/system/safety/test_safety_s3.py)."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

FAULTS = (
    (503, "SlowDown", "Please reduce your request rate."),
    (500, "InternalError", "We encountered an internal error."),
)
HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "content-length", "date", "server"}


class FaultProxy:
    """`fail_every`: every n-th request gets a fault (alternately SlowDown and InternalError);
    `fail_all`: every request does; `fail_first`: the first attempt of each request whose method
    and path (query included) contain that text does; `hang`: a GET with a Range header whose
    path contains that text is never answered (until `close`; `hung` is set once one is). Counts
    requests and faults, and the body bytes each GET returned by object key (`got`, `reset_counts`);
    `url` is its endpoint."""

    def __init__(  # noqa: PLR0913
        self, upstream: str, fail_every: int = 0, fail_all: bool = False, fail_first: str = "", hang: str = ""
    ):
        self.upstream = urlsplit(upstream)
        self.fail_every, self.fail_all, self.fail_first = fail_every, fail_all, fail_first
        self.hang = hang
        self.hung = threading.Event()
        self._closing = threading.Event()
        self._seen: set[str] = set()
        self.requests = self.faults = 0
        self.faulted: list[str] = []
        self.got: dict[str, int] = {}
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive and 100-continue, as boto3 expects

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                if proxy.hang and self.command == "GET" and "Range" in self.headers and proxy.hang in self.path:
                    proxy.hung.set()
                    proxy._closing.wait(600)  # the connection stays open and silent
                    return
                fault = proxy._fault(f"{self.command} {self.path}")
                if fault is not None:
                    status, code, message = fault
                    payload = (
                        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                        f"<Message>{message}</Message><RequestId>shardkit-test</RequestId></Error>"
                    ).encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=120)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in HOP:
                            self.send_header(k, v)
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                    if self.command == "GET" and resp.status in (200, 206) and "list-type" not in self.path:
                        proxy._count(urlsplit(self.path).path, len(data))
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _fault(self, what: str) -> tuple[int, str, str] | None:
        with self._lock:
            self.requests += 1
            first = bool(self.fail_first) and self.fail_first in what and what not in self._seen
            if first:
                self._seen.add(what)
            if self.fail_all or first or (self.fail_every and self.requests % self.fail_every == 0):
                self.faults += 1
                self.faulted.append(what)
                return FAULTS[self.faults % 2]
            return None

    def _count(self, path: str, size: int) -> None:
        key = unquote(path.lstrip("/").split("/", 1)[-1])
        with self._lock:
            self.got[key] = self.got.get(key, 0) + size

    def reset_counts(self) -> None:
        """Forget the bytes counted so far."""
        with self._lock:
            self.got.clear()

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()
