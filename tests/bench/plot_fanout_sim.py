"""Plots the rollout model (tests/bench/fanout_sim.py).

    python3 tests/bench/fanout_sim.py --sweep > /tmp/sim.csv
    python3 tests/bench/plot_fanout_sim.py /tmp/sim.csv docs/fanout-sim.svg

Left: the last node's time over one node's alone at its NIC rate, against
the number of nodes, for each way of choosing the page of holders. Right:
copies of the model the origin sent, and the most any node uploaded.
"""

import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

rows = list(csv.DictReader(open(sys.argv[1])))
if not rows:
    sys.exit("no rows in " + sys.argv[1])
labels = {
    "shard": "the asker's shard's first page by name (before)",
    "drawn": "a random bucket, narrowed (as built)",
    "random": "a random page (not built)",
}
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
for pages, label in labels.items():
    pts = sorted((int(r["nodes"]), r) for r in rows if r["pages"] == pages)
    if not pts:
        continue
    xs = [n for n, _ in pts]
    left.plot(xs, [float(r["last_over_alone"]) for _, r in pts], marker="o", label=label)
    for n, r in pts:
        left.annotate(f'{float(r["last_s"]):,.0f} s', (n, float(r["last_over_alone"])), textcoords="offset points", xytext=(4, 6), fontsize=8)
    right.plot(xs, [float(r["origin_copies"]) for _, r in pts], marker="o", label=f"origin, {label}")
    right.plot(xs, [float(r["max_upload_copies"]) for _, r in pts], marker="s", linestyle="--", label=f"busiest node, {label}")
nic = rows[0]["nic_mbps"]
left.set_xscale("log")
left.set_yscale("log")
left.set_xlabel("nodes starting the model within 1 s")
left.set_ylabel("last node's time / one node alone")
gib = rows[0]["model_gib"]
left.set_title(f"rollout of {gib} GiB (model; {nic} MB/s a node and origin)", fontsize=10)
left.axhline(1.5, color="grey", linestyle=":", linewidth=1)
left.legend(fontsize=8)
right.set_xscale("log")
right.set_yscale("log")
right.set_xlabel("nodes")
right.set_ylabel("copies of the model")
right.set_title("origin bytes and the busiest uploader", fontsize=10)
right.axhline(3, color="grey", linestyle=":", linewidth=1)
right.legend(fontsize=8)
fig.tight_layout()
fig.savefig(sys.argv[2])
