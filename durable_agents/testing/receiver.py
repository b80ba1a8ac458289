"""An HTTP receiver on loopback that dedupes by Idempotency-Key: the other side of an external tool in tests.

Example::

    with IdempotentReceiver() as receiver:
        requests.post(receiver.url + "/emails", json={...}, headers={"Idempotency-Key": "k1"})
        receiver.requests_for("k1")   # how many times the key arrived
        receiver.applied["k1"]        # the body applied, once
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class ReceivedRequest:
    path: str
    key: str
    body: Any


class IdempotentReceiver:
    """Counts every POST and applies each Idempotency-Key once; a request without a key gets 400."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.requests: list[ReceivedRequest] = []
        self.applied: dict[str, Any] = {}
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                key = self.headers.get("idempotency-key", "")
                status, answer = receiver._receive(self.path, key, body)
                payload = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="idempotent-receiver", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _receive(self, path: str, key: str, body: Any) -> tuple[int, dict[str, Any]]:
        if not key:
            return 400, {"error": "Idempotency-Key header is required"}
        with self._lock:
            self.requests.append(ReceivedRequest(path, key, body))
            replay = key in self.applied
            if not replay:
                self.applied[key] = body
            return 200, {"key": key, "replay": replay, "applied": len(self.applied)}

    def requests_for(self, key: str) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.key == key)

    def start(self) -> IdempotentReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> IdempotentReceiver:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
