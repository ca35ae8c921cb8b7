"""The KV-cache store across a cluster: three nodes (etcd and `tarn` on
127.0.0.1-3, each with `--kv`), clients on two "hosts" (each first
connected to a different node) routing keys by weighted rendezvous hashing
over the members the nodes publish. Every process is stopped by its PID."""

import re
import time
import urllib.request

import numpy as np
import pytest

import tarn.kv as tkv
from clusterproc import form, stop_all
from tarnproc import wait_for

KV = ["--kv-memory", "64MiB", "--kv-value-max", "1MiB"]
BLOCK = 4096


@pytest.fixture
def kv_cluster(tmp_path):
    # Formed nodes start empty, so they ramp too: 3 s to a full share.
    etcd, nodes = form(str(tmp_path), count=3, drives=1, data_shards=2, parity_shards=1,
                       kv=KV + ["--kv-ramp-secs", "3"])
    try:
        yield etcd, nodes
    finally:
        stop_all(etcd, nodes)


def view_of(node):
    """The members a node routes by, as a fresh client learns them."""
    with tkv.Client(node.kv_endpoint, "probe", transport="tcp") as c:
        return {m["id"]: m["weight"] for m in c.members}


def ns_counter(node, counter, namespace="model-a"):
    req = urllib.request.Request(node.admin + "/metrics", headers={"Authorization": f"Bearer {node.secret_key}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    pat = rf'^tarn_kv_namespace\{{tenant="default",namespace="{namespace}",counter="{counter}"\}} (\d+)$'
    return sum(int(m.group(1)) for m in re.finditer(pat, text, re.M))


def node_stats(node, namespace="model-a"):
    with tkv.Client(node.kv_endpoint, namespace, cluster=False) as c:
        return c.stats()


def blocks(n_prefixes, per_prefix, seed):
    rng = np.random.default_rng(seed)
    keys = [[tkv.key("prefix", p, b) for b in range(per_prefix)] for p in range(n_prefixes)]
    values = [[rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(per_prefix)] for _ in range(n_prefixes)]
    return keys, values


def read_all(client, keys, values):
    """Reads every block back; returns how many came back right."""
    flat_k = [k for p in keys for k in p]
    flat_v = [v for p in values for v in p]
    bufs = [np.zeros(BLOCK, np.uint8) for _ in flat_k]
    got = client.get_into(flat_k, bufs)
    return sum(1 for g, b, v in zip(got, bufs, flat_v) if g == BLOCK and np.array_equal(b, v))


def test_kv_prefixes_shared_across_hosts_and_a_restart_moves_no_hotspot(kv_cluster):
    _, nodes = kv_cluster
    ids = ["n1", "n2", "n3"]
    wait_for("every node publishing a full-weight KV store",
             lambda: all(view_of(n) == {i: 1000 for i in ids} for n in nodes), timeout=30)

    # Host A's engine talks to n1, host B's to n2; both route over all three.
    a = tkv.Client(nodes[0].kv_endpoint, "model-a")
    b = tkv.Client(nodes[1].kv_endpoint, "model-a")
    try:
        assert sorted(m["id"] for m in a.members) == ids
        assert {m["id"]: m["endpoint"] for m in a.members} == {f"n{i + 1}": n.kv_endpoint for i, n in enumerate(nodes)}
        keys, values = blocks(64, 8, seed=1)
        for k, v in zip(keys, values):
            assert all(s.stored for s in a.put_from(k, v))
        # Host B finds every prefix host A stored, whole, with the right bytes.
        assert [b.prefix_hits(k) for k in keys] == [8] * 64
        assert read_all(b, keys, values) == 512

        # One copy of each block, on the node both hosts rank first for it,
        # and the blocks spread over all three nodes.
        flat = [k for p in keys for k in p]
        owners = a.owners(flat)
        assert owners == b.owners(flat)
        held = {n_id: node_stats(n)["namespace.blocks"] for n_id, n in zip(ids, nodes)}
        assert sum(held.values()) == 512, held
        assert all(90 < c < 260 for c in held.values()), held
        for n_id, n in zip(ids, nodes):
            with tkv.Client(n.kv_endpoint, "model-a", cluster=False) as direct:
                present = direct.exists(flat)
            assert [o == n_id for o in owners] == present, n_id

        # n3 restarts with an empty store and a slower ramp. While it is
        # away its keys go to their next-ranked node (the engines store
        # them again after the misses).
        n3 = nodes[2]
        n3.stop()
        wait_for("the others dropping n3",
                 lambda: all(set(view_of(n)) == {"n1", "n2"} for n in nodes[:2]), timeout=30)
        refilled = [s for k, v in zip(keys, values) for s in b.put_from(k, v)]
        assert all(s.stored for s in refilled)
        assert refilled.count(tkv.Status.OK) == owners.count("n3")
        n3.args[n3.args.index("--kv-ramp-secs") + 1] = "9"
        n3.start()
        n3.wait_serving()
        wait_for("n1 and n2 seeing n3 back",
                 lambda: all("n3" in view_of(n) for n in nodes[:2]), timeout=30)
        gets_before = {n_id: node_stats(n)["namespace.gets"] for n_id, n in zip(ids[:2], nodes[:2])}

        # Right after the restart both hosts read everything: all hits (the
        # few keys n3 owns at its small weight fall back to the node that
        # had them and are written back), and n3 takes a small share of
        # the reads, not the third a full weight would give it.
        assert read_all(a, keys, values) == 512
        assert read_all(b, keys, values) == 512
        weight = {m["id"]: m["weight"] for m in a.members}["n3"]
        assert weight < 1000, a.members
        n3_gets = node_stats(n3)["namespace.gets"]
        others = sum(node_stats(n)["namespace.gets"] - gets_before[i] for i, n in zip(ids[:2], nodes[:2]))
        assert n3_gets < 0.15 * (n3_gets + others), (n3_gets, others, weight)
        routed = a.routing_stats()
        assert routed["refreshes"] >= 1 and routed["fallback_hits"] >= 1, routed
        assert ns_counter(n3, "copies_stored") >= 1
        assert sum(ns_counter(n, "fallback_hits") for n in nodes[:2]) >= 1
        assert sum(ns_counter(n, "misses_not_owner") for n in nodes) >= 1

        # Its weight climbs to a full share; reads stay all hits meanwhile
        # and it ends up owning about a third of the keys again.
        wait_for("n3 at full weight", lambda: view_of(nodes[0]).get("n3") == 1000, timeout=30)
        assert read_all(a, keys, values) == 512
        assert {m["id"]: m["weight"] for m in a.members}["n3"] == 1000
        share = a.owners(flat).count("n3") / len(flat)
        assert 0.2 < share < 0.47, share
        assert read_all(b, keys, values) == 512

        # A block read often gets a second copy on its next-ranked node,
        # and reads then alternate between the two.
        hot = flat[0]
        buf = np.zeros(BLOCK, np.uint8)
        for _ in range(12):
            assert b.get_into([hot], [buf]) == [BLOCK]
        assert np.array_equal(buf, values[0][0])
        assert b.routing_stats()["hot_copies"] == 1
        holders = []
        for n_id, n in zip(ids, nodes):
            with tkv.Client(n.kv_endpoint, "model-a", cluster=False) as direct:
                if direct.exists([hot]) == [True]:
                    holders.append(n_id)
        assert len(holders) == 2 and b.owners([hot])[0] in holders, holders
        assert sum(ns_counter(n, "hot_marked") for n in nodes) >= 1
        # Deleting removes both copies.
        assert b.delete([hot]) == [True]
        assert b.exists([hot]) == [False]
    finally:
        a.close()
        b.close()
    for n in nodes:
        assert not n.errors(), n.errors()


def test_kv_routing_off_and_stale_routes_refused(kv_cluster):
    _, nodes = kv_cluster
    wait_for("every node publishing a full-weight KV store",
             lambda: all(view_of(n) == {"n1": 1000, "n2": 1000, "n3": 1000} for n in nodes), timeout=30)
    # cluster=False talks to the one endpoint given, as on a single node.
    with tkv.Client(nodes[0].kv_endpoint, "model-b", cluster=False) as only:
        assert only.members == [] and only.cluster_epoch == 0
        keys = [tkv.key("solo", i) for i in range(30)]
        assert all(s.stored for s in only.put_from(keys, [bytes([i]) * 100 for i in range(30)]))
        assert only.stats()["namespace.blocks"] == 30
    # A routing client starts from the epoch the node gave it; a batch
    # routed by an older, different view is refused and re-routed: n2's
    # members change under a client that keeps the old view (n1 restarts
    # empty and stays at a low weight for the rest of the test).
    c = tkv.Client(nodes[1].kv_endpoint, "model-b")
    try:
        epoch = c.cluster_epoch
        assert epoch > 0 and len(c.members) == 3
        nodes[0].stop()
        wait_for("n2 dropping n1", lambda: "n1" not in view_of(nodes[1]), timeout=30)
        nodes[0].args[nodes[0].args.index("--kv-ramp-secs") + 1] = "600"
        nodes[0].start()
        nodes[0].wait_serving()
        wait_for("n2 seeing n1 back", lambda: "n1" in view_of(nodes[1]), timeout=30)
        keys = [tkv.key("after", i) for i in range(40)]
        assert all(s.stored for s in c.put_from(keys, [b"v" * 64] * 40))
        assert c.cluster_epoch > epoch
        assert {m["id"]: m["weight"] for m in c.members}["n1"] == 100
        assert c.routing_stats()["refreshes"] >= 1
        assert ns_counter(nodes[1], "misses_not_owner", "model-b") >= 1
        assert c.exists(keys) == [True] * 40
        # The parts of one value, put from two hosts (two ranks of a TP
        # engine), meet at its owner; either reads it whole or a range.
        with tkv.Client(nodes[2].kv_endpoint, "model-b") as d:
            whole = bytes(range(256)) * 256
            k = tkv.key("parts")
            assert c.owners([k]) == d.owners([k])
            assert c.put_parts([k], [whole[:30000]], [len(whole)], [0]) == [tkv.Status.OK]
            assert d.get_into([k], [bytearray(len(whole))]) == [None]
            assert d.put_parts([k], [whole[30000:]], [len(whole)], [30000]) == [tkv.Status.OK]
            out = bytearray(len(whole))
            assert c.get_into([k], [out]) == [len(whole)] and out == whole
            part = bytearray(1000)
            assert d.get_into([k], [part], offsets=[40000]) == [1000] and part == whole[40000:41000]
    finally:
        c.close()
