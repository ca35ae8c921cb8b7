"""Cluster expansion: a pool of erasure sets added under load with one map
change (`tarn admin pool add`). A real etcd, four `tarn` nodes forming the
first pool (2+2 over two drives each) and two more nodes whose drives form
the second; every process is stopped by its PID."""

import datetime
import signal
import time

import botocore.exceptions
import pytest

from clusterproc import Node, node_shard_files, status, wait_repaired
from conftest import data
from tarnproc import metric, wait_for
from test_cluster_faults import Load, check_all_readable, drive_states, seed


def test_pool_added_under_load_serves_new_objects_and_keeps_every_object(formed_cluster, tmp_path):
    etcd, nodes = formed_cluster
    acked = seed(nodes[0], "grow", 60, lambda j: f"before/{j:03}",
                 lambda j: 2_000 if j % 3 == 0 else 100_000 + 997 * j)
    more = [Node(str(tmp_path), i, etcd.url) for i in (5, 6)]
    nodes += more
    for n in more:
        n.wait_serving()
    # Refusals: a node of the first pool has no unplaced drive; a node
    # that is not registered; too few nodes for the parity.
    r = nodes[0].admin_cmd("pool", "add", "--nodes", "n1,n5", check=False)
    assert r.returncode != 0 and "no drive the map does not place" in r.stderr, r.stderr
    r = nodes[0].admin_cmd("pool", "add", "--nodes", "n5,n9", check=False)
    assert r.returncode != 0 and "not registered" in r.stderr, r.stderr
    r = nodes[0].admin_cmd("pool", "add", "--nodes", "n5", check=False)
    assert r.returncode != 0, r.stdout
    assert len(status(nodes[0])["pools"]) == 1, "a refused add changes nothing"
    before = sum(node_shard_files(n) for n in more)
    assert before == 0
    load = Load(nodes[:4], "grow", writers=3, readers=2)
    try:
        time.sleep(2)
        out = nodes[1].admin_cmd("pool", "add", "--nodes", "n5,n6").stdout
        assert "pool 1 added: 1 erasure set(s) of 2+2" in out, out
        epoch = status(nodes[0])["epoch"]
        # Every running node follows the map without a restart.
        for n in nodes:
            wait_for(f"n{n.i} serving epoch {epoch}",
                     lambda n=n: any(f"epoch={epoch}" in line and "serving the new cluster map" in line
                                     for p in n.logs for line in open(p)),
                     timeout=30)
        time.sleep(6)
        # Overwrites of keys that exist stay in their pool.
        for j in range(0, 60, 7):
            key = f"before/{j:03}"
            acked[key] = data(key + "v2", 120_000)
            nodes[2].client().put_object(Bucket="grow", Key=key, Body=acked[key])
    finally:
        load.finish()
    assert not load.failed, load.failed[:3]
    acked.update(load.acked)
    st = status(nodes[4])
    assert [p["id"] for p in st["pools"]] == [0, 1]
    assert {d["node"] for s in st["pools"][1]["sets"] for d in s} == {"n5", "n6"}
    # New objects went to the new pool too (by free space), and every
    # object is readable and listed through every node, the new ones too.
    assert sum(node_shard_files(n) for n in more) > 0
    check_all_readable(nodes, "grow", acked)
    # A node restarted after the change opens both pools from the map.
    nodes[1].signal(signal.SIGKILL)
    nodes[1].proc.wait()
    nodes[1].start()
    nodes[1].wait_serving()
    check_all_readable([nodes[1]], "grow", acked)
    # A key in the new pool is deleted and overwritten like any other.
    cl = nodes[5].client()
    keys = sorted(load.acked)
    cl.delete_object(Bucket="grow", Key=keys[0])
    acked.pop(keys[0])
    cl.put_object(Bucket="grow", Key=keys[1], Body=b"short")
    acked[keys[1]] = b"short"
    check_all_readable([nodes[0]], "grow", acked)
    listed = {o["Key"] for o in nodes[0].client().list_objects_v2(Bucket="grow", MaxKeys=1000).get("Contents", [])}
    assert keys[0] not in listed
    for n in nodes:
        wait_repaired(n, timeout=60)


def add_second_pool(tmp_path, etcd, nodes, extra=()):
    """Starts n5 and n6 and adds their drives as pool 1, followed by every
    node; returns the two new nodes (appended to `nodes` too)."""
    more = [Node(str(tmp_path), i, etcd.url, extra=extra) for i in (5, 6)]
    nodes += more
    for n in more:
        n.wait_serving()
    nodes[0].admin_cmd("pool", "add", "--nodes", "n5,n6")
    for n in nodes:
        wait_for(f"n{n.i} serving two pools", lambda n=n: log_has(n, "serving the new cluster map"), timeout=30)
    return more


