#!/usr/bin/env python3
"""A model origin with a known bandwidth, for the e2e `large` flow.

    throttled-origin.py PORT TOTAL_MIB RATE_MIB_PER_S READY_FILE [ADDRESS]

Serves a synthetic model of TOTAL_MIB (two shards and a config) generated
on the fly from a repeating pattern, so nothing of it is on disk, and
`/manifest.json` listing every file with its size and sha256 (the driver
verifies them). HEAD, Range (one range) and a strong ETag are supported.
All responses together are paced to RATE_MIB_PER_S, like one origin link.
ORIGIN_SALT and ORIGIN_CORRUPT (below) vary the bytes; ORIGIN_HOLD holds
each shard's last piece back until a file exists.
ORIGIN_TOKEN, when set, is a bearer token every request of the model
(listing and files) must carry, else 401: a class's provisioner secret.
`/served` answers how many bytes of the model's files were sent so far, so
a test can tell one download from a restarted one.
Writes "ready <seconds spent hashing>" to READY_FILE once it listens.
Listens on ADDRESS (default 127.0.0.1 only).
"""
import hashlib
import http.server
import json
import os
import sys
import threading
import time

PORT, TOTAL_MIB, RATE, READY = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
ADDRESS = sys.argv[5] if len(sys.argv) > 5 else "127.0.0.1"
MIB = 1 << 20
PIECE = 256 << 10


# Another salt, other bytes: a run that must pull (not find the model of
# an earlier run in the cache) sets ORIGIN_SALT.
SALT = os.environ.get("ORIGIN_SALT", "")
# ORIGIN_CORRUPT=PATH:N: the first N responses that cover byte 0 of PATH
# flip that byte (an origin or a link that serves wrong bytes for a while).
CORRUPT_PATH, _, CORRUPT_N = os.environ.get("ORIGIN_CORRUPT", "").partition(":")
corrupt_left = [int(CORRUPT_N or 0)]
# ORIGIN_HOLD=FILE: the last piece of each shard waits until FILE exists, so
# no pull can finish (and seal) before the test says so: a volume staged in
# the meantime is certainly staged while its model arrives.
HOLD = os.environ.get("ORIGIN_HOLD", "")
TOKEN = os.environ.get("ORIGIN_TOKEN", "")


def hold(f, end):
    if HOLD and isinstance(f, Synthetic) and end == f.size:
        while not os.path.exists(HOLD):
            time.sleep(0.2)
corrupt_lock = threading.Lock()


def corrupts(path, start):
    with corrupt_lock:
        if path != CORRUPT_PATH or start != 0 or corrupt_left[0] <= 0:
            return False
        corrupt_left[0] -= 1
        return True


def block(seed):
    h = hashlib.sha256((SALT + seed).encode()).digest()
    return (h * (MIB // len(h)))[:MIB]


class Synthetic:
    """size bytes: a 1 MiB block repeated, then cut."""

    def __init__(self, name, size):
        self.name, self.size, self.block = name, size, block(name)

    def read(self, start, end):
        """Bytes [start, end) in pieces."""
        at = start
        while at < end:
            off = at % MIB
            n = min(MIB - off, end - at, PIECE)
            yield self.block[off:off + n]
            at += n

    def sha256(self):
        h = hashlib.sha256()
        full, rest = divmod(self.size, MIB)
        for _ in range(full):
            h.update(self.block)
        h.update(self.block[:rest])
        return h.hexdigest()


class Fixed:
    """A small file of given bytes, served like the shards (ranges too:
    one file without them would cost the whole model its resumable,
    parallel ranges)."""

    def __init__(self, name, data):
        self.name, self.size, self.data = name, len(data), data

    def read(self, start, end):
        yield self.data[start:end]

    def sha256(self):
        return hashlib.sha256(self.data).hexdigest()


first = TOTAL_MIB * 3 // 4
files = {
    "model-00001-of-00002.safetensors": Synthetic("s1", first * MIB),
    "model-00002-of-00002.safetensors": Synthetic("s2", (TOTAL_MIB - first) * MIB + 12345),
    "config.json": Fixed("config", b'{"architectures":["E2E"]}\n\n'),
}
t0 = time.time()
manifest = {"files": [{"path": n, "size": f.size, "sha256": f.sha256()} for n, f in files.items()]}
docs = {"/manifest.json": json.dumps(manifest).encode()}
hashing = time.time() - t0


class Pace:
    """A token bucket shared by every connection: the origin's link."""

    def __init__(self, rate):
        self.rate, self.lock, self.next = rate, threading.Lock(), time.monotonic()

    def take(self, n):
        with self.lock:
            now = time.monotonic()
            start = max(self.next, now)
            self.next = start + n / self.rate
            wait = start - now
        if wait > 0:
            time.sleep(wait)


pace = Pace(RATE * MIB)


class Served:
    """Bytes of the model's files written to clients."""

    def __init__(self):
        self.lock, self.bytes = threading.Lock(), 0

    def add(self, n):
        with self.lock:
            self.bytes += n


served = Served()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s\n" % (self.requestline, self.headers.get("Range", "")))

    def head_or_get(self, body):
        path = self.path.split("?")[0]
        if path == "/served":
            data = str(served.bytes).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if body:
                self.wfile.write(data)
            return
        if TOKEN and self.headers.get("Authorization") != "Bearer " + TOKEN:
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if path in docs:
            data = docs[path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("ETag", '"%s"' % hashlib.sha256(data).hexdigest()[:16])
            self.end_headers()
            if body:
                self.wfile.write(data)
            return
        f = files.get(path.lstrip("/"))
        if f is None:
            self.send_error(404)
            return
        start, end = 0, f.size
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start = int(a) if a else max(0, f.size - int(b))
            end = min(f.size, int(b) + 1) if (a and b) else f.size
            self.send_response(206)
            self.send_header("Content-Range", "bytes %d-%d/%d" % (start, end - 1, f.size))
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", '"%s"' % f.name)
        self.end_headers()
        if not body:
            return
        flip = corrupts(path.lstrip("/"), start)
        at = start
        for piece in f.read(start, end):
            at += len(piece)
            if at == end:
                hold(f, end)
            if flip:
                piece, flip = bytes([piece[0] ^ 0xFF]) + piece[1:], False
            pace.take(len(piece))
            self.wfile.write(piece)
            served.add(len(piece))

    def do_HEAD(self):
        self.head_or_get(False)

    def do_GET(self):
        try:
            self.head_or_get(True)
        except (BrokenPipeError, ConnectionResetError):
            pass


server = http.server.ThreadingHTTPServer((ADDRESS, PORT), Handler)
server.daemon_threads = True
with open(READY, "w") as r:
    r.write("ready %.1f\n" % hashing)
server.serve_forever()
