"""Plots the capped-links rollout (tests/it/fanout_links.rs, `bench`) for
two trees side by side.

    FANOUT_NODES=8 FANOUT_MBPS=25 FANOUT_MIB=256 FANOUT_CSV=/tmp/before.csv \
      unshare -m --propagation private <before's it binary> --ignored --exact fanout_links::bench
    (the same with this tree's binary and FANOUT_CSV=/tmp/after.csv)
    python3 tests/bench/plot_fanout_links.py /tmp/before.csv /tmp/after.csv docs/fanout-links.svg \
      [before's label] [after's label] [model, as the title says it]

Per node count: the copies of the model the origin sent, and the most
any node uploaded, averaged over the runs of each tree.
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    by = defaultdict(list)
    for r in csv.DictReader(open(path)):
        by[int(r["nodes"])].append((float(r["origin_copies"]), float(r["max_upload_copies"])))
    return {n: tuple(sum(v[i] for v in vs) / len(vs) for i in range(2)) for n, vs in by.items()}


before, after = load(sys.argv[1]), load(sys.argv[2])
labels = (sys.argv[4:6] + ["before", "relays"][len(sys.argv[4:6]):])[:2]
model = sys.argv[6] if len(sys.argv) > 6 else "256 MiB"
nodes = sorted(set(before) & set(after))
if not nodes:
    sys.exit("no node count measured in both files")
fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
width = 0.38
for ax, i, title in [
    (axes[0], 0, "copies the origin sent"),
    (axes[1], 1, "busiest node's upload (copies)"),
]:
    xs = range(len(nodes))
    ax.bar([x - width / 2 for x in xs], [before[n][i] for n in nodes], width, label=labels[0])
    ax.bar([x + width / 2 for x in xs], [after[n][i] for n in nodes], width, label=labels[1])
    ax.set_xticks(list(xs), [f"{n} nodes" for n in nodes])
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
axes[0].axhline(1.0, color="grey", linestyle=":", linewidth=1)
axes[0].legend()
fig.suptitle(f"One model rolled out over 25 MB/s links (tc-capped veths, {model})")
fig.tight_layout()
fig.savefig(sys.argv[3])