def test_a_pool_whose_nodes_were_all_silent_serves_again_through_every_node(formed_cluster, tmp_path):
    """Every drive of a set out of a node's view at once (the new pool's
    nodes both paused; also what a node saw when it applied a pool add a
    moment before the pool's nodes did): when they answer again they are
    syncing there, with no other drive of their set readable to vouch for
    them. The missed-write logs are what does: empty, so they serve again,
    and repair ends, instead of the pool staying unreadable through that
    node for good."""
    etcd, nodes = formed_cluster
    more = add_second_pool(tmp_path, etcd, nodes)
    acked = seed(nodes[0], "silent", 40, lambda j: f"s/{j:03}", lambda j: 150_000 + 311 * j)
    assert sum(node_shard_files(n) for n in more) > 0, "some objects are in the new pool"
    reader = nodes[0].client()
    for n in more:
        n.signal(signal.SIGSTOP)
    try:
        def pool_out():
            for key in list(acked)[:10]:
                try:
                    reader.get_object(Bucket="silent", Key=key)["Body"].read()
                except Exception:  # noqa: BLE001 - the pool's whole set is away
                    pass
            return drive_states(nodes[0]).count("offline") >= 4
        wait_for("n1 taking the new pool's four drives out", pool_out, timeout=60)
    finally:
        for n in more:
            n.signal(signal.SIGCONT)
    for n in nodes:
        wait_repaired(n, timeout=60)
    assert set(drive_states(nodes[0])) == {"online"}
    check_all_readable(nodes, "silent", acked)


def drain_job(node):
    return next((j for j in status(node)["jobs"] if j["kind"] == "drain"), None)


def leading_drain(nodes):
    """The node that leads the drain now by its own status (a node lists its
    own job first; others' published ones may be a few seconds stale), and
    that job; None if none does."""
    for n in nodes:
        j = drain_job(n)
        if j and j["node"] == f"n{n.i}":
            return n, j
    return None


def log_has(node, text):
    return any(text in line for p in node.logs for line in open(p))


