"""Checks MinIO's audit log (e2e/lib/audit-receiver.py) against the objects
under a prefix: every object's bytes were sent exactly once (or TIMES times:
once per node that pulls; 0: never), whether as one GET or as ranges that
cover it. EXTRA bytes in all may be sent beyond that (a node that fills
from a peer proves its access with a one-byte read of the origin).
Prints one line per object and exits non-zero on any object whose bytes were
sent fewer times, or more beyond EXTRA, or not at all.

    python3 served-once.py [--since LINE] [--within SECONDS] [--queue DIR] \
        AUDIT_JSONL BUCKET PREFIX SIZES_FILE [TIMES] [EXTRA]

SIZES_FILE: lines "<key> <size>" for the objects that must have been served.
--since: only the log's lines after LINE (what a flow's reads added).
MinIO posts its audit entries from a queue, after the answer: the log is
read once it has been still for 2 s, and an object short of its bytes is
read again until --within (60 s) passes, since its entry may still be on
its way; bytes beyond the allowance fail at once, since later entries
only add to them. --queue: MinIO's audit queue directory; when an object
is short, what is still queued there (not yet delivered) is named, so a
late delivery is told apart from a request never made.
"""

import json
import os
import re
import sys
import time

args = sys.argv[1:]
since, within, queue = 0, 60.0, None
while args and args[0].startswith("--"):
    flag, value = args[0], args[1]
    args = args[2:]
    if flag == "--since":
        since = int(value)
    elif flag == "--within":
        within = float(value)
    elif flag == "--queue":
        queue = value
    else:
        sys.exit(f"served-once.py: unknown flag {flag}")
audit, bucket, prefix, sizes_file = args[0:4]
times = int(args[4]) if len(args) > 4 else 1
extra = int(args[5]) if len(args) > 5 else 0
sizes = {}
for line in open(sizes_file):
    key, size = line.split()
    sizes[key] = int(size)


def verdict():
    """(lines to print, any object short, any object over or wrong)."""
    ranges = {k: [] for k in sizes}
    stray = []
    with open(audit) as f:
        lines = f.readlines()[since:]
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        api = e.get("api", {})
        if api.get("name") != "GetObject" or api.get("bucket") != bucket:
            continue
        obj = api.get("object", "")
        if not obj.startswith(prefix):
            continue
        code = api.get("statusCode")
        if code not in (200, 206):
            stray.append(f"{obj}: HTTP {code}")
            continue
        tx = int(api.get("tx", 0))
        cr = e.get("responseHeader", {}).get("Content-Range", "")
        m = re.match(r"bytes (\d+)-(\d+)/(\d+)", cr)
        start, end = (int(m.group(1)), int(m.group(2)) + 1) if m else (0, tx)
        if obj not in ranges:
            stray.append(f"{obj}: not an object of the model")
            continue
        ranges[obj].append((start, end, tx))

    out, short, over = [], False, False
    spare = extra
    for key in sorted(ranges):
        rs = ranges[key]
        sent = sum(r[2] for r in rs)
        # Sweep the range boundaries: every byte must be covered exactly `times`.
        edges = sorted([(start, 1) for start, _, _ in rs] + [(end, -1) for _, end, _ in rs])
        depth, pos, covered, within_extra = 0, 0, True, True
        for at, step in edges:
            if at > pos and pos < sizes[key]:
                if depth < times:
                    covered = False
                elif depth > times:
                    # Sent more often than asked: only within the allowance.
                    spare -= (min(at, sizes[key]) - pos) * (depth - times)
                    within_extra = within_extra and spare >= 0
            depth += step
            pos = at
        if pos < sizes[key]:
            covered = False
        # TIMES 0: the object was never asked for at all.
        if times == 0:
            ok = not rs
            over = over or not ok
        else:
            fits = within_extra and sent <= times * sizes[key] + extra
            ok = covered and fits
            over = over or not fits
            short = short or not covered
        even = ok if times == 0 else covered and within_extra
        out.append(
            f"{'ok ' if ok else 'BAD'} {key}: size {sizes[key]}, {len(rs)} GET(s), "
            f"{sent} bytes sent{'' if even else f', not every byte sent {times} time(s)'}"
        )
    out += [f"note: {s}" for s in stray]
    return out, short, over


deadline = time.monotonic() + within
# Entries arrive in bursts a second or so after their requests: the log
# is read once it has been still for 2 s (an object never asked for,
# TIMES 0, is only known so), then again while an object is short.
still_since, size = time.monotonic(), -1
while time.monotonic() < deadline:
    now_size = os.path.getsize(audit)
    if now_size != size:
        still_since, size = time.monotonic(), now_size
    elif time.monotonic() - still_since >= 2:
        break
    time.sleep(0.2)
while True:
    out, short, over = verdict()
    if over or not short or time.monotonic() >= deadline:
        break
    time.sleep(0.5)
wrong = [line.split(":")[0][4:] for line in out if line.startswith("BAD")]
if wrong:
    # First, so that a summary keeping one line names what went wrong.
    print(f"{len(wrong)} of {len(sizes)} objects not served as asked: {', '.join(wrong)}")
print("\n".join(out))
if wrong and queue:
    queued, naming = 0, {w: 0 for w in wrong}
    for root, _, files in os.walk(queue):
        for name in files:
            queued += 1
            try:
                body = open(os.path.join(root, name), "rb").read()
            except OSError:
                continue
            for w in wrong:
                naming[w] += body.count(w.encode())
    print(f"MinIO's audit queue holds {queued} undelivered file(s); "
          + ", ".join(f"{w} named {n} time(s)" for w, n in naming.items()))
if wrong:
    # Each audit target's own delivery (e2e/lib/audit-receiver.py): an
    # entry in one and not the other is a delivery that lost it.
    for path in sorted(p for p in os.listdir(os.path.dirname(audit) or ".")
                       if p.startswith(os.path.basename(audit) + ".")):
        body = open(os.path.join(os.path.dirname(audit), path), "rb").read()
        print(f"{path}: " + ", ".join(f"{w} named {body.count(w.encode())} time(s)" for w in wrong))
sys.exit(1 if over or short else 0)
