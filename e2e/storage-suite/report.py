#!/usr/bin/env python3
"""Summarise a JUnit report of Kubernetes' External Storage suite (e2e.test).

    report.py JUNIT_XML RESULT_DIR

Writes RESULT_DIR/storage-suite.txt: what ran, passed and failed, and every
spec skipped at run time grouped by its reason, each reason marked `ours`
(a capability this driver does not advertise: the driver definition says
so, and e2e/README.md says why) or `suite` (a rule of the suite or of
Kubernetes, whatever the driver). Specs that --ginkgo.focus/skip left out
are counted, not listed. Prints one line:

    e2e-storage: ran R, passed P, failed F; skipped at run time S (ours O, suite U, unexplained X); not selected N

and exits 1 when a spec failed, a reason is unexplained (a new skip: look at
it, then classify it here) or nothing ran.
"""
import collections
import re
import sys
import xml.etree.ElementTree as ET

# (pattern on the skip message, who, why). First match wins. `why` is one
# text, or one per class (the `[class: X]` tag each driver definition puts
# in its specs' names), "*" for the rest.
DIRECTORY = ("local-source", "shared-source")
REASONS = [
    (r'does not support volume type "PreprovisionedPV"', "suite",
     "the external-driver harness provisions dynamically only: it cannot make a PV by hand for a CSI driver"),
    (r'does not support volume type "InlineVolume"', "suite",
     "in-tree inline volumes: no CSI driver has them"),
    (r'does not support volume type "CSIInlineVolume"', "ours",
     "inline volumes pull a model with the pod's nodePublishSecretRef, which the suite's "
     "driver definition cannot give; the `inline` flow covers them"),
    (r"does not provide raw block|doesn't support Block|does not support block volume mode", "ours",
     "no raw block volumes: models are files"),
    (r"does not support FsGroup", "ours",
     "fsGroupPolicy: None: kubelet must never chown a model"),
    (r"does not support topology", "ours",
     "a shared-path volume is reachable from every node: no topology"),
    (r"does not support cloning", "ours",
     "a clone is a read-only cache volume of a sealed source, not a writable copy of a "
     "live one, which is what the suite's clone specs write and expect"),
    (r"doesn't support (ext3|ext4|xfs|ntfs)", "ours",
     {**{c: "no fsType to choose: the backend is a directory" for c in DIRECTORY},
      "*": "no fsType to choose: an image is always XFS"}),
    (r"doesn't publish storage capacity", "ours",
     "the class binds Immediately: kube-scheduler never asks for its capacity, so none is "
     "published (the node-local classes claim capacity)"),
    (r"does not support multiple PVs with the same volumeHandle", "ours",
     "one PV per volume handle"),
    (r"does not define supported mount option", "ours",
     "no mount options"),
    (r"does not support volume limits", "ours",
     "no per-node volume limit"),
    (r"doesn't support RWX", "ours",
     {"xfs-shared-source": "an XFS image has one writer at a time (XFS is no cluster "
                           "filesystem): a writer lease fences every other node",
      "*": "a node-local volume is on one node's disk: no other node can mount it"}),
    (r"only supports singleNodeVolume", "ours",
     "a node-local volume is on one node's disk: every pod of it runs on that node"),
    (r"VolumeBindingMode immediate is not compatible with a multi-topology environment", "suite",
     "the suite runs Immediate-binding patterns of a topology driver only on one topology "
     "segment; the topology suite's own Immediate spec (with allowedTopologies) runs, and "
     "the `immediate` flow covers the rest"),
    (r"Multiple generic ephemeral volumes with immediate binding", "suite",
     "the suite's own rule for immediate binding"),
    (r'Suite "\w+" does not support', "suite",
     "the test suite does not apply to this volume type"),
    (r"Filesystem volume case should be covered by block volume case", "suite",
     "the suite runs mixed-mode specs from the block pattern only"),
    (r"Requires at least 2 nodes|needs at least 2 nodes", "suite",
     "the cluster has fewer nodes than the spec needs"),
]


def class_of(name):
    m = re.search(r"\[class: ([^\]]+)\]", name)
    return m.group(1) if m else "-"


def classify(message, cls):
    for pattern, who, why in REASONS:
        if re.search(pattern, message):
            if isinstance(why, dict):
                why = why.get(cls, why.get("*", ""))
            return who, why
    return "unexplained", ""


def main():
    junit, out_dir = sys.argv[1], sys.argv[2]
    root = ET.parse(junit).getroot()
    passed, failed, not_selected = [], [], 0
    skipped = collections.defaultdict(list)
    per_class = collections.defaultdict(collections.Counter)
    for tc in root.iter("testcase"):
        name = tc.get("name", "")
        cls = class_of(name)
        skip = tc.find("skipped")
        if skip is not None:
            msg = (skip.get("message") or "").strip()
            msg = re.sub(r"^skipped\s*-?\s*", "", msg)
            if not msg:
                not_selected += 1
                continue
            skipped[(cls, msg)].append(name)
        elif tc.find("failure") is not None or tc.find("error") is not None:
            failed.append(name)
            per_class[cls]["failed"] += 1
        elif name.startswith("[It]") or "External Storage" in name:
            passed.append(name)
            per_class[cls]["passed"] += 1
    counts = collections.Counter()
    lines = []
    for (cls, msg), names in sorted(skipped.items(), key=lambda kv: (kv[0][0], -len(kv[1]))):
        who, why = classify(msg, cls)
        counts[who] += len(names)
        per_class[cls]["skipped"] += len(names)
        lines.append(f"  {len(names):3d}  {cls:18s} {who:11s} {msg}" + (f"\n               why: {why}" if why else ""))
    ran = len(passed) + len(failed)
    n_skipped = sum(counts.values())
    summary = (f"e2e-storage: ran {ran}, passed {len(passed)}, failed {len(failed)}; "
               f"skipped at run time {n_skipped} (ours {counts['ours']}, suite {counts['suite']}, "
               f"unexplained {counts['unexplained']}); not selected {not_selected}")
    with open(f"{out_dir}/storage-suite.txt", "w") as f:
        f.write(summary + "\n\nby class:\n")
        for cls, c in sorted(per_class.items()):
            f.write(f"  {cls:18s} passed {c['passed']}, failed {c['failed']}, skipped {c['skipped']}\n")
        f.write("\nfailed:\n")
        f.writelines(f"  {n}\n" for n in failed)
        f.write("\npassed:\n")
        f.writelines(f"  {n}\n" for n in sorted(passed))
        f.write("\nskipped at run time, by class and reason:\n")
        f.writelines(line + "\n" for line in lines)
    print(summary)
    return 0 if ran and not failed and not counts["unexplained"] else 1


if __name__ == "__main__":
    sys.exit(main())
