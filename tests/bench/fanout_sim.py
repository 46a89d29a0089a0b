"""A discrete-event model of one model rolled out to a fleet by peer fill.

    python3 tests/bench/fanout_sim.py --nodes 1000 --model-gib 3
    python3 tests/bench/fanout_sim.py --sweep > /tmp/sim.csv
    python3 tests/bench/plot_fanout_sim.py /tmp/sim.csv docs/fanout-sim.svg

Fleets this machine cannot hold (issue #46, item 4). The model follows
the driver's rules, not an idealised swarm:

- the first node to start claims the pull and reads the origin; every
  other node, at its start, reads one page of 16 holder records
  (`HOLDERS_ASKED`): a random bucket's, narrowed while it holds more
  than a page, as the driver asks (`--pages drawn`), its shard's first
  in name order, as the driver asked before (`--pages shard`), or any 16
  nodes (`--pages random`); of those it uses the leader and the nodes that
  started before it;
- a node fetches `--in-flight` chunks at once (`CHUNKS_IN_FLIGHT`), in
  order; for each it asks, in the driver's order (`PeerSource::order`):
  sealed peers rotated by chunk, then one follower (chunk index modulo
  their number), then the leader, then the other followers;
- a peer serves at most `--slots` uploads at once (`--peer-max-uploads`)
  within its uplink; a peer that lacks the chunk but is pulling it holds
  the request until it arrives (`WAIT_FOR_CHUNK`); one whose slots are
  full is busy, and the asker waits for a slot of the first busy holder;
- a chunk nobody served for `--patience` seconds while the pull got
  nothing from peers comes from the origin (`BUSY_PATIENCE`);
- with `--wave W`, W nodes start first and the rest once those sealed
  (a `ModelPrefetch` over a few nodes, then widened).

Rates are fixed when a transfer starts: the sender's uplink divided by
its uploads then, the receiver's downlink by its downloads then, the
origin's rate by its readers then. That is coarser than TCP's sharing
(a transfer does not speed up when others end), so it errs slow. CPU is
not modelled: a GPU node hashes and decrypts far faster than its NIC
(this machine: sha256 1.19 GB/s and AES-128-GCM 2.7 GB/s per core).
Inputs not yet measured on real NICs (issue #46 item 3): the defaults
are a 100 MB/s cap per node and at the origin, as that item asks.
"""

import argparse
import heapq
import random
import sys

ORIGIN = -1


