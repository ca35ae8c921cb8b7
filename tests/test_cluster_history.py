"""A history checker in the style of Jepsen over a real cluster (etcd and four
`tarn` nodes, 2+2 sets): clients PUT unique values, GET, DELETE and LIST a
small set of keys concurrently through three nodes while the fourth is
paused (SIGSTOP), then killed (-9) and started again, twice; and while a
pool is added, then drained and retired. Every operation is
recorded with the times it was invoked and completed and what it returned;
a request that failed or timed out is indeterminate (it may have taken
effect at any time after it was invoked). The checker asserts, per key as a
register:

- every read returned a value some write wrote (no torn or foreign bytes);
- no read is stale: it returned a value whose write was invoked before the
  read completed, and no other write both began after that write completed
  and completed before the read was invoked;
- no acknowledged write is lost: the final reads, after the faults healed,
  are not stale either;
- a listing holds every key whose acknowledged PUT no DELETE could follow
  before the listing began, and no key no PUT could have made by its end;
  at the end, listings equal the keys that read;
- the under-replicated count returns to zero.
"""

import hashlib
import random
import signal
import threading
import time


from clusterproc import status, wait_repaired
from history import INF, ONE_ATTEMPT, History, around, possible, writes_of
from tarnproc import wait_for

KEYS = [f"k{i:02}" for i in range(16)]


