"""Plots the fleet benchmark (tests/bench/fleet.rs).

    FLEET_CSV=/tmp/fleet.csv cargo bench --bench fleet
    python3 tests/bench/plot_fleet.py /tmp/fleet.csv docs/fleet-discovery.svg

Bytes the apiserver served for one node asking who holds a model every
node holds, against the number of nodes, for each layout: one Lease per
node listing its models, and a small Lease per node with a record per
model held.
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
    "Annotations": "one Lease per node listing its models (before)",
    "Records": "a record per model held, one page asked (after)",
}
fig, ax = plt.subplots(figsize=(7, 4.2))
for layout, label in labels.items():
    pts = sorted(
        (int(r["nodes"]), float(r["bytes"]), int(r["models_per_node"]))
        for r in rows
        if r["layout"] == layout
    )
    if not pts:
        continue
    ax.plot([p[0] for p in pts], [p[1] / 1024 for p in pts], marker="o", label=f"{label}, {pts[0][2]} models a node")
    for n, b, _ in pts:
        ax.annotate(f"{b / 1024:,.0f} KiB", (n, b / 1024), textcoords="offset points", xytext=(4, 6), fontsize=8)
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("nodes")
ax.set_ylabel("KiB the apiserver serves, one node asking")
ax.set_title("Who holds this model? Cost of one ask against cluster size")
ax.grid(True, which="both", alpha=0.3)
ax.legend(fontsize=8, loc="upper left")
fig.tight_layout()
fig.savefig(sys.argv[2])
print("wrote", sys.argv[2])
