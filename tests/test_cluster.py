"""A real cluster: etcd (Debian's etcd-server) on a free loopback port and
four `tarn` nodes on 127.0.0.1-127.0.0.4, each with two drives, formed with
`tarn admin cluster init`, driven by boto3 and the aws CLI through different
nodes. Every process is stopped by its PID."""

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from conftest import data
from clusterproc import Etcd, Node, status
from tarnproc import ACCESS_KEY, SECRET_KEY, wait_for


@pytest.fixture
def cluster(tmp_path):
    etcd = Etcd(str(tmp_path))
    nodes = []
    try:
        nodes = [Node(str(tmp_path), i, etcd.url) for i in range(1, 5)]
        # Impossible: sets of 8 with at most one shard per node on 4 nodes.
        r = nodes[0].admin_cmd("cluster", "init", "--data-shards", "7", "--parity-shards", "1", check=False)
        assert r.returncode != 0 and "node" in r.stderr, r.stderr
        out = nodes[1].admin_cmd("cluster", "init", "--data-shards", "2", "--parity-shards", "2").stdout
        assert "cluster formed: epoch 1" in out, out
        r = nodes[2].admin_cmd("cluster", "init", "--data-shards", "2", "--parity-shards", "2", check=False)
        assert r.returncode != 0 and "already formed" in r.stderr, r.stderr
        for n in nodes:
            n.wait_serving()
        yield etcd, nodes
    finally:
        for n in nodes:
            n.stop()
        etcd.stop()


def test_cluster_status_and_placement(cluster):
    _, nodes = cluster
    st = status(nodes[3])
    assert st["formed"] and st["epoch"] == 1
    assert sorted(st["live"]) == ["n1", "n2", "n3", "n4"]
    assert {n["id"] for n in st["nodes"]} == {"n1", "n2", "n3", "n4"}
    sets = st["pools"][0]["sets"]
    assert len(sets) == 2
    for s in sets:
        per_node = {}
        for d in s:
            per_node[d["node"]] = per_node.get(d["node"], 0) + 1
        assert max(per_node.values()) <= 2
    assert all(d["online"] for d in st["drives_seen_from_here"])
    text = nodes[0].admin_cmd("cluster", "status").stdout
    assert "n4" in text and "live" in text and "2+2" in text
    for n in nodes:
        assert not n.errors(), n.errors()


def test_cluster_round_trips_through_every_node(cluster, tmp_path):
    _, nodes = cluster
    c = [n.client() for n in nodes]
    c[0].create_bucket(Bucket="models")
    # A bucket made through node 1 is there at once on every other node.
    for x in c[1:]:
        x.head_bucket(Bucket="models")
    sizes = [0, 1, 4096, (1 << 20) + 1, 8 << 20, 100 << 20]
    for j, size in enumerate(sizes):
        body = data(size, size)
        c[j % 4].put_object(Bucket="models", Key=f"obj/{size}", Body=body)
        for k in range(4):
            if k != j % 4:
                got = c[k].get_object(Bucket="models", Key=f"obj/{size}")["Body"].read()
                assert got == body, (size, k)
    # Multipart: started on node 1, parts through nodes 2 and 3, completed on 4.
    up = c[0].create_multipart_upload(Bucket="models", Key="mp")["UploadId"]
    parts = []
    p1, p2 = data("p1", 5 << 20), data("p2", 3 << 20)
    for n, (cl, body) in enumerate([(c[1], p1), (c[2], p2)], start=1):
        e = cl.upload_part(Bucket="models", Key="mp", UploadId=up, PartNumber=n, Body=body)["ETag"]
        parts.append({"PartNumber": n, "ETag": e})
    c[3].complete_multipart_upload(Bucket="models", Key="mp", UploadId=up, MultipartUpload={"Parts": parts})
    assert c[0].get_object(Bucket="models", Key="mp")["Body"].read() == p1 + p2
    # Listing merged across sets and nodes, with a delimiter.
    want = sorted([f"obj/{s}" for s in sizes] + ["mp"])
    for cl in c:
        got = [o["Key"] for o in cl.list_objects_v2(Bucket="models")["Contents"]]
        assert got == want
        top = cl.list_objects_v2(Bucket="models", Delimiter="/")
        assert [p["Prefix"] for p in top["CommonPrefixes"]] == ["obj/"]
    # Deleted through node 3: gone on every node at once.
    c[2].delete_object(Bucket="models", Key="obj/1")
    for cl in c:
        with pytest.raises(cl.exceptions.NoSuchKey):
            cl.get_object(Bucket="models", Key="obj/1")
    # The aws CLI through node 4.
    src = tmp_path / "cli.bin"
    src.write_bytes(data("cli", 3 << 20))
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               AWS_DEFAULT_REGION="us-east-1")
    aws = os.path.join(os.path.dirname(os.path.realpath(__import__("sys").executable)), "aws")
    subprocess.run([aws, "--endpoint-url", nodes[3].endpoint, "s3", "cp", str(src), "s3://models/cli.bin"],
                   check=True, env=env, capture_output=True)
    assert c[1].get_object(Bucket="models", Key="cli.bin")["Body"].read() == src.read_bytes()
    for n in nodes:
        assert not n.errors(), n.errors()