def value(key, writer, seq):
    """A unique value that names itself: key, writer, sequence, a digest,
    padded to a size between inline and erasure-coded."""
    head = f"{key}/{writer}/{seq}/".encode()
    size = 2_000 + (seq * 7919 + writer * 104729) % 300_000
    pad = hashlib.sha256(head).digest() * (size // 32 + 1)
    return head + pad[:size]


def client_loop(node, writer, history, stop, seed):
    cl = node.client(retries=ONE_ATTEMPT)
    rng = random.Random(seed)
    seq = 0
    while not stop.is_set():
        key = rng.choice(KEYS)
        kind = rng.choices(["put", "get", "delete", "list"], [4, 4, 1, 1])[0]
        t0 = time.time()
        try:
            if kind == "put":
                seq += 1
                v = value(key, writer, seq)
                cl.put_object(Bucket="hist", Key=key, Body=v)
                history.add(kind="put", key=key, value=v, start=t0, end=time.time(), ok=True)
            elif kind == "delete":
                cl.delete_object(Bucket="hist", Key=key)
                history.add(kind="delete", key=key, value=None, start=t0, end=time.time(), ok=True)
            elif kind == "get":
                try:
                    v = cl.get_object(Bucket="hist", Key=key)["Body"].read()
                except cl.exceptions.NoSuchKey:
                    v = None
                history.add(kind="get", key=key, value=v, start=t0, end=time.time(), ok=True)
            else:
                keys = set()
                for page in cl.get_paginator("list_objects_v2").paginate(Bucket="hist"):
                    keys |= {o["Key"] for o in page.get("Contents", [])}
                history.add(kind="list", keys=keys, start=t0, end=time.time(), ok=True, via=node.i)
        except Exception as e:  # noqa: BLE001
            # Indeterminate: a write may have taken effect, at any time after.
            if kind in ("put", "delete"):
                history.add(kind=kind, key=key, value=v if kind == "put" else None,
                            start=t0, end=INF, ok=False, error=repr(e)[:200])
            else:
                history.add(kind=kind, key=key, start=t0, end=time.time(), ok=False, error=repr(e)[:200])


def check(history, final):
    errors = []
    by_key = {k: writes_of(history, k) for k in KEYS}
    written = {o["value"] for o in history if o["kind"] == "put"}
    for o in history:
        if o["kind"] == "get" and o["ok"]:
            v = o["value"]
            if v is not None and v not in written:
                errors.append(f"{o['key']}: read bytes no write wrote (torn or foreign): {v[:40]!r}")
            elif v not in possible(by_key[o["key"]], o["start"], o["end"]):
                errors.append(f"{o['key']}: stale read of {v[:30] if v else None!r} at {o['start']:.3f}"
                              + around(by_key[o["key"]], o))
        if o["kind"] == "list" and o["ok"]:
            for k, ws in by_key.items():
                vals = possible(ws, o["start"], o["end"])
                present = any(v is not None for v in vals)
                absent = any(v is None for v in vals)
                if k in o["keys"] and not present:
                    errors.append(f"{k}: listed at {o['start']:.3f} but no PUT could have made it")
                if k not in o["keys"] and not absent:
                    errors.append(f"{k}: not listed at {o['start']:.3f} after an acknowledged PUT"
                                  + around(ws, o))
    now = time.time()
    for k, v in final["reads"].items():
        if v not in possible(by_key[k], now, now):
            errors.append(f"{k}: the final read lost an acknowledged write")
    readable = {k for k, v in final["reads"].items() if v is not None}
    for listing in final["lists"]:
        if listing != readable:
            errors.append(f"final listing {sorted(listing ^ readable)} differs from the readable keys")
    return errors


def final_state(nodes, through):
    """The listings through every node and the reads through one, once the
    faults are over."""
    final = {"reads": {}, "lists": []}
    for n in nodes:
        cl = n.client()
        keys = set()
        for page in cl.get_paginator("list_objects_v2").paginate(Bucket="hist"):
            keys |= {o["Key"] for o in page.get("Contents", [])}
        final["lists"].append(keys)
    cl = through.client()
    for k in KEYS:
        try:
            final["reads"][k] = cl.get_object(Bucket="hist", Key=k)["Body"].read()
        except cl.exceptions.NoSuchKey:
            final["reads"][k] = None
    return final


def test_concurrent_history_under_pause_and_kill_is_linearizable(formed_cluster):
    _, nodes = formed_cluster
    nodes[0].client().create_bucket(Bucket="hist")
    history, stop = History(), threading.Event()
    threads = [threading.Thread(target=client_loop, args=(nodes[w % 3], w, history, stop, 1000 + w))
               for w in range(6)]
    for t in threads:
        t.start()
    faults = []
    try:
        # Twice: the node comes back between faults while it still syncs.
        for _ in range(2):
            time.sleep(3)
            faults.append(("paused", time.time()))
            nodes[3].signal(signal.SIGSTOP)
            time.sleep(3)
            faults.append(("resumed", time.time()))
            nodes[3].signal(signal.SIGCONT)
            time.sleep(2.5)
            faults.append(("killed", time.time()))
            nodes[3].signal(signal.SIGKILL)
            nodes[3].proc.wait()
            time.sleep(2.5)
            faults.append(("started", time.time()))
            nodes[3].start()
            nodes[3].wait_serving()
            faults.append(("serving", time.time()))
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    ops = history.ops
    done = [o for o in ops if o["ok"]]
    assert len([o for o in done if o["kind"] == "put"]) > 50, len(done)
    assert len([o for o in done if o["kind"] == "get"]) > 50, len(done)
    # Heal: nothing under-replicated, every drive back, as every node sees it.
    for n in nodes:
        wait_repaired(n, timeout=120)
    errors = check(ops, final_state(nodes, nodes[3]))
    failed = [o for o in ops if not o["ok"]]
    timeline = ", ".join(f"{what} {t:.3f}" for what, t in faults)
    assert not errors, f"{len(errors)} violations, e.g. {errors[:5]}; {len(failed)} indeterminate ops; {timeline}"
    # Requests through the nodes that stayed up all succeeded, listings too.
    others = [(o["kind"], o.get("error")) for o in failed]
    assert not others, others[:3]


def test_the_checker_catches_lost_stale_and_torn():
    """The checker itself, on made-up histories: it must fail where a store
    would have lost, served stale or torn data."""
    a, b = value("k00", 0, 1), value("k00", 0, 2)
    put_a = {"kind": "put", "key": "k00", "value": a, "start": 0.0, "end": 1.0, "ok": True}
    put_b = {"kind": "put", "key": "k00", "value": b, "start": 2.0, "end": 3.0, "ok": True}
    final_b = {"reads": {"k00": b}, "lists": [{"k00"}]}
    assert check([put_a, put_b], final_b) == []
    # A stale read: a after b was acknowledged.
    stale = {"kind": "get", "key": "k00", "value": a, "start": 4.0, "end": 5.0, "ok": True}
    assert any("stale" in e for e in check([put_a, put_b, stale], final_b))
    # A read concurrent with b may see a or b.
    racing = {"kind": "get", "key": "k00", "value": a, "start": 2.5, "end": 2.6, "ok": True}
    assert check([put_a, put_b, racing], final_b) == []
    # Torn bytes.
    torn = dict(stale, value=a[:100] + b[100:])
    assert any("torn" in e for e in check([put_a, put_b, torn], final_b))
    # A lost write: the final read shows nothing after an acknowledged PUT.
    lost = {"reads": {"k00": None}, "lists": [set()]}
    assert any("lost" in e for e in check([put_a, put_b], lost))
    # An indeterminate write may surface later, a failed-looking one too.
    maybe = dict(put_b, end=INF, ok=False)
    assert check([put_a, maybe], {"reads": {"k00": b}, "lists": [{"k00"}]}) == []
    assert check([put_a, maybe], {"reads": {"k00": a}, "lists": [{"k00"}]}) == []
    # A listing without a key whose PUT was acknowledged before it began.
    missing = {"kind": "list", "keys": set(), "start": 4.0, "end": 5.0, "ok": True}
    assert any("not listed" in e for e in check([put_a, put_b, missing], final_b))
    # Final listings must equal the readable keys.
    assert any("differs" in e for e in check([put_a, put_b], {"reads": {"k00": b}, "lists": [set()]}))


def test_concurrent_history_through_a_pool_add_and_drain_is_linearizable(tmp_path):
    """The same checker while a pool is added under the clients (new keys
    then go to both pools, followed live by every node), then drained and
    retired (keys move between pools under their writers and readers)."""
    from clusterproc import Node, form, node_shard_files, stop_all
    etcd, nodes = form(str(tmp_path))
    try:
        more = [Node(str(tmp_path), i, etcd.url) for i in (5, 6)]
        nodes += more
        for n in more:
            n.wait_serving()
        nodes[0].client().create_bucket(Bucket="hist")
        nodes[0].client().create_bucket(Bucket="fresh")
        history, stop = History(), threading.Event()
        threads = [threading.Thread(target=client_loop, args=(nodes[w % 3], w, history, stop, 2000 + w))
                   for w in range(6)]
        for t in threads:
            t.start()
        try:
            time.sleep(3)
            nodes[0].admin_cmd("pool", "add", "--nodes", "n5,n6")
            # The history's 16 keys mostly exist by now and stay where they
            # live; keys new after the change are placed over both pools.
            # Some are written beside the history (another bucket, so its
            # listings are untouched), for the drain to move too.
            for n in nodes[:3]:
                wait_for(f"n{n.i} sees the new pool", lambda n=n: len(status(n)["pools"]) == 2, timeout=30)
            fresh = nodes[1].client()
            for i in range(24):
                fresh.put_object(Bucket="fresh", Key=f"f{i:02}", Body=value(f"f{i:02}", 9, i))
            wait_for("objects in the new pool", lambda: sum(node_shard_files(n) for n in more) > 0, timeout=60)
            nodes[1].admin_cmd("pool", "drain", "1")
            wait_for("pool 1 retired",
                     lambda: [p["state"] for p in status(nodes[0])["pools"]] == ["active", "retired"], timeout=120)
            time.sleep(2)
        finally:
            stop.set()
            for t in threads:
                t.join()
        ops = history.ops
        done = [o for o in ops if o["ok"]]
        assert len([o for o in done if o["kind"] == "put"]) > 50, len(done)
        for n in nodes[:4]:
            wait_repaired(n, timeout=60)
        errors = check(ops, final_state(nodes[:4], nodes[3]))
        failed = [(o["kind"], o.get("error")) for o in ops if not o["ok"]]
        assert not errors, f"{len(errors)} violations, e.g. {errors[:5]}; {len(failed)} indeterminate ops"
        assert not failed, failed[:3]
        # The objects written beside it moved out of the drained pool whole.
        for n in nodes[:4]:
            cl = n.client()
            for i in range(24):
                got = cl.get_object(Bucket="fresh", Key=f"f{i:02}")["Body"].read()
                assert got == value(f"f{i:02}", 9, i), f"fresh/f{i:02} through n{n.i}"
    finally:
        stop_all(etcd, nodes)
