"""Loads every tensor of the safetensors files named on the command line the
way a serving engine's loader does (safe_open over the file's mmap, one
get_tensor per name), touches each tensor's bytes, and prints one line of
JSON: the bytes loaded and the seconds it took."""

import json
import sys
import time

from safetensors import safe_open

start = time.monotonic()
loaded = 0
checksum = 0
for path in sys.argv[1:]:
    with safe_open(path, framework="numpy") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            loaded += t.nbytes
            checksum ^= int(t[:: 4096].sum())
print(json.dumps({"bytes": loaded, "seconds": time.monotonic() - start, "checksum": checksum}))
