"""Plots the read-path benchmark (tests/it/read_paths.rs, `bench`): for each
kind of volume, the page cache a byte read costs and the loaders' speed
against the files themselves.

    BENCH_RUNS=3 unshare -m --propagation private cargo test --test it -- \
      --ignored --exact read_paths::bench --nocapture > /tmp/read-paths.log
    python3 tests/bench/plot_read_paths.py /tmp/read-paths.log docs/read-paths.svg

Reads the table of medians the bench prints.
"""

import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

JOBS = {
    "mmap, sequential": "mmap",
    "safetensors safe_open, every tensor (mmap)": "safetensors",
    "io_uring QD32, O_DIRECT 1 MiB, 8 files at once": "io_uring QD32 O_DIRECT",
}


def medians(path):
    lines = open(path).read().split("\n")
    start = next(i for i, l in enumerate(lines) if l.startswith("Medians of"))
    head = [c.strip() for c in lines[start + 2].strip("|").split("|")]
    kinds = head[1:]
    rows = {}
    for l in lines[start + 4:]:
        if not l.startswith("|"):
            break
        cells = [c.strip() for c in l.strip("|").split("|")]
        values = []
        for c in cells[1:]:
            m = re.match(r"([\d.]+)x, ([\d.]+)", c)
            values.append((float(m.group(1)), float(m.group(2))) if m else (1.0, float(c)))
        rows[cells[0]] = values
    return kinds, rows


kinds, rows = medians(sys.argv[1])
short = [k.replace(" (", "\n(").replace("the files (page cache)", "the files") for k in kinds]
fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2))
cache = [v[1] for v in rows["sequential, buffered, 1 MiB"]]
left.barh(range(len(kinds)), cache, color=["#888"] + ["#4c72b0"] * (len(kinds) - 1))
left.axvline(1.05, color="#c44", lw=1, ls="--")
left.set_yticks(range(len(kinds)), short, fontsize=8)
left.invert_yaxis()
left.set_xlabel("page cache per byte read (sequential, buffered)")
left.set_title("Memory: one copy, or two")
width = 0.8 / len(JOBS)
for j, (job, label) in enumerate(JOBS.items()):
    ratios = [v[0] for v in rows[job]]
    right.barh([k + j * width for k in range(len(kinds))], ratios, height=width, label=label)
right.axvline(1.0, color="#c44", lw=1, ls="--")
right.set_yticks([k + width for k in range(len(kinds))], short, fontsize=8)
right.invert_yaxis()
right.set_xscale("log")
right.set_xlabel("throughput against the files in the same run (log)")
right.set_title("Loaders' speed")
right.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
fig.suptitle("Reading a published model: each kind of volume against the files themselves", fontsize=11)
fig.tight_layout()
fig.savefig(sys.argv[2])