def test_cluster_concurrent_clients(cluster):
    _, nodes = cluster
    nodes[0].client().create_bucket(Bucket="many")
    failures = []

    def worker(w):
        try:
            put = nodes[w % 4].client()
            get = nodes[(w + 1) % 4].client()
            for j in range(4):
                body = data((w, j), 1000 + w * 5000 + j)
                put.put_object(Bucket="many", Key=f"w{w}/{j}", Body=body)
                assert get.get_object(Bucket="many", Key=f"w{w}/{j}")["Body"].read() == body
        except Exception as e:  # noqa: BLE001
            failures.append(f"{w}: {e!r}")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    keys = []
    for page in nodes[2].client().get_paginator("list_objects_v2").paginate(Bucket="many"):
        keys += [o["Key"] for o in page.get("Contents", [])]
    assert len(keys) == 32 * 4
    for n in nodes:
        assert not n.errors(), n.errors()


def run_threads(n, worker):
    failures = []

    def guarded(w):
        try:
            worker(w)
        except Exception as e:  # noqa: BLE001
            failures.append(f"{w}: {e!r}")
    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures


def code_of(e):
    return e.response["Error"]["Code"] if hasattr(e, "response") else repr(e)


def test_cluster_one_key_through_many_nodes(cluster):
    """Writers of one key on different nodes exclude each other as on one
    node: one conditional create wins, compare-and-swap on the ETag loses no
    update, and a reader streaming an object through one node reads it whole
    while another node replaces it."""
    _, nodes = cluster
    nodes[0].client().create_bucket(Bucket="race")

    wins, lost = [], []

    def create(w):
        body = data(("once", w), 3000 + w)
        try:
            nodes[w % 4].client().put_object(Bucket="race", Key="once", Body=body, IfNoneMatch="*")
            wins.append(body)
        except Exception as e:  # noqa: BLE001
            lost.append(code_of(e))
    run_threads(16, create)
    assert len(wins) == 1 and lost == ["PreconditionFailed"] * 15, (len(wins), lost)
    for n in nodes:
        assert n.client().get_object(Bucket="race", Key="once")["Body"].read() == wins[0]

    nodes[1].client().put_object(Bucket="race", Key="counter", Body=b"0")
    increments = 5

    def count(w):
        cl = nodes[w % 4].client()
        done = 0
        while done < increments:
            r = cl.get_object(Bucket="race", Key="counter")
            value = int(r["Body"].read())
            try:
                cl.put_object(Bucket="race", Key="counter", Body=str(value + 1).encode(),
                              IfMatch=r["ETag"])
                done += 1
            except Exception as e:  # noqa: BLE001
                if code_of(e) != "PreconditionFailed":
                    raise
    run_threads(8, count)
    final = nodes[3].client().get_object(Bucket="race", Key="counter")["Body"].read()
    assert int(final) == 8 * increments

    # A multipart object (its parts are separate shard files, opened as the
    # reader reaches them) read slowly through node 2 while node 3 replaces
    # it and node 4 deletes it: the reader gets the version it started.
    writer = nodes[0].client()
    part = 5 << 20
    original = data("slow", 4 * part)
    up = writer.create_multipart_upload(Bucket="race", Key="slow")
    parts = [{"PartNumber": i + 1, "ETag": writer.upload_part(
        Bucket="race", Key="slow", UploadId=up["UploadId"], PartNumber=i + 1,
        Body=original[i * part:(i + 1) * part])["ETag"]} for i in range(4)]
    writer.complete_multipart_upload(Bucket="race", Key="slow", UploadId=up["UploadId"],
                                     MultipartUpload={"Parts": parts})
    stream = nodes[1].client().get_object(Bucket="race", Key="slow")["Body"]
    got = [stream.read(1 << 20)]
    replacer = nodes[2].client()
    for i in range(3):
        replacer.put_object(Bucket="race", Key="slow", Body=data(("new", i), 6 << 20))
    nodes[3].client().delete_object(Bucket="race", Key="slow")
    while True:
        chunk = stream.read(1 << 20)
        if not chunk:
            break
        got.append(chunk)
        time.sleep(0.05)
    assert b"".join(got) == original
    for n in nodes:
        assert not n.errors(), n.errors()


