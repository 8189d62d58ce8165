"""A fault-injecting HTTP proxy in front of an S3 server, run as its own process by the tests:

    python tests/s3_fault_proxy.py --upstream http://127.0.0.1:PORT --port P \
        --fault PUT:iter_0000004/model:503:3 [--fault ...] [--log FILE]

forwards every request to --upstream, except that the first COUNT requests whose method is
METHOD and whose path contains SUBSTRING get ACTION instead: an HTTP status (500, 503: an
S3-style error body), `drop` (the connection closed without an answer, the request's body
read or not) or `hang` (held for a minute: a trainer killed mid-upload). COUNT `*` is every
such request. Each faulted request is appended to --log as "METHOD PATH ACTION" (written
before a hang starts), so a test knows the moment it happened.
"""

import argparse
import http.client
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te",
                "upgrade", "trailer"}


class Fault:
    def __init__(self, spec: str):
        self.method, self.substring, self.action, count = spec.split(":")
        self.left = float("inf") if count == "*" else int(count)

    def claims(self, method: str, path: str) -> bool:
        if method != self.method or self.substring not in path or self.left <= 0:
            return False
        self.left -= 1
        return True


def make_handler(upstream: str, faults: list[Fault], log: str | None):
    target = urllib.parse.urlsplit(upstream)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))

        def _fault(self) -> str | None:
            with lock:
                fault = next((f for f in faults if f.claims(self.command, self.path)), None)
                if fault is not None and log:
                    with open(log, "a") as f:
                        f.write(f"{self.command} {self.path} {fault.action}\n")
            return fault.action if fault else None

        def _handle(self):
            action = self._fault()
            if action == "drop":
                self.close_connection = True
                self.connection.close()
                return
            body = self._body()
            if action == "hang":
                time.sleep(60)
                self.close_connection = True
                return
            if action is not None:
                error = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>"
                         f"{'SlowDown' if action == '503' else 'InternalError'}</Code><Message>"
                         f"injected by the test proxy</Message></Error>").encode()
                self._answer(int(action), [("Content-Type", "application/xml")], error)
                return
            connection = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_HEADERS}
            if body or "Content-Length" in self.headers or \
                    "Transfer-Encoding" in self.headers:
                headers["Content-Length"] = str(len(body))
            connection.request(self.command, self.path, body=body, headers=headers)
            reply = connection.getresponse()
            data = reply.read()
            self._answer(reply.status, reply.getheaders(), data)
            connection.close()

        def _answer(self, status: int, headers, data: bytes):
            self.send_response(status)
            for key, value in headers:
                if key.lower() not in _HOP_HEADERS and key.lower() != "content-length":
                    self.send_header(key, value)
            length = dict((k.lower(), v) for k, v in headers).get("content-length")
            self.send_header("Content-Length", length if self.command == "HEAD" and length
                             else str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

    return Handler


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--log")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", args.port),
                                 make_handler(args.upstream, [Fault(f) for f in args.fault],
                                              args.log))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