class Fleet:
    def __init__(self, a):
        self.a = a
        self.rng = random.Random(a.seed)
        self.n = a.nodes
        self.chunk = a.chunk_mib * (1 << 20)
        self.chunks = max(1, int(a.model_gib * (1 << 30) // self.chunk))
        self.start = sorted(self.rng.uniform(0, a.spread) for _ in range(self.n))
        self.have = [bytearray(self.chunks) for _ in range(self.n)]
        self.count = [0] * self.n
        self.next_idx = [0] * self.n
        self.up = [0] * self.n
        self.down = [0] * self.n
        self.origin_readers = 0
        self.uploaded = [0] * self.n
        self.origin_bytes = 0
        self.peers = [[] for _ in range(self.n)]
        self.done_at = [None] * self.n
        self.last_from_peer = [0.0] * self.n
        # (peer, chunk) -> askers waiting for the peer to get it
        self.waiting = {}
        # peer -> askers (node, chunk) waiting for one of its slots
        self.busy = {}
        # (asker, chunk) -> the queue it waits in
        self.pending = {}
        self.events = []
        self.seq = 0
        self.shard = [self.rng.randrange(16) for _ in range(self.n)]
        # A node's finest bucket (three hex digits of its key), for
        # `--pages drawn`; from a generator of its own, so that the other
        # modes draw as they did.
        keys = random.Random(a.seed + 1)
        self.key = [keys.randrange(4096) for _ in range(self.n)]
        self.name = list(range(self.n))
        self.rng.shuffle(self.name)

    def page(self, i):
        """The other nodes ahead of node i that its one page of holders
        names (the leader comes on its own)."""
        a = self.a
        if a.pages == "random":
            before = list(range(1, i))
            self.rng.shuffle(before)
            return before[: a.page - 1]
        started = [j for j in range(1, self.n) if self.start[j] <= self.start[i] and j != i]
        by_name = lambda js: sorted(js, key=lambda j: self.name[j])[: a.page]
        if a.pages == "drawn":
            # As the driver asks now (`Directory::ask`): a random bucket of
            # 16, and while it holds more than a page, a random bucket of
            # 16 within it, three levels deep; a bucket with fewer than
            # `--enough` holders is filled up from the page above it.
            b = self.rng.randrange(4096)
            above = []
            for level in range(3):
                shift = 8 - 4 * level
                bucket = [j for j in started if self.key[j] >> shift == b >> shift]
                here = by_name(bucket)
                if len(here) < a.enough:
                    if level == 0:
                        above = by_name(started)
                    first = here + [j for j in above if j not in here][: a.page - len(here)]
                    break
                if len(bucket) <= a.page or level == 2:
                    first = here
                    break
                above = here
            return [j for j in first if j < i]
        # As the driver asked before: the first page, in name order, of the
        # records in this node's shard (all shards' when it has fewer
        # than 4); every node started by now has one, and
        # only those that started before this one are read.
        mine = [j for j in started if self.shard[j] == self.shard[i]]
        pool = mine if len(mine) >= 4 else started
        return [j for j in by_name(pool) if j < i]

    def push(self, t, *ev):
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq) + ev)

    def sealed(self, j):
        return self.count[j] == self.chunks

    def order(self, i, idx):
        ps = self.peers[i]
        sealed = [p for p in ps if self.sealed(p)]
        leader = [p for p in ps if p == 0 and not self.sealed(p)]
        followers = [p for p in ps if p != 0 and not self.sealed(p)]
        out = [sealed[(idx + k) % len(sealed)] for k in range(len(sealed))]
        if followers:
            first = idx % len(followers)
            out.append(followers[first])
            out += leader
            out += [f for k, f in enumerate(followers) if k != first]
        else:
            out += leader
        return out

    def begin(self, t, src, i, idx):
        a = self.a
        self.down[i] += 1
        if src == ORIGIN:
            self.origin_readers += 1
            rate = min(a.origin_mbps * 1e6 / self.origin_readers, a.nic_mbps * 1e6 / self.down[i])
        else:
            self.up[src] += 1
            rate = min(a.nic_mbps * 1e6 / self.up[src], a.nic_mbps * 1e6 / self.down[i])
        self.push(t + self.chunk / rate, "done", src, i, idx)

    def ask(self, t, i, idx):
        """Node i wants chunk idx: a peer now, a peer's promise, or the origin."""
        if i == 0:
            self.begin(t, ORIGIN, i, idx)
            return
        first_busy = None
        for p in self.order(i, idx):
            if not self.have[p][idx]:
                # A pulling peer holds the request until the chunk arrives
                # (`WAIT_FOR_CHUNK`), then serves it.
                q = self.waiting.setdefault((p, idx), [])
                q.append((i, idx))
                break
            if self.up[p] < self.a.slots:
                self.begin(t, p, i, idx)
                return
            if first_busy is None:
                first_busy = p
        else:
            q = self.busy.setdefault(first_busy, [])
            q.append((i, idx))
        self.pending[(i, idx)] = q
        self.push(max(t, self.last_from_peer[i]) + self.a.patience, "patience", i, idx)

    def run(self):
        first = self.a.wave or self.n
        for i, t in enumerate(self.start[:first]):
            self.push(t, "start", i)
        while self.events:
            ev = heapq.heappop(self.events)
            t, kind = ev[0], ev[2]
            if kind == "start":
                i = ev[3]
                self.peers[i] = ([0] if i else []) + self.page(i)
                self.last_from_peer[i] = t
                for _ in range(self.a.in_flight):
                    self.next_chunk(t, i)
            elif kind == "done":
                src, i, idx = ev[3], ev[4], ev[5]
                self.finish(t, src, i, idx)
            elif kind == "patience":
                i, idx = ev[3], ev[4]
                q = self.pending.get((i, idx))
                if self.have[i][idx] or q is None:
                    continue
                if t - self.last_from_peer[i] >= self.a.patience - 1e-9:
                    q.remove((i, idx))
                    del self.pending[(i, idx)]
                    self.begin(t, ORIGIN, i, idx)
                else:
                    self.push(self.last_from_peer[i] + self.a.patience, "patience", i, idx)
        return self

    def next_chunk(self, t, i):
        if self.next_idx[i] < self.chunks:
            idx = self.next_idx[i]
            self.next_idx[i] += 1
            self.ask(t, i, idx)

    def finish(self, t, src, i, idx):
        self.down[i] -= 1
        if src == ORIGIN:
            self.origin_readers -= 1
            self.origin_bytes += self.chunk
        else:
            self.up[src] -= 1
            self.uploaded[src] += self.chunk
            self.last_from_peer[i] = t
            self.serve_busy(t, src)
        if not self.have[i][idx]:
            self.have[i][idx] = 1
            self.count[i] += 1
        if self.count[i] == self.chunks and self.done_at[i] is None:
            self.done_at[i] = t
            w = self.a.wave
            if w and i < w and all(d is not None for d in self.done_at[:w]):
                # The rest of the fleet starts once the first wave sealed.
                for j in range(w, self.n):
                    self.start[j] += t
                    self.push(self.start[j], "start", j)
        for j, c in self.waiting.pop((i, idx), []):
            self.pending.pop((j, c), None)
            if not self.have[j][c]:
                self.ask(t, j, c)
        self.next_chunk(t, i)

    def serve_busy(self, t, p):
        q = self.busy.get(p)
        while q and self.up[p] < self.a.slots:
            j, idx = q.pop(0)
            self.pending.pop((j, idx), None)
            if not self.have[j][idx]:
                self.begin(t, p, j, idx)