def test_cluster_gateway_stores_nothing(cluster, tmp_path):
    """A node started with --no-drives after the cluster formed serves S3
    over the others' drives, holds none itself, and shows so in status."""
    etcd, nodes = cluster
    gw = Node(str(tmp_path), 5, etcd.url, drives=0)
    try:
        gw.wait_serving()
        st = status(gw)
        me = [n for n in st["nodes"] if n["id"] == "n5"]
        assert me and me[0]["drives"] == [] and me[0]["live"], st["nodes"]
        assert all(len(d) == 2 for d in [n["drives"] for n in st["nodes"] if n["id"] != "n5"])
        c = gw.client()
        c.create_bucket(Bucket="via-gw")
        bodies = {f"k{i}": data(("gw", i), size) for i, size in enumerate([0, 100, 300_000, 9 << 20])}
        for k, b in bodies.items():
            c.put_object(Bucket="via-gw", Key=k, Body=b)
            assert nodes[i_of(k) % 4].client().get_object(Bucket="via-gw", Key=k)["Body"].read() == b
        nodes[2].client().put_object(Bucket="via-gw", Key="from-n3", Body=b"n3")
        assert c.get_object(Bucket="via-gw", Key="from-n3")["Body"].read() == b"n3"
        keys = [o["Key"] for o in c.list_objects_v2(Bucket="via-gw")["Contents"]]
        assert keys == sorted([*bodies, "from-n3"])
        c.delete_object(Bucket="via-gw", Key="k1")
        with pytest.raises(Exception):
            nodes[0].client().head_object(Bucket="via-gw", Key="k1")
        # Nothing of it on the gateway's side: no drive, no data files.
        stored = [f for _, _, fs in os.walk(gw.root) for f in fs if not f.endswith(".log")]
        assert stored == [], stored
        assert not gw.errors(), gw.errors()
    finally:
        gw.stop()


def i_of(key):
    return int(key[1:]) if key[1:].isdigit() else 0


def write_load(nodes, bucket, stop, acked, failed):
    """Writers through the given nodes until `stop`; what was acknowledged."""
    def worker(w):
        cl = nodes[w % len(nodes)].client()
        j = 0
        while not stop.is_set():
            key = f"w{w}/{j}"
            body = data(key, 50_000 + 7919 * (j % 40))
            try:
                cl.put_object(Bucket=bucket, Key=key, Body=body)
                acked[key] = body
            except Exception as e:  # noqa: BLE001
                failed.append(repr(e))
            j += 1
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    return threads


def check_readable(nodes, bucket, acked):
    """Every acknowledged object reads back whole through every given node;
    the listing equals what is readable."""
    cl = nodes[0].client()
    listed = set()
    for page in cl.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        listed |= {o["Key"] for o in page.get("Contents", [])}
    assert set(acked) <= listed
    for key in listed:
        body = cl.get_object(Bucket=bucket, Key=key)["Body"].read()
        if key in acked:
            assert body == acked[key], key
        else:
            # Written but not acknowledged (in flight at the kill): whole.
            assert body == data(key, len(body)), key
    for n in nodes[1:]:
        c = n.client()
        for key in list(acked)[::7]:
            assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == acked[key]


FAULT_ERRORS = re.compile(r"drive faulty|failed on a drive|shard write failed|cannot create shard|"
                          r"finishing shard|lost write quorum|heal")


