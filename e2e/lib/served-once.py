"""Checks MinIO's audit log (e2e/lib/audit-receiver.py) against the objects
under a prefix: every object's bytes were sent exactly once (or TIMES times:
once per node that pulls; 0: never), whether as one GET or as ranges that
cover it. EXTRA bytes in all may be sent beyond that (a node that fills
from a peer proves its access with a one-byte read of the origin).
Prints one line per object and exits non-zero on any object whose bytes were
sent fewer times, or more beyond EXTRA, or not at all.

    python3 served-once.py AUDIT_JSONL BUCKET PREFIX SIZES_FILE [TIMES] [EXTRA]

SIZES_FILE: lines "<key> <size>" for the objects that must have been served.
"""

import json
import re
import sys

audit, bucket, prefix, sizes_file = sys.argv[1:5]
times = int(sys.argv[5]) if len(sys.argv) > 5 else 1
extra = int(sys.argv[6]) if len(sys.argv) > 6 else 0
sizes = {}
for line in open(sizes_file):
    key, size = line.split()
    sizes[key] = int(size)

ranges = {k: [] for k in sizes}
stray = []
for line in open(audit):
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

bad = 0
spare = extra
for key in sorted(ranges):
    rs = ranges[key]
    sent = sum(r[2] for r in rs)
    # Sweep the range boundaries: every byte must be covered exactly `times`.
    edges = sorted([(start, 1) for start, _, _ in rs] + [(end, -1) for _, end, _ in rs])
    depth, pos, even = 0, 0, True
    for at, step in edges:
        if at > pos and pos < sizes[key]:
            if depth < times:
                even = False
            elif depth > times:
                # Sent more often than asked: only within the allowance.
                over = (min(at, sizes[key]) - pos) * (depth - times)
                spare -= over
                even = even and spare >= 0
        depth += step
        pos = at
    if pos < sizes[key]:
        even = False
    # TIMES 0: the object was never asked for at all.
    ok = not rs if times == 0 else even and sent <= times * sizes[key] + extra
    bad += not ok
    print(
        f"{'ok ' if ok else 'BAD'} {key}: size {sizes[key]}, {len(rs)} GET(s), "
        f"{sent} bytes sent{'' if even else f', not every byte sent {times} time(s)'}"
    )
for s in stray:
    print(f"note: {s}")
sys.exit(1 if bad else 0)
