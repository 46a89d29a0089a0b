"""Plots the time-to-Ready benchmark (e2e/lib/bench-ready.sh).

    python plot-ready.py BENCH_READY_TSV OUT.svg|OUT.png

One row per model: time from `kubectl apply` to every replica Ready against
the number of replicas, per method; and the bytes the origin sent and the
node's disk took, in multiples of the model's size.
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {
    "copy": "copy-per-pod (init container, s5cmd)",
    "uri": "modelcache-csi, model URI PVC (usable once sealed)",
    "clone": "modelcache-csi, sealed source cloned per replica",
    "progressive": "modelcache-csi, model URI PVC, progressive",
}
STYLE = {"copy": "o-", "uri": "s-", "clone": "^-", "progressive": "D-"}

tsv, out = sys.argv[1:3]
rows = list(csv.DictReader(open(tsv), delimiter="\t"))
models = list(dict.fromkeys(r["model"] for r in rows))
fig, axes = plt.subplots(len(models), 2, figsize=(11, 3.6 * len(models)), squeeze=False)
for row, model in zip(axes, models):
    series = defaultdict(list)
    size = 1
    for r in rows:
        if r["model"] == model:
            size = int(r["model_bytes"])
            series[r["method"]].append(
                (int(r["replicas"]), float(r["seconds"]), int(r["origin_bytes"]), int(r["disk_bytes"]))
            )
    gib = size / 2**30
    name = f"{model} ({gib:.2f} GiB)" if gib >= 1 else f"{model} ({size / 2**20:.0f} MiB)"
    t, b = row
    for method, pts in series.items():
        pts.sort()
        n = [p[0] for p in pts]
        t.plot(n, [p[1] for p in pts], STYLE.get(method, "x-"), label=LABELS.get(method, method))
        b.plot(n, [p[2] / size for p in pts], STYLE.get(method, "x-"), label=f"origin, {method}")
        b.plot(n, [p[3] / size for p in pts], STYLE.get(method, "x-")[0] + ":", label=f"disk, {method}")
    t.set_title(f"{name}: time to all replicas Ready")
    t.set_xlabel("replicas on one node")
    t.set_ylabel("seconds")
    t.set_ylim(bottom=0)
    t.grid(alpha=0.3)
    t.legend(fontsize=8)
    b.set_title(f"{name}: bytes, in model sizes")
    b.set_xlabel("replicas on one node")
    b.set_ylabel("x model size")
    b.set_ylim(bottom=0)
    b.grid(alpha=0.3)
    b.legend(fontsize=7, ncol=2)
fig.suptitle("2 cores shared by MinIO, the driver, kubelet and the pods", fontsize=9)
fig.tight_layout()
fig.savefig(out)
