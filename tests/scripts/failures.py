#!/usr/bin/env python3
"""Names each failed check of a test.sh run, with its first error line and
the log it is in, so that a failing run says why in one screen.

    failures.py TARGET_DIR

Reads the logs test.sh leaves in TARGET_DIR: cargo-test.log (`test X ...
FAILED`, then the first `panicked at` of X's `---- X stdout ----` section,
or a test binary that died or did not build), csi-sanity.log (a failed
run's ginkgo `[FAIL]` lines, with the first `[FAILED]` message of its own
log), fuzz.log (`fuzz T: FAILED`), e2e.log and e2e-deployed.log (a
check's `FAIL` line from e2e/lib/checks.sh and the first line of what it
printed; the storage suite's failed specs from its report), and
helm-chart.log (`FAIL` lines). Prints nothing when it finds no failure.
Never fails: a log it cannot read is skipped; it exits 0 whatever it finds.
"""
import os
import re
import sys

WIDTH = 230  # one line per failure, cut to fit a wide terminal
MOST = 40  # entries listed; the rest are counted


def read_lines(path):
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()
    except OSError:
        return None


def clean(line):
    return re.sub(r"\s+", " ", line).strip()


def cargo(path):
    """`test X ... FAILED` and X's first panic; dead or unbuilt binaries."""
    lines = read_lines(path)
    if lines is None:
        return []
    out, failed, why, binary = [], [], {}, None
    crashed = []
    section = None
    for i, line in enumerate(lines):
        m = re.match(r"\s+Running (?:unittests )?(\S+)", line)
        if m:
            binary = m.group(1)
            continue
        m = re.match(r"test (\S+)(?: - .*)? \.\.\. FAILED$", line)
        if m:
            failed.append((m.group(1), binary))
            continue
        m = re.match(r"---- (\S+) stdout ----$", line)
        if m:
            section = m.group(1)
            continue
        if line.startswith("failures:") or line.startswith("test result:"):
            section = None
            continue
        if section and section not in why:
            m = re.search(r"panicked at (\S+?:\d+:\d+):?\s*(.*)", line)
            if m:
                where, rest = m.group(1), m.group(2).strip()
                # Since Rust 1.73 the message is on the next line; an
                # assert_eq! names both sides on the two after it.
                after = [clean(n) for n in lines[i + 1:i + 4]]
                if not rest:
                    rest, after = (after[0], after[1:]) if after else ("", [])
                if rest.startswith("assertion `left") and len(after) >= 2:
                    rest += f" ({after[0]}, {after[1]})"
                why[section] = f"panicked at {where}: {rest}"
        if re.search(r"process didn't exit successfully: .*\((signal|exit status)", line):
            crashed.append(clean(line))
    for name, binary_ in failed:
        label = f"cargo test {name}" + (f" ({binary_})" if binary_ else "")
        out.append((label, why.get(name, "(no panic line in its output)")))
    # A binary killed by a signal says no FAILED for the test it was in;
    # one that exited non-zero with no FAILED line died some other way.
    for c in crashed:
        if "(signal" in c or not failed:
            out.append(("cargo test: a test binary died", c))
    if not out:
        # A build that failed before any test ran.
        err = next((clean(l) for l in lines if re.match(r"error(\[E\d+\])?: ", l)
                    and not l.startswith("error: test failed")), None)
        if err:
            out.append(("cargo: the build failed", err))
    return [(what, first, path) for what, first in out]


def sanity(path):
    """Each failed csi-sanity run: its ginkgo [FAIL] lines and first message."""
    lines = read_lines(path)
    if lines is None:
        return []
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"csi-sanity (\S+) FAILED; see (\S+)", line)
        if not m:
            continue
        name, run_log = m.group(1), m.group(2)
        own = read_lines(run_log) or lines[i + 1:]
        message = None
        for j, l in enumerate(own):
            if re.match(r"\s*\[FAILED\] (?!\[)", l):
                # Gomega's message goes on over the lines indented below it.
                more = []
                for n in own[j + 1:j + 6]:
                    if not n.strip() or n.strip().startswith("In ["):
                        break
                    more.append(clean(n))
                message = " ".join([clean(l)] + more)
                break
        fails = [clean(l) for l in own if re.match(r"\s*\[FAIL\] ", l)]
        where = run_log if os.path.exists(run_log) else path
        if not fails:
            # Not a spec: a leaked loop device, a driver that did not start.
            tail = next((clean(l) for l in lines[i + 1:] if clean(l)), "")
            out.append((f"csi-sanity {name}", message or tail, where))
        for f in fails:
            out.append((f"csi-sanity {name}: {f}", message or "", where))
    return out


