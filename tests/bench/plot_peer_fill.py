"""Plots the peer fill benchmark (tests/it/peer_fill.rs, `bench`).

    unshare -m --propagation private cargo test --release --test it -- \
        --ignored --nocapture peer_fill::bench | tee /tmp/peer-fill.txt
    python3 tests/bench/plot_peer_fill.py /tmp/peer-fill.txt docs/peer-fill.svg

Left: bytes the origin sent against the number of nodes filling one model
at once, beside the origin-only line (every node pulls it all). Right: the
last node's time against the number of nodes.
"""

import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = []
part = 0
for line in open(sys.argv[1]):
    if line.startswith("# part 2"):
        part = 2
        continue
    cols = line.strip().split("\t")
    if part == 2 and len(cols) == 4 and cols[0].isdigit():
        rows.append((int(cols[0]), float(cols[1]), int(cols[2]), int(cols[3])))
if not rows:
    sys.exit("no part 2 rows in " + sys.argv[1])
nodes = [r[0] for r in rows]
gib = 1 << 30
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
left.plot(nodes, [r[3] / gib for r in rows], "o--", color="grey", label="origin only (every node pulls)")
left.plot(nodes, [r[2] / gib for r in rows], "o-", color="tab:blue", label="peer fill")
left.set_title("Bytes the origin sent")
left.set_xlabel("nodes filling one model at once")
left.set_ylabel("GiB")
left.legend(fontsize=8)
left.grid(alpha=0.3)
right.plot(nodes, [r[1] for r in rows], "o-", color="tab:blue", label="last node done, peer fill")
right.axhline(rows[0][1], color="grey", linestyle="--", label="one node alone")
right.set_title("Time until the last node has the model")
right.set_xlabel("nodes filling one model at once")
right.set_ylabel("seconds")
right.set_ylim(bottom=0)
right.legend(fontsize=8)
right.grid(alpha=0.3)
fig.suptitle("Peer fill: one 1 GiB model, origin paced to ~50 MiB/s per node (8 node processes share 2 cores)")
fig.tight_layout()
fig.savefig(sys.argv[2])