def test_pool_drained_under_load_with_its_job_leader_killed_and_fenced(tmp_path):
    """Pool 1 drained while clients write and read, at a background rate
    limit: its job's leader is killed mid-job (another resumes), the next
    one is paused past its lease (another takes over; the paused one, woken,
    is fenced off and stops), uploads begun before the drain hold it until
    they complete after their keys moved, and the pool ends retired and
    empty with every object and version readable."""
    from clusterproc import form, stop_all
    slow = ["--heal-rate", "512KiB"]
    etcd, nodes = form(str(tmp_path), extra=slow)
    try:
        more = add_second_pool(tmp_path, etcd, nodes, extra=slow)
        acked = seed(nodes[0], "drain", 200, lambda j: f"d/{j:03}",
                     lambda j: 3_000 if j % 5 == 0 else 150_000 + 641 * j)
        cl = nodes[0].client()
        # Multipart: part boundaries and the multipart ETag survive a move.
        etag = {}
        for k in range(3):
            key = f"mp{k}"
            mp = cl.create_multipart_upload(Bucket="drain", Key=key)["UploadId"]
            parts = [data((key, i), 5 << 20) for i in range(2)] + [b"tail"]
            tags = [cl.upload_part(Bucket="drain", Key=key, UploadId=mp, PartNumber=i + 1, Body=p)["ETag"]
                    for i, p in enumerate(parts)]
            cl.complete_multipart_upload(Bucket="drain", Key=key, UploadId=mp, MultipartUpload={
                "Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(tags)]})
            acked[key] = b"".join(parts)
            etag[key] = cl.head_object(Bucket="drain", Key=key)["ETag"]
        # Encrypted objects (SSE-C: no server key needed) move sealed: the
        # drain copies their stored bytes, their salts go with the record.
        ckey = {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": b"k" * 32}
        cl.create_bucket(Bucket="drainenc")
        sealed = {}
        for k in range(6):
            key = f"e{k}"
            body = data(("enc", k), [3_000, 150_000][k % 2])
            cl.put_object(Bucket="drainenc", Key=key, Body=body, **ckey)
            sealed[key] = body
        mp = cl.create_multipart_upload(Bucket="drainenc", Key="emp", **ckey)["UploadId"]
        parts = [data(("emp", i), 5 << 20) for i in range(2)] + [b"tail"]
        tags = [cl.upload_part(Bucket="drainenc", Key="emp", UploadId=mp, PartNumber=i + 1, Body=p, **ckey)["ETag"]
                for i, p in enumerate(parts)]
        cl.complete_multipart_upload(Bucket="drainenc", Key="emp", UploadId=mp, MultipartUpload={
            "Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(tags)]})
        sealed["emp"] = b"".join(parts)

        def check_sealed(live):
            for n in live:
                c = n.client()
                for key, body in sealed.items():
                    assert c.get_object(Bucket="drainenc", Key=key, **ckey)["Body"].read() == body, key
                got = c.get_object(Bucket="drainenc", Key="emp", Range=f"bytes={(5 << 20) - 7}-{(5 << 20) + 9}", **ckey)
                assert got["Body"].read() == sealed["emp"][(5 << 20) - 7:(5 << 20) + 10]

        # Locked versions (object lock) move with their locks: still kept
        # from deletion, by anyone, after the drain.
        cl.create_bucket(Bucket="drainlock", ObjectLockEnabledForBucket=True)
        until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
        locked = {}
        for k in range(4):
            key = f"l{k}"
            body = data(("lock", k), [3_000, 150_000][k % 2])
            extra = ({"ObjectLockMode": "COMPLIANCE", "ObjectLockRetainUntilDate": until} if k % 2 == 0
                     else {"ObjectLockLegalHoldStatus": "ON"})
            locked[key] = (cl.put_object(Bucket="drainlock", Key=key, Body=body, **extra)["VersionId"], body, k % 2)

        def check_locked(live):
            for n in live:
                c = n.client()
                for key, (vid, body, held) in locked.items():
                    assert c.get_object(Bucket="drainlock", Key=key, VersionId=vid)["Body"].read() == body, key
                    if held:
                        assert c.get_object_legal_hold(Bucket="drainlock", Key=key, VersionId=vid)["LegalHold"] == {"Status": "ON"}
                    else:
                        r = c.get_object_retention(Bucket="drainlock", Key=key, VersionId=vid)["Retention"]
                        assert r["Mode"] == "COMPLIANCE" and abs((r["RetainUntilDate"] - until).total_seconds()) < 1, r
            with pytest.raises(botocore.exceptions.ClientError) as e:
                live[0].client().delete_object(Bucket="drainlock", Key="l0", VersionId=locked["l0"][0])
            assert e.value.response["Error"]["Code"] == "AccessDenied"

        # Uploads begun before the drain, in a versioned bucket: their parts
        # stay in their key's pool until they end, and the drain waits.
        cl.create_bucket(Bucket="drainv")
        cl.put_bucket_versioning(Bucket="drainv", VersioningConfiguration={"Status": "Enabled"})
        uploads = {}
        for j in range(20):
            key = f"v{j:02}"
            first = data((key, 0), 40_000 + j)
            v1 = cl.put_object(Bucket="drainv", Key=key, Body=first)["VersionId"]
            mp = cl.create_multipart_upload(Bucket="drainv", Key=key)["UploadId"]
            body = data((key, 1), 60_000 + j)
            tag = cl.upload_part(Bucket="drainv", Key=key, UploadId=mp, PartNumber=1, Body=body)["ETag"]
            uploads[key] = (v1, first, mp, tag, body)

        def check_versions(through):
            for n in through:
                c = n.client()
                for key, (v1, first, _, _, body) in uploads.items():
                    vs = c.list_object_versions(Bucket="drainv", Prefix=key)["Versions"]
                    assert len(vs) == 2 and vs[1]["VersionId"] == v1, (key, vs)
                    assert c.get_object(Bucket="drainv", Key=key)["Body"].read() == body, key
                    assert c.get_object(Bucket="drainv", Key=key, VersionId=v1)["Body"].read() == first, key

        assert sum(node_shard_files(n) for n in more) > 0
        # Refusals: an unknown pool; (after the drain starts) draining the
        # last active pool.
        r = nodes[0].admin_cmd("pool", "drain", "7", check=False)
        assert r.returncode != 0 and "no pool 7" in r.stderr, r.stderr
        out = nodes[1].admin_cmd("pool", "drain", "1").stdout
        assert "pool 1 draining" in out, out
        r = nodes[1].admin_cmd("pool", "drain", "0", check=False)
        assert r.returncode != 0 and "only active pool" in r.stderr, r.stderr
        first = wait_for("a drain leader moving keys",
                         lambda: (lambda j: j if j and j["moved"] >= 3 else None)(drain_job(nodes[0])), timeout=60)
        leader = next(n for n in nodes if f"n{n.i}" == first["node"])
        # The same figures in the leader's /metrics (the others show none).
        assert metric(leader, "tarn_drain_running") == 1
        assert metric(leader, "tarn_drain_pool") == 1
        assert metric(leader, "tarn_drain_keys_moved") >= 3
        assert metric(leader, "tarn_drain_rate_bytes_per_second") > 0
        assert metric(next(n for n in nodes if n is not leader), "tarn_drain_running") == 0
        clients = [n for n in nodes[:4] if n is not leader][:3]
        load = Load(clients, "drain", writers=2, readers=2)
        try:
            # The leader killed mid-job: another resumes, with a larger token.
            leader.signal(signal.SIGKILL)
            leader.proc.wait()
            second = wait_for("another drain leader",
                              lambda: (lambda j: j if j and j["node"] != first["node"] else None)(drain_job(clients[0])),
                              timeout=60)
            assert second["token"] > first["token"], (first, second)
            resumed = next(n for n in nodes if f"n{n.i}" == second["node"])
            wait_for("the resumed drain logged",
                     lambda: log_has(resumed, "resuming a drain another leader began"), timeout=30)
            # Back before the next fault: two nodes out at once would take
            # pool 0's sets (2+2) below write quorum.
            leader.start()
            leader.wait_serving()
            # ...and synced, as every node sees it: with its drives offline or
            # still syncing (no reads) somewhere, a set that also loses the
            # next one (pool 1 has two nodes) would be out of quorum.
            for c in clients:
                wait_for(f"n{c.i} seeing the restarted node synced",
                         lambda c=c: set(drive_states(c)) == {"online"}, timeout=120)
            # The node leading now (that one, or another if its drain stopped
            # on the killed node's drives meanwhile and a new leader took over)
            # paused past its lease: another takes over; woken, the paused one
            # finds its token fenced off and stops.
            nxt, current = wait_for("the node leading the drain now", lambda: leading_drain(nodes), timeout=60)
            nxt.signal(signal.SIGSTOP)
            try:
                third = wait_for("a third drain leader",
                                 lambda: (lambda j: j if j and j["node"] != current["node"] else None)(
                                     drain_job(next(c for c in clients if c is not nxt))),
                                 timeout=60)
                assert third["token"] > current["token"], (current, third)
            finally:
                nxt.signal(signal.SIGCONT)
            wait_for("the paused leader fenced off",
                     lambda: log_has(nxt, f"lost the drain leadership (token {current['token']})"), timeout=30)
            watcher = next(c for c in clients if c is not nxt)
            # Every key moved, the drain waits for the uploads still in the
            # pool (its status says how many). Completed now, each commits
            # where its key lives, beside its first version: those whose
            # parts are in the draining pool have them copied there.
            wait_for("the drain waiting for the uploads",
                     lambda: any(log_has(n, "the drain waits for multipart uploads") for n in nodes), timeout=120)
            wait_for("the uploads in the drain's status",
                     lambda: (drain_job(watcher) or {}).get("uploads_in_pool", 0) > 0, timeout=30)
            cv = watcher.client()
            for key, (_, _, mp, tag, _) in uploads.items():
                cv.complete_multipart_upload(Bucket="drainv", Key=key, UploadId=mp, MultipartUpload={
                    "Parts": [{"PartNumber": 1, "ETag": tag}]})
            wait_for("an upload completed where its key lives now",
                     lambda: any(log_has(n, "an upload completed where its key lives now") for n in nodes),
                     timeout=10)
            wait_for("pool 1 retired",
                     lambda: [p["state"] for p in status(watcher)["pools"]] == ["active", "retired"], timeout=240)
        finally:
            load.finish()
        assert not load.failed, load.failed[:3]
        acked.update(load.acked)
        live = nodes
        # Nothing is left in the pool, and every object is readable and
        # listed through every node, the multipart ones with their ETags.
        # (Files a killed leader left between a record's removal and its
        # files' are swept by their nodes once the pool is retired.)
        wait_for("pool 1's shard files removed", lambda: sum(node_shard_files(n) for n in more) == 0, timeout=30)
        check_all_readable(live, "drain", acked)
        check_versions(live)
        check_sealed(live)
        check_locked(live)
        for key, e in etag.items():
            h = live[0].client().head_object(Bucket="drain", Key=key, PartNumber=1)
            assert h["ETag"] == e and h["ContentLength"] == 5 << 20, h
        # New objects go to pool 0 only; pool 1's nodes can be stopped and
        # everything stays readable.
        for n in more:
            n.stop()
        check_all_readable(nodes[:4], "drain", acked)
        check_versions(nodes[:4])
        check_sealed(nodes[:4])
        check_locked(nodes[:4])
    finally:
        stop_all(etcd, nodes)