def fuzz(path):
    lines = read_lines(path)
    if lines is None:
        return []
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"fuzz (\S+): FAILED(.*)", line)
        if m:
            detail = next((clean(l) for l in lines[i + 1:i + 9] if l.startswith("    ")), clean(m.group(2)))
            log = re.search(r"log (\S+)", line)
            out.append((f"fuzz {m.group(1)}", detail, log.group(1) if log else path))
        elif line.startswith("fuzz: the targets did not build"):
            out.append(("fuzz: the targets did not build", "see fuzz/build.log beside it", path))
    return out


def storage_suite(report):
    """The failed specs a storage-suite.txt lists, with junit's message."""
    lines = read_lines(report)
    if lines is None:
        return []
    names, inside = [], False
    for line in lines:
        if line == "failed:":
            inside = True
        elif inside and line.startswith("  "):
            names.append(line.strip())
        elif inside:
            break
    messages = {}
    junit = os.path.join(os.path.dirname(report), "junit.xml")
    try:
        import xml.etree.ElementTree as ET
        for tc in ET.parse(junit).getroot().iter("testcase"):
            f = tc.find("failure")
            if f is None:
                f = tc.find("error")
            if f is not None:
                text = (f.get("message") or f.text or "").strip()
                messages[tc.get("name", "")] = clean(text.splitlines()[0]) if text else ""
    except Exception:
        pass
    return [(f"e2e-storage: {n}", messages.get(n, ""), junit if messages else report) for n in names]


def e2e(path):
    """e2e/lib/checks.sh: `FAIL  FLOW  WHAT`, then what the check printed,
    indented 8; and a cluster that did not come up."""
    lines = read_lines(path)
    if lines is None:
        return []
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"FAIL  (\S+)\s+(.*)", line)
        if m:
            flow, what = m.group(1), m.group(2).strip()
            printed = []
            for l in lines[i + 1:i + 41]:
                if not l.startswith("        "):
                    break
                if clean(l):
                    printed.append(clean(l))
            # A timeout names what it waited for; otherwise the first line.
            first = next((p for p in printed if "timed out" in p), printed[0] if printed else "")
            out.append((f"{os.path.basename(path)[:-4]} {flow}: {what}", first, path))
            report = re.search(r"\((\S+/storage-suite\.txt)\)", what)
            if report:
                out.extend(storage_suite(report.group(1)))
        m = re.match(r"(e2e|e2e-deployed): 0 passed, 1 failed \((.*)\)", line)
        if m:
            out.append((f"{m.group(1)}: the cluster", m.group(2), path))
    return out


def helm(path):
    lines = read_lines(path)
    if lines is None:
        return []
    return [("helm-chart", clean(l[5:]), path) for l in lines if l.startswith("FAIL ")]


def clippy(path):
    """clippy.log when clippy.rc beside it says it failed: its first error."""
    rc = read_lines(os.path.join(os.path.dirname(path), "clippy.rc"))
    if not rc or rc[0].strip() == "0":
        return []
    lines = read_lines(path) or []
    first = next((clean(l) for l in lines if l.startswith(("error", "warning"))), "clippy failed")
    return [("cargo clippy", first, path)]


def main():
    target = sys.argv[1] if len(sys.argv) > 1 else "target"
    at = lambda name: os.path.join(target, name)
    found = []
    for parse, log in [(clippy, "clippy.log"), (cargo, "cargo-test.log"), (sanity, "csi-sanity.log"), (fuzz, "fuzz.log"),
                       (e2e, "e2e.log"), (e2e, "e2e-deployed.log"), (helm, "helm-chart.log")]:
        try:
            found.extend(parse(at(log)))
        except Exception as e:  # never the reason a run fails
            found.append((f"(could not read {log})", repr(e), at(log)))
    if not found:
        return
    print(f"failed checks ({len(found)}): what, its first error line, the log it is in")
    for what, first, log in found[:MOST]:
        line = f"  {what}: {first}" if first else f"  {what}"
        tail = f"  [{log}]"
        if len(line) + len(tail) > WIDTH:
            line = line[:WIDTH - len(tail) - 1] + "…"
        print(line + tail)
    if len(found) > MOST:
        print(f"  ... and {len(found) - MOST} more")


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:
        pass
    except Exception as e:
        print(f"failures.py: {e!r}", file=sys.stderr)
    sys.exit(0)
