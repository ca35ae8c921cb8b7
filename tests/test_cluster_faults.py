"""Cluster operations under faults: a real etcd and four `tarn` nodes on
127.0.0.1-4 (two drives each, sets of 2+2 with one drive per node), a node
paused (SIGSTOP), cut off (its network namespace's link taken down) or
killed (kill -9) under a concurrent load, and what the
cluster must show: no request fails, a silent node is routed around (a
suspect peer), writes it missed are logged before they are acknowledged and
replayed to it when it is back (syncing, then online), and the
under-replicated count returns to zero. Every process is stopped by its
PID."""

import os
import shutil
import signal
import threading
import time
import warnings

from clusterproc import Node, shard_files, status, wait_repaired
from conftest import data
from tarnproc import metric, wait_for


class Load:
    """Writers and readers through the given nodes until stopped: every
    request's outcome is recorded; PUTs write unique values."""

    def __init__(self, nodes, bucket, writers=4, readers=2):
        self.nodes, self.bucket = nodes, bucket
        self.stop = threading.Event()
        self.acked, self.failed, self.latencies = {}, [], []
        self.written = {}  # key: (node, time acknowledged), for failures' messages
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.write, args=(w,)) for w in range(writers)]
        self.threads += [threading.Thread(target=self.read, args=(r,)) for r in range(readers)]
        for t in self.threads:
            t.start()

    def record(self, t0, error=None):
        with self.lock:
            self.latencies.append((t0, time.time() - t0))
            if error is not None:
                self.failed.append(error)

    def write(self, w):
        node = self.nodes[w % len(self.nodes)]
        cl = node.client()
        j = 0
        while not self.stop.is_set():
            key = f"w{w}/{j}"
            body = data(key, 20_000 + 7919 * (j % 30))
            t0 = time.time()
            try:
                cl.put_object(Bucket=self.bucket, Key=key, Body=body)
                with self.lock:
                    self.acked[key] = body
                    self.written[key] = f"n{node.i} acked {time.time():.3f}"
                self.record(t0)
            except Exception as e:  # noqa: BLE001
                self.record(t0, f"PUT {key} through n{node.i} at {t0:.3f}: {e!r}")
            j += 1

    def read(self, r):
        node = self.nodes[r % len(self.nodes)]
        cl = node.client()
        while not self.stop.is_set():
            with self.lock:
                keys = list(self.acked)[-50:]
            if not keys:
                time.sleep(0.05)
                continue
            key = keys[hash((r, len(keys))) % len(keys)]
            t0 = time.time()
            try:
                body = cl.get_object(Bucket=self.bucket, Key=key)["Body"].read()
                if body != self.acked[key]:
                    self.record(t0, f"GET {key} through n{node.i} at {t0:.3f}: wrong bytes")
                else:
                    self.record(t0)
            except Exception as e:  # noqa: BLE001
                self.record(t0, f"GET {key} through n{node.i} at {t0:.3f} (put through {self.written[key]}): {e!r}")

    def finish(self):
        self.stop.set()
        for t in self.threads:
            t.join()


def seed(node, bucket, count, key, size):
    """Creates `bucket` through `node` and puts `count` objects, object j
    under key(j) with size(j) bytes: what was acknowledged, by key."""
    cl = node.client()
    cl.create_bucket(Bucket=bucket)
    acked = {}
    for j in range(count):
        k = key(j)
        acked[k] = data(k, size(j))
        cl.put_object(Bucket=bucket, Key=k, Body=acked[k])
    return acked


def check_all_readable(nodes, bucket, acked):
    for n in nodes:
        cl = n.client()
        listed = set()
        for page in cl.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            listed |= {o["Key"] for o in page.get("Contents", [])}
        assert set(acked) <= listed, f"node {n.i}: {len(set(acked) - listed)} acknowledged keys not listed"
        for key in list(acked)[::5]:
            assert cl.get_object(Bucket=bucket, Key=key)["Body"].read() == acked[key], (n.i, key)


