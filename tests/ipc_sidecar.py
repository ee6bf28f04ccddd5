"""The sidecar's IPC endpoints as specified (``GET /v1/ipc/{rank}``, ``POST .../release``, bearer token), served by
the standard library's HTTP server on loopback: for the adapter and hand-off tests that need the protocol without
the whole sidecar."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TOKEN = "s3cret-token-0123456789"


class Sidecar:
    """The sidecar's IPC endpoints as specified (GET /v1/ipc/{rank}, POST .../release, bearer token), on loopback."""

    def __init__(self, docs: dict[int, dict[str, Any]], token: str = TOKEN):
        self.docs, self.token, self.released, self.requests = docs, token, [], []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _route(self, method: str) -> None:
                outer.requests.append((method, self.path, self.headers.get("Authorization")))
                if self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._reply(401, {"detail": "missing or wrong bearer token"})
                parts = self.path.strip("/").split("/")
                if parts[:2] != ["v1", "ipc"] or not parts[2:3] or not parts[2].isdigit():
                    return self._reply(404, {"detail": "no such endpoint"})
                rank = int(parts[2])
                if rank not in outer.docs:
                    return self._reply(503, {"detail": f"rank {rank} is loading"})
                if method == "GET" and len(parts) == 3:
                    return self._reply(200, outer.docs[rank])
                if method == "POST" and parts[3:] == ["release"]:
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    outer.released.append(rank)
                    return self._reply(200, {"released": rank})
                return self._reply(405, {"detail": "method not allowed"})

            def do_GET(self) -> None:
                self._route("GET")

            def do_POST(self) -> None:
                self._route("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Sidecar:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)
