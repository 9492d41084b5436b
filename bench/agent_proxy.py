"""A logging proxy for agent trials: see what Claude Code, Codex & co. send to redlite.

    python bench/agent_proxy.py --listen 18802 --target 18801 --log /tmp/claude.jsonl

Forwards every request on 127.0.0.1:LISTEN to 127.0.0.1:TARGET (streamed responses are passed
through as they arrive) and appends one JSON line per request to LOG: method, path, headers,
the JSON body, the response status and the last 4000 characters of the response. Loopback only.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

_HOP = {"host", "content-length", "connection", "transfer-encoding", "content-encoding"}


def make_handler(target: int, log_path: str) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the body ends when the connection closes (fits SSE)

        def forward(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = self.rfile.read(length) if length else b""
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = body.decode("utf-8", "replace")
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            chunks = []
            with httpx.Client(timeout=600) as client:
                with client.stream(self.command, f"http://127.0.0.1:{target}{self.path}",
                                   content=body, headers=headers) as response:
                    self.send_response(response.status_code)
                    for key, value in response.headers.items():
                        if key.lower() not in _HOP:
                            self.send_header(key, value)
                    self.end_headers()
                    for chunk in response.iter_raw():
                        chunks.append(chunk)
                        self.wfile.write(chunk)
                        self.wfile.flush()
            record = {"method": self.command, "path": self.path, "headers": dict(self.headers.items()),
                      "body": parsed, "status": response.status_code,
                      "response": b"".join(chunks).decode("utf-8", "replace")[-4000:]}
            with lock, open(log_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")

        do_GET = do_POST = do_HEAD = do_DELETE = forward

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--listen", type=int, required=True, help="port to listen on (127.0.0.1)")
    parser.add_argument("--target", type=int, required=True, help="redlite's port (127.0.0.1)")
    parser.add_argument("--log", required=True, help="JSON-lines file to append requests to")
    args = parser.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.listen), make_handler(args.target, args.log)).serve_forever()


if __name__ == "__main__":
    main()
