#!/usr/bin/env python3
"""The verdict of the lints run inside test.sh's build.

Reads the build's `--message-format=json` output and
prints every warning or error the compiler (rustc with clippy's lints, as
RUSTC_WORKSPACE_WRAPPER) gave on the workspace's crates, then a count.
Exits 1 when there is any: `cargo clippy --all-targets -- -D warnings`'s
verdict, from the one build. A failed build's errors are printed the same
way, since its JSON output is the only place they are. Cargo replays a fresh crate's diagnostics, so
a warm build is judged the same.
"""

import json
import sys


def main(path):
    found = 0
    with open(path, encoding="utf-8") as lines:
        for line in lines:
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if msg.get("reason") != "compiler-message":
                continue
            diag = msg["message"]
            if diag["level"] in ("warning", "error"):
                found += 1
                print(diag["rendered"], end="")
    print(f"{found} warnings in the workspace's build (clippy's lints and rustc's)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
