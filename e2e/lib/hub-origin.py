#!/usr/bin/env python3
"""A Hugging Face Hub stand-in for the e2e quickstart flow: the endpoints the
driver's hf:// source calls (src/puller/hf.rs), over directories on disk.

    hub-origin.py ADDRESS PORT READY_FILE LOG_FILE TOKEN REPO@COMMIT=DIR[:gated] ...

Serves each REPO (org/name) at commit COMMIT (40 hex) with the files under
DIR; revision `main` resolves to COMMIT, any other to 404 RevisionNotFound,
an unknown repo 401 RepoNotFound, as the Hub answers:

  GET /api/models/{repo}/revision/{rev}          sha and siblings
  GET /api/models/{repo}/tree/{rev}?recursive=true
                                                 files and directories; a file
                                                 of 1 MiB or more, or a
                                                 .safetensors/.pth/.bin, is
                                                 listed as LFS with its sha256
  GET|HEAD /{repo}/resolve/{rev}/{path}          the bytes; one Range honoured

A `:gated` repo's metadata is public and its files are not, as on the Hub:
/resolve/ answers 401 with `X-Error-Code: GatedRepo` unless the request
carries `Authorization: Bearer TOKEN`. Every request is logged to LOG_FILE
as "METHOD PATH STATUS auth=yes|no" (auth: a bearer token was sent).
Writes "ready" to READY_FILE once it listens. Standard library only.
"""
import hashlib
import http.server
import json
import os
import sys
import threading
import urllib.parse

ADDRESS, PORT, READY, LOG, TOKEN = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
LFS_SUFFIXES = (".safetensors", ".pth", ".bin")
LFS_MIN = 1 << 20


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class Repo:
    def __init__(self, spec):
        name, _, rest = spec.partition("@")
        commit, _, target = rest.partition("=")
        directory, _, flag = target.partition(":")
        assert len(commit) == 40 and all(c in "0123456789abcdef" for c in commit), spec
        self.name, self.commit, self.dir, self.gated = name, commit, directory, flag == "gated"
        self.files = {}
        for root, dirs, names in os.walk(directory):
            dirs.sort()
            for n in sorted(names):
                full = os.path.join(root, n)
                rel = os.path.relpath(full, directory)
                size = os.path.getsize(full)
                lfs = size >= LFS_MIN or rel.endswith(LFS_SUFFIXES)
                self.files[rel] = (full, size, sha256_of(full) if lfs else None)

    def resolves(self, rev):
        return rev in (self.commit, "main")

    def tree(self):
        dirs = sorted({os.path.dirname(p) for p in self.files} - {""})
        entries = [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in dirs]
        for path, (_, size, sha) in sorted(self.files.items()):
            entry = {"type": "file", "oid": "0" * 40, "size": size, "path": path}
            if sha:
                entry["lfs"] = {"oid": sha, "size": size, "pointerSize": 134}
            entries.append(entry)
        return entries


REPOS = {r.name: r for r in (Repo(s) for s in sys.argv[6:])}
log_lock = threading.Lock()


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        pass

    def logged(self, status):
        auth = "yes" if self.headers.get("Authorization", "").startswith("Bearer ") else "no"
        with log_lock, open(LOG, "a") as f:
            f.write(f"{self.command} {self.path} {status} auth={auth}\n")

    def answer(self, status, body=b"", headers=None, send_body=True):
        self.logged(status)
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body and self.command != "HEAD":
            self.wfile.write(body)

    def error(self, status, code, message):
        body = json.dumps({"error": message}).encode()
        self.answer(status, body, {"Content-Type": "application/json", "X-Error-Code": code})

    def json(self, doc):
        self.answer(200, json.dumps(doc).encode(), {"Content-Type": "application/json"})

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        parts = [urllib.parse.unquote(p) for p in url.path.split("/") if p]
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            return self.api(parts[2:], url.query)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self.resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        self.error(404, "EntryNotFound", "no such endpoint")

    def repo_of(self, name):
        repo = REPOS.get(name)
        if repo is None:
            self.error(401, "RepoNotFound", f"Repository not found: {name}")
        return repo

    def api(self, parts, query):
        name, kind, rev = "/".join(parts[:2]), parts[2], "/".join(parts[3:])
        repo = self.repo_of(name)
        if repo is None:
            return
        if not repo.resolves(rev):
            return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if kind == "revision":
            return self.json({
                "id": repo.name,
                "sha": repo.commit,
                "gated": "manual" if repo.gated else False,
                "siblings": [{"rfilename": p} for p in sorted(repo.files)],
            })
        if kind == "tree" and "recursive=true" in query:
            return self.json(repo.tree())
        self.error(404, "EntryNotFound", f"no {kind} listing here")

    def resolve(self, name, rev, path):
        repo = self.repo_of(name)
        if repo is None:
            return
        if not repo.resolves(rev):
            return self.error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        if repo.gated and self.headers.get("Authorization", "") != f"Bearer {TOKEN}":
            return self.error(401, "GatedRepo", f"Access to model {name} is restricted. You must have access to it and be authenticated to access it.")
        if path not in repo.files:
            return self.error(404, "EntryNotFound", f"{path} does not exist at {rev}")
        full, size, sha = repo.files[path]
        start, end = 0, size
        status = 200
        headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                   "X-Repo-Commit": repo.commit, "ETag": f'"{sha or repo.commit}"'}
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and "," not in rng:
            first, _, last = rng[len("bytes="):].partition("-")
            try:
                start = int(first)
                end = min(int(last) + 1, size) if last else size
            except ValueError:
                start, end = 0, size
            if start >= size or start >= end:
                self.logged(416)
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        self.logged(status)
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if self.command == "HEAD":
            return
        with open(full, "rb") as f:
            f.seek(start)
            left = end - start
            while left > 0:
                block = f.read(min(left, 1 << 20))
                if not block:
                    break
                try:
                    self.wfile.write(block)
                except (BrokenPipeError, ConnectionResetError):
                    return
                left -= len(block)


server = http.server.ThreadingHTTPServer((ADDRESS, PORT), Handler)
server.daemon_threads = True
with open(READY, "w") as f:
    f.write("ready\n")
server.serve_forever()
