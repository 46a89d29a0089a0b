"""MinIO's audit webhook target for e2e/run: one JSON line per request MinIO
served, appended to a file. MinIO posts each entry as it completes, so the
file is the server's own record of every GetObject: object, Content-Range
and bytes sent.

MinIO is given two audit targets that both post here (e2e/lib/checks.sh),
one through a queue on disk and one from memory: each delivers every
entry on its own, and an entry is written to
FILE once, the first time its request id arrives. Each target's posts are
also kept as they came, in FILE.<path> (FILE.default, FILE.second). Three
cold runs found no entry for a GET whose bytes the driver verified, with
nothing left in MinIO's queue: the per-target files tell a delivery that
lost an entry (in one file, not the other) from a request MinIO never
recorded (in neither).

    python3 audit-receiver.py PORT FILE
"""

import http.server
import json
import sys
import threading

out = open(sys.argv[2], "ab", buffering=0)
raw = {}
seen = set()
lock = threading.Lock()


def key(line):
    """The request an entry records (None: not an entry to deduplicate)."""
    try:
        e = json.loads(line)
    except ValueError:
        return None
    if not isinstance(e, dict) or not e.get("requestID"):
        return None
    return (e.get("deploymentid"), e["requestID"])


class Handler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        n = int(self.headers.get("content-length", 0))
        body = self.rfile.read(n)
        target = self.path.strip("/") or "default"
        with lock:
            if target not in raw:
                raw[target] = open(f"{sys.argv[2]}.{target}", "ab", buffering=0)
            raw[target].write(body.strip() + b"\n")
            for line in body.splitlines():
                line = line.strip()
                if not line:
                    continue
                k = key(line)
                if k is not None and k in seen:
                    continue
                if k is not None:
                    seen.add(k)
                out.write(line + b"\n")
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


class Server(http.server.ThreadingHTTPServer):
    # MinIO posts entries at once for requests that end together: a full
    # listen backlog (5 by default) would turn some away.
    request_queue_size = 256


Server(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