def test_cluster_node_killed_during_writes(cluster):
    _, nodes = cluster
    nodes[0].client().create_bucket(Bucket="load")
    stop, acked, failed = threading.Event(), {}, []
    threads = write_load(nodes[:3], "load", stop, acked, failed)
    time.sleep(2)
    nodes[3].signal(signal.SIGKILL)
    nodes[3].proc.wait()
    time.sleep(4)
    stop.set()
    for t in threads:
        t.join()
    assert len(acked) > 20
    check_readable(nodes[:3], "load", acked)
    # With the node still down: multipart across the others, copy, delete.
    up_node, done_node = nodes[1].client(), nodes[2].client()
    part = 5 << 20
    body = data("mp-down", 2 * part + 777)
    up = up_node.create_multipart_upload(Bucket="load", Key="mp-down")
    parts = []
    for i in range(3):
        c = [up_node, done_node, nodes[0].client()][i]
        r = c.upload_part(Bucket="load", Key="mp-down", UploadId=up["UploadId"], PartNumber=i + 1,
                          Body=body[i * part:(i + 1) * part])
        parts.append({"PartNumber": i + 1, "ETag": r["ETag"]})
    done_node.complete_multipart_upload(Bucket="load", Key="mp-down", UploadId=up["UploadId"],
                                        MultipartUpload={"Parts": parts})
    assert nodes[0].client().get_object(Bucket="load", Key="mp-down")["Body"].read() == body
    done_node.copy_object(Bucket="load", Key="mp-copy", CopySource={"Bucket": "load", "Key": "mp-down"})
    assert up_node.get_object(Bucket="load", Key="mp-copy")["Body"].read() == body
    up_node.delete_object(Bucket="load", Key="mp-copy")
    listed = {o["Key"] for p in nodes[0].client().get_paginator("list_objects_v2").paginate(Bucket="load")
              for o in p.get("Contents", [])}
    assert "mp-down" in listed and "mp-copy" not in listed
    for n in nodes[:3]:
        assert not [e for e in n.errors() if not FAULT_ERRORS.search(e)]


def test_cluster_node_paused(cluster):
    _, nodes = cluster
    nodes[0].client().create_bucket(Bucket="paused")
    stop, acked, failed = threading.Event(), {}, []
    threads = write_load(nodes[:3], "paused", stop, acked, failed)
    time.sleep(1)
    nodes[3].signal(signal.SIGSTOP)
    # The others route around it: writes go on (the clients' read timeout,
    # 30 s, bounds any request that would hang on the paused node).
    n_before = len(acked)
    time.sleep(12)
    assert len(acked) > n_before + 10, (n_before, len(acked), failed[:3])
    stop.set()
    for t in threads:
        t.join()
    assert not failed, failed[:3]
    check_readable(nodes[:3], "paused", acked)
    nodes[3].signal(signal.SIGCONT)
    check_readable([nodes[3]], "paused", acked)


def bucket_known(cl, name):
    try:
        cl.head_bucket(Bucket=name)
        return True
    except cl.exceptions.ClientError:
        return False


def test_cluster_serves_while_etcd_is_stopped(cluster):
    etcd, nodes = cluster
    c = [n.client() for n in nodes]
    c[0].create_bucket(Bucket="noetcd")
    # Bucket records reach the other nodes through their etcd watch, which
    # is asynchronous: every node knows the bucket before etcd goes away.
    for cl in c:
        wait_for("the bucket known everywhere", lambda cl=cl: bucket_known(cl, "noetcd"), timeout=10)
    etcd.proc.send_signal(signal.SIGSTOP)
    try:
        for i in range(8):
            body = data(("e", i), 100_000 + i)
            c[i % 4].put_object(Bucket="noetcd", Key=f"k{i}", Body=body)
            assert c[(i + 1) % 4].get_object(Bucket="noetcd", Key=f"k{i}")["Body"].read() == body
        assert len(c[2].list_objects_v2(Bucket="noetcd")["Contents"]) == 8
        # What needs etcd fails clearly, not silently.
        with pytest.raises(Exception) as e:
            c[1].create_bucket(Bucket="needs-etcd")
        assert "503" in str(e.value) or "ServiceUnavailable" in str(e.value)
    finally:
        etcd.proc.send_signal(signal.SIGCONT)
    c[1].create_bucket(Bucket="after-etcd")
    c[2].head_bucket(Bucket="after-etcd")
