"""Plots the node-at-scale benchmark (tests/bench/node_scale.rs).

    BENCH_CSV=/tmp/ns.csv cargo bench --bench node_scale
    python3 tests/bench/plot_node_scale.py /tmp/ns.csv docs/node-scale.svg [BEFORE.csv]

Left: a burst of N concurrent NodePublish calls, all done, against N, with
the same burst of Probe calls (the floor). Right: NodePublish p50 one at a
time against the node's mount table, with the kernel's own bind mount.
BEFORE.csv, if given, is the same benchmark of an older driver, drawn dashed.
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(path):
    series = defaultdict(list)
    for row in csv.reader(open(path)):
        series[row[0]].append([float(v) for v in row[1:]])
    return series


def finish(ax, title, xlabel):
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("ms (log scale)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)


now = load(sys.argv[1])
out = sys.argv[2]
before = load(sys.argv[3]) if len(sys.argv) > 3 else None

fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))

conc = sorted(now["concurrency"])
n = [r[0] for r in conc]
left.plot(n, [r[2] for r in conc], "s-", label="NodePublish burst, all done")
left.plot(n, [r[4] for r in conc], "s:", label="NodePublish, p99 per call")
left.plot(n, [r[1] for r in conc], "o-", color="grey", label="Probe burst (the floor)")
if before and before.get("concurrency"):
    b = sorted(before["concurrency"])
    left.plot([r[0] for r in b], [r[2] for r in b], "s--", color="tab:red", label="NodePublish burst, before")
finish(left, "Concurrent calls on one node", "concurrent calls")

mounts = sorted(now["mounts"])
m = [r[0] for r in mounts]
right.plot(m, [r[2] for r in mounts], "s-", label="NodePublish p50")
right.plot(m, [r[3] for r in mounts], "o-", color="grey", label="kernel: bind + remount ro + unmount")
if before and before.get("mounts"):
    b = sorted(before["mounts"])
    right.plot([r[0] for r in b], [r[2] for r in b], "s--", color="tab:red", label="NodePublish p50, before")
finish(right, "One publish against the mount table", "extra mounts on the node")

fig.tight_layout()
fig.savefig(out)