def check_served_with_paused(reader, paused, bucket, acked, every=1, written=None):
    """With the `paused` nodes stopped (SIGSTOP), every `every`th object is
    read through `reader` and equals what was acknowledged (`written`: where
    and when a key was written, for the failure's message)."""
    for n in paused:
        n.signal(signal.SIGSTOP)
    try:
        cl = reader.client()
        for key in list(acked)[::every]:
            where = (written or {}).get(key, "seeded")
            try:
                body = cl.get_object(Bucket=bucket, Key=key)["Body"].read()
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"GET {key} ({where}) at {time.time():.3f}: {e!r}") from None
            assert body == acked[key], f"{key} ({where}): wrong bytes"
    finally:
        for n in paused:
            n.signal(signal.SIGCONT)


def drive_states(node):
    return [("offline" if not d["online"] else "rebuilding" if d["rebuilding"]
             else "syncing" if d["syncing"] else "online")
            for d in status(node)["drives_seen_from_here"]]


def wait_synced(node):
    """Until nothing is under-replicated and every drive is online, as
    `node` sees them."""
    wait_for("the log replayed", lambda: status(node)["under_replicated"] == 0, timeout=90)
    wait_for("drives online", lambda: set(drive_states(node)) == {"online"}, timeout=90)


def silenced_under_load(nodes, bucket, silence, wake):
    """The last node silenced (`silence`, then `wake`) under a load through
    the others: no request fails, the node is routed around without
    etcd's word (a suspect peer; its drives out of the others' view), the
    writes it misses are logged, and back, it is synced from the log."""
    nodes[0].client().create_bucket(Bucket=bucket)
    load = Load(nodes[:-1], bucket)
    time.sleep(1.5)
    silence()
    try:
        st = wait_for("a suspect peer", lambda: (lambda s: s if s["suspect_peers"] else None)(status(nodes[0])),
                      timeout=90)
        assert st["suspect_peers"][0]["node"] == f"n{nodes[-1].i}", st["suspect_peers"]
        n_before = len(load.acked)
        time.sleep(4)
        assert len(load.acked) > n_before + 10
        # Writes made meanwhile are in the missed-write log.
        assert status(nodes[1])["under_replicated"] > 0
    finally:
        wake()
    time.sleep(1)
    load.finish()
    assert not load.failed, load.failed[:3]
    # Back: the others see its drives sync, then serve; the log is replayed
    # by its node until nothing is under-replicated.
    wait_synced(nodes[0])
    assert metric(nodes[-1], "tarn_missed_writes_replayed_total") > 0
    assert metric(nodes[0], "tarn_missed_writes_total") > 0
    check_all_readable(nodes, bucket, load.acked)
    # Synced from the log, not healed in full.
    assert not any("healing in full" in line for n in nodes for p in n.logs for line in open(p))


def test_paused_node_is_routed_around_and_synced_after(formed_cluster):
    _, nodes = formed_cluster
    silenced_under_load(nodes, "paused", lambda: nodes[3].signal(signal.SIGSTOP),
                        lambda: nodes[3].signal(signal.SIGCONT))


def test_node_cut_off_by_its_link_is_routed_around_and_synced_after(tmp_path):
    """Node 4 in a network namespace of its own, joined to the host (etcd
    and the other nodes, on addresses of `lo`) by a veth pair whose end in
    the namespace is taken down, then up: the node keeps running, cut off.
    Where the machine has no namespaces to give (not root), node 4 is
    paused instead, as the issue allows."""
    from clusterproc import Link, form, stop_all
    link = Link.create()
    if link is None:
        warnings.warn("no network namespace here: node 4 is paused (SIGSTOP) instead of cut off")
    etcd, nodes = None, []
    try:
        etcd, nodes = form(str(tmp_path), link=link)
        if link:
            silenced_under_load(nodes, "cut", link.cut, link.restore)
        else:
            silenced_under_load(nodes, "cut", lambda: nodes[3].signal(signal.SIGSTOP),
                                lambda: nodes[3].signal(signal.SIGCONT))
    finally:
        if etcd:
            stop_all(etcd, nodes)
        if link:
            link.remove()


