"""The fake Anthropic API's HTTP plumbing: a threaded loopback server that speaks HTTP/1.1, JSON and chunked SSE.

It knows nothing of the Messages API: every request goes to `fake._serve(handler)`, and the handler offers the
few ways to answer (a JSON body, an event stream, a dropped connection). Keep-alive, TCP_NODELAY and RST on drop
are here so the SDK under test sees what it would see from the real API.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import sys
import threading
import uuid
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from durable_agents.testing.fake_anthropic import FakeAnthropic


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096  # a thousand clients connecting at once are queued, not refused

    def __init__(self, address: tuple[str, int], handler: type[Handler], fake: FakeAnthropic) -> None:
        self.fake = fake
        self._connections: set[socket.socket] = set()
        self._connections_lock = threading.Lock()
        super().__init__(address, handler)
        # Headers and body go out in separate writes: without this, Nagle + delayed ACK add ~40 ms a request.
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def track(self, connection: socket.socket, *, open: bool) -> None:
        with self._connections_lock:
            (self._connections.add if open else self._connections.discard)(connection)

    def close_connections(self) -> None:
        # Keep-alive handlers block reading the next request; shutting their sockets lets the threads end.
        with self._connections_lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out or was reset on purpose makes our late write fail; that is the test working.
        if isinstance(sys.exc_info()[1], OSError):
            return
        super().handle_error(request, client_address)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive and chunked SSE, like the real API
    server: Server
    timeout = 30  # idle keep-alive connections give up their thread eventually

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, open=True)

    def finish(self) -> None:
        self.server.track(self.connection, open=False)
        super().finish()

    def do_POST(self) -> None:
        self.server.fake._serve(self)

    # Every method is answered, so a wrong one gets an Anthropic-style 404 rather than http.server's HTML 501.
    do_GET = do_PUT = do_DELETE = do_PATCH = do_POST

    def content_length(self) -> int:
        """The request's declared body size; a missing or unreadable header counts as no body."""
        try:
            return max(0, int(self.headers.get("content-length") or 0))
        except ValueError:
            return 0

    def discard_body(self, length: int) -> None:
        """Read and drop `length` bytes of body, so an answer sent without reading it reaches the client."""
        while length > 0:
            chunk = self.rfile.read(min(length, 1 << 20))
            if not chunk:
                return
            length -= len(chunk)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the request log is the record; stderr noise would drown test output

    def _send_head(self, status: int, headers: Mapping[str, str]) -> None:
        self.send_response(status)
        self.send_header("request-id", f"req_01{uuid.uuid4().hex[:22]}")
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()

    def send_json(self, status: int, body: Mapping[str, Any], headers: Mapping[str, str] | None = None) -> None:
        self.send_bytes(status, json.dumps(body).encode(), "application/json", headers)

    def send_bytes(
        self, status: int, payload: bytes, content_type: str, headers: Mapping[str, str] | None = None
    ) -> None:
        self._send_head(status, {"content-type": content_type, "content-length": str(len(payload)), **(headers or {})})
        self.wfile.write(payload)

    def start_stream(self, headers: Mapping[str, str] | None = None) -> None:
        self._send_head(
            200,
            {
                "content-type": "text/event-stream; charset=utf-8",
                "cache-control": "no-cache",
                "transfer-encoding": "chunked",
                **(headers or {}),
            },
        )

    def send_event(self, event: str, data: Mapping[str, Any]) -> None:
        chunk = f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()
        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")

    def drop_connection(self) -> None:
        # SO_LINGER 0 turns close() into a RST: the client sees "connection reset", not a clean EOF.
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.rfile.close()  # makefile() holds a reference; the fd only closes when both are released
            self.connection.close()
