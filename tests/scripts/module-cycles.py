#!/usr/bin/env python3
"""Fails when src/ has a module cycle: two top-level modules that import
each other (directly or around a loop), or two sibling files of one module
that do. A parent's mod.rs and its children may refer to each other; that
is how Rust modules share their items.

Reads `crate::a::b` and `super::x` paths outside `#[cfg(test)]` modules.
Prints "module-cycles: N cycles" and each cycle with the imports that close
it; exit status 1 when N > 0.
"""
import os
import re
import sys

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src")


def modules():
    """{('a', 'b'): source} for every file module under src/."""
    out = {}
    for dirpath, _, files in os.walk(SRC):
        for f in files:
            if not f.endswith(".rs"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, f), SRC)[:-3].split(os.sep)
            if rel[-1] == "mod":
                rel = rel[:-1]
            if rel in (["lib"], ["main"]):
                continue
            text = open(os.path.join(dirpath, f), encoding="utf-8").read()
            # Unit tests may reach anywhere.
            text = re.split(r"#\[cfg\(test\)\]\s*mod \w+", text)[0]
            out[tuple(rel)] = text
    return out


def references(mod, text, known):
    """The modules `mod` names, as the longest known module path."""
    refs = set()
    for m in re.finditer(r"\b(crate|super)((?:::[a-z_][a-z0-9_]*)+)", text):
        parts = m.group(2).split("::")[1:]
        if m.group(1) == "crate":
            base = []
        else:
            # super of a file module: its parent; of a mod.rs: its parent too.
            base = list(mod[:-1])
        path = base + parts
        while path and tuple(path) not in known:
            path.pop()
        if path:
            refs.add(tuple(path))
    return refs


def cycles(graph):
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def main():
    mods = modules()
    known = set(mods)
    refs = {m: references(m, t, known) for m, t in mods.items()}
    found = []
    # Top-level modules.
    top = {}
    for m, rs in refs.items():
        for r in rs:
            if r[0] != m[0]:
                top.setdefault(m[0], set()).add(r[0])
    for c in cycles(top):
        found.append(("top-level", c, {a: sorted(b for b in top[a] if b in c) for a in c}))
    # Siblings: files of one module (its mod.rs excluded).
    parents = {m[:-1] for m in mods if len(m) > 1}
    for p in sorted(parents):
        sib = {}
        for m, rs in refs.items():
            if len(m) == len(p) + 1 and m[:-1] == p:
                for r in rs:
                    if len(r) >= len(m) and r[: len(m) - 1] == p and r[: len(m)] != m:
                        sib.setdefault(m, set()).add(r[: len(m)])
        for c in cycles(sib):
            names = ["::".join(x) for x in c]
            found.append(("in " + "::".join(p), names,
                          {"::".join(a): sorted("::".join(b) for b in sib[a] if b in c) for a in c}))
    print(f"module-cycles: {len(found)} cycles")
    for kind, c, edges in found:
        print(f"  {kind}: {' <-> '.join(c)}")
        for a, bs in edges.items():
            print(f"    {a} uses {', '.join(bs)}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