def test_killed_node_returns_and_missed_writes_are_replayed(formed_cluster):
    _, nodes = formed_cluster
    nodes[0].client().create_bucket(Bucket="killed")
    load = Load(nodes[:3], "killed")
    time.sleep(1.5)
    nodes[3].signal(signal.SIGKILL)
    nodes[3].proc.wait()
    time.sleep(4)
    load.finish()
    assert not load.failed, load.failed[:3]
    acked = dict(load.acked)
    under = status(nodes[0])["under_replicated"]
    assert under > 0
    # Writes that reached a node's drives after the others lost it: the
    # count is of distinct objects, at most what was written.
    assert under <= len(acked) + 10
    nodes[3].start()
    nodes[3].wait_serving()
    # It starts syncing (no metadata reads from its drives) until its
    # position's log is empty, replaying it meanwhile.
    wait_synced(nodes[3])
    wait_synced(nodes[0])
    assert metric(nodes[3], "tarn_missed_writes_replayed_total") >= 1
    check_all_readable(nodes, "killed", acked)
    # Its drives hold every object now: with two other nodes gone, the
    # returned one and one more still serve every object (2+2).
    check_served_with_paused(nodes[3], nodes[1:3], "killed", acked, every=3)


def checkpoint(drive):
    """The backfill checkpoint in a drive's rebuild marker (docs/format.md):
    (phase, bucket, key), or None for an empty or missing marker."""
    try:
        b = open(os.path.join(drive, ".tarn", "rebuilding"), "rb").read()
    except FileNotFoundError:
        return None
    if len(b) < 13 or b[:4] != b"TBF1":
        return None
    phase, rest, out = b[4], b[5:-4], []
    for _ in range(2):
        n = int.from_bytes(rest[:2], "little")
        out.append(rest[2:2 + n].decode())
        rest = rest[2 + n:]
    return (phase, *out)


def job(node, kind="backfill"):
    return next((j for j in status(node)["jobs"] if j["kind"] == kind), None)


def test_replaced_node_is_backfilled_resumes_after_a_restart_and_serves(formed_cluster, tmp_path):
    etcd, nodes = formed_cluster
    # Small objects (inline) and large ones (erasure-coded shards).
    acked = seed(nodes[0], "replaced", 120, lambda j: f"before/{j:03}",
                 lambda j: 3_000 if j % 3 == 0 else 150_000 + 1013 * j)
    nodes[3].signal(signal.SIGKILL)
    nodes[3].proc.wait()
    # An empty node, its backfill slowed (4 MiB/s) so that it can be seen
    # and interrupted.
    new = Node(str(tmp_path), 5, etcd.url, extra=["--heal-rate", "4MiB"])
    nodes.append(new)
    new.wait_serving()
    # A node that holds places cannot be the replacement; nor can one
    # that is not registered.
    r = nodes[0].admin_cmd("node", "replace", "n4", "--with", "n2", check=False)
    assert r.returncode != 0 and "already holds places" in r.stderr, r.stderr
    r = nodes[0].admin_cmd("node", "replace", "n4", "--with", "n9", check=False)
    assert r.returncode != 0 and "not registered" in r.stderr, r.stderr
    load = Load(nodes[:3], "replaced", writers=2, readers=2)
    try:
        out = nodes[0].admin_cmd("node", "replace", "n4", "--with", "n5").stdout
        assert "node n5 takes node n4's places" in out, out
        st = status(nodes[1])
        assert {n["id"]: n["state"] for n in st["nodes"]}["n4"] == "retired"
        placed = [d for p in st["pools"] for s in p["sets"] for d in s]
        assert not any(d["node"] == "n4" for d in placed)
        assert sum(d.get("replaces") is not None for d in placed) == 2
        # Its backfill shows in every node's status, with progress and a rate.
        b = wait_for("backfill progress", lambda: (lambda j: j if j and j["objects_done"] >= 10 else None)(job(nodes[0])),
                     timeout=60)
        assert b["node"] == "n5" and b["phase"] == "fill" and b["objects_total"] >= 100, b
        assert b["rate_limit_bytes_per_s"] == 4 << 20 and b["rate_bytes_per_s"] > 0, b
        assert b["eta_s"] is not None and b["eta_s"] > 0, b
        assert not status(nodes[0])["repair_done"]
        assert metric(new, "tarn_backfill_running") == 1
        # Killed mid-fill, once a fill checkpoint is on a drive, it resumes
        # from its checkpoints when it is back: what it says it resumed from
        # follows from the checkpoints the kill left on its drives.
        roots = [os.path.join(new.root, f"d{d}") for d in range(2)]
        wait_for("a fill checkpoint", lambda: any(c and c[0] == 0 for c in map(checkpoint, roots)), timeout=60)
        new.signal(signal.SIGKILL)
        new.proc.wait()
        left = [checkpoint(r) for r in roots]
        new.start()
        new.wait_serving()
        # (Read once it has visited an object: it says where it resumed
        # from before it lists.)
        b = wait_for("a resumed backfill",
                     lambda: (lambda j: j if j and (j["objects_done"] > 0 or j["phase"] == "verify") else None)(job(new)),
                     timeout=60)
        # One set fills at a time: at most one fill checkpoint; a set that
        # had filled resumes at its verify, one with none starts over.
        fills = [c for c in left if c and c[0] == 0]
        assert len(fills) <= 1, left
        if fills:
            assert fills[0][1] == "replaced" and fills[0][2].startswith("before/"), left
            expect = {"phase": "fill", "bucket": fills[0][1], "key": fills[0][2]}
        else:
            expect = {"phase": "verify", "bucket": None, "key": None} if any(left) else None
        assert b["resumed_from"] == expect, (b, left)
        assert expect is not None, ("killed with no checkpoint left", left)
    finally:
        time.sleep(1)
        load.finish()
    assert not load.failed, load.failed[:3]
    acked.update(load.acked)
    # Done only after the verifying scan: no job, no drive behind, nothing
    # under-replicated, as every node sees it.
    for n in nodes[:3] + [new]:
        wait_repaired(n, timeout=180)
    assert metric(new, "tarn_backfill_running") == 0
    assert metric(new, "tarn_backfill_objects_visited_total") >= 2 * 100
    assert any("verifying scan found every object whole" in line for p in new.logs for line in open(p))
    check_all_readable(nodes[:3] + [new], "replaced", acked)
    # The new node's drives hold every object: with two other nodes paused,
    # it and one more serve them all (2+2).
    check_served_with_paused(new, nodes[:2], "replaced", acked)


