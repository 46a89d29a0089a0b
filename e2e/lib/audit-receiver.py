"""MinIO's audit webhook target for e2e/run: one JSON line per request MinIO
served, appended to a file. MinIO posts each entry as it completes, so the
file is the server's own record of every GetObject: object, Content-Range
and bytes sent.

    python3 audit-receiver.py PORT FILE
"""

import http.server
import sys

out = open(sys.argv[2], "ab", buffering=0)


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        n = int(self.headers.get("content-length", 0))
        body = self.rfile.read(n).strip()
        if body:
            out.write(body + b"\n")
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    # MinIO posts entries at once for requests that end together: a full
    # listen backlog (5 by default) would turn some away.
    request_queue_size = 256


Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