def simulate(a):
    f = Fleet(a).run()
    model = f.chunks * f.chunk
    alone = model / min(a.nic_mbps, a.origin_mbps) / 1e6
    last = max(d for d in f.done_at)
    done = sorted(d - s for d, s in zip(f.done_at, f.start))
    wave = f"{a.wave} first" if a.wave else "all at once"
    return {
        "pages": a.pages,
        "start": wave,
        "nodes": a.nodes,
        "model_gib": a.model_gib,
        "nic_mbps": a.nic_mbps,
        "alone_s": round(alone, 1),
        "last_s": round(last, 1),
        "p50_s": round(done[len(done) // 2], 1),
        "last_over_alone": round(last / alone, 2),
        "origin_copies": round(f.origin_bytes / model, 3),
        "max_upload_copies": round(max(f.uploaded) / model, 2),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=int, default=32)
    p.add_argument("--model-gib", type=float, default=3.0)
    p.add_argument(
        "--chunk-mib",
        type=int,
        default=8,
        help="8 as the driver; pieces much coarser break the patience rule, which counts 8 MiB arrivals",
    )
    p.add_argument("--nic-mbps", type=float, default=100.0, help="each node's cap, up and down (MB/s)")
    p.add_argument("--origin-mbps", type=float, default=100.0)
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--in-flight", type=int, default=12)
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--patience", type=float, default=10.0)
    p.add_argument("--spread", type=float, default=1.0, help="nodes start within this many seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--wave", type=int, default=0, help="this many nodes first, the rest once they sealed (0: all at once)")
    p.add_argument(
        "--pages",
        choices=("shard", "drawn", "random"),
        default="drawn",
        help="shard: the asker's shard's first page in name order, as the driver asked before; "
        "drawn: a random bucket, narrowed while it holds more than a page, as the driver asks; "
        "random: any 15 nodes ahead",
    )
    p.add_argument("--enough", type=int, default=4, help="a bucket with fewer holders is filled from the page above")
    p.add_argument("--sweep", action="store_true", help="the figures of docs/benchmarks.md, as CSV")
    a = p.parse_args()
    if not a.sweep:
        for k, v in simulate(a).items():
            print(f"{k:20} {v}")
        return
    keys = None
    for pages, gib, chunk in (("shard", 3.0, 8), ("drawn", 3.0, 8), ("random", 3.0, 8)):
        for n in (32, 100, 1000, 5000):
            a.pages, a.nodes, a.model_gib, a.chunk_mib = pages, n, gib, chunk
            r = simulate(a)
            r["chunk_mib"] = chunk
            if keys is None:
                keys = list(r)
                print(",".join(keys))
            print(",".join(str(r[k]) for k in keys))
            sys.stdout.flush()


if __name__ == "__main__":
    main()