def test_etcd_stopped_and_restarted_under_load(formed_cluster):
    """etcd down longer than a member's lease, then back: the data path
    serves throughout with what it last saw, members register again, and
    what needs etcd works again."""
    etcd, nodes = formed_cluster
    nodes[0].client().create_bucket(Bucket="etcd-away")
    load = Load(nodes, "etcd-away", writers=3, readers=2)
    try:
        time.sleep(1.5)
        etcd.stop()
        time.sleep(8)
        etcd.start()
        time.sleep(2)
    finally:
        load.finish()
    assert not load.failed, load.failed[:3]
    for n in nodes:
        wait_for(f"n{n.i} live again", lambda: all(x["live"] for x in status(nodes[0])["nodes"]), timeout=30)
    nodes[2].client().create_bucket(Bucket="after-etcd")
    nodes[3].client().head_bucket(Bucket="after-etcd")
    check_all_readable(nodes, "etcd-away", load.acked)
    for n in nodes:
        wait_repaired(n, timeout=60)


def test_emptied_drive_is_rebuilt_and_serves(formed_cluster):
    """A node's drive found empty at its restart (the disk swapped, its
    contents lost): it rejoins its set, is backfilled while the cluster
    serves, and holds its shards again."""
    _, nodes = formed_cluster
    acked = seed(nodes[0], "emptied", 60, lambda j: f"k{j:03}",
                 lambda j: 2_500 if j % 4 == 0 else 90_000 + 1009 * j)
    drive = os.path.join(nodes[2].root, "d0")
    had = shard_files(drive)
    assert had > 0
    nodes[2].signal(signal.SIGKILL)
    nodes[2].proc.wait()
    shutil.rmtree(drive)
    os.makedirs(drive)
    nodes[2].start()
    nodes[2].wait_serving()
    load = Load(nodes[:2] + nodes[3:], "emptied", writers=2, readers=2)
    try:
        for n in nodes:
            wait_repaired(n, timeout=120)
    finally:
        load.finish()
    assert not load.failed, load.failed[:3]
    # Writes the load made after the backfill ended may have missed a drive
    # (a node too busy to answer in time is routed around, and the write
    # logged for it): they are replayed before the drives are checked.
    for n in nodes:
        wait_repaired(n, timeout=60)
    acked.update(load.acked)
    assert shard_files(drive) >= had
    check_all_readable(nodes, "emptied", acked)
    # The rebuilt drive holds its shards: with two other nodes paused, the
    # objects of its sets are still served (2+2).
    check_served_with_paused(nodes[2], nodes[:2], "emptied", acked, every=4, written=load.written)
