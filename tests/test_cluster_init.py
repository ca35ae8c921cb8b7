"""Forming a cluster the way a deployment does (the Helm chart's init Job,
docs/kubernetes.md): `tarn admin cluster init --nodes N --wait
--if-not-formed` started with the nodes, waiting for the admin endpoint and
for N live nodes, forming once, and doing nothing when run again; and a
node that advertises a DNS name (a StatefulSet pod's) rather than an IP."""

import subprocess

import pytest

from clusterproc import Etcd, Node, node_shard_files, status, stop_all
from conftest import data
from tarnproc import BIN, SECRET_KEY


def init(admin, *extra, timeout=120):
    return [BIN, "admin", "--endpoint", admin, "--token", SECRET_KEY, "cluster", "init",
            "--data-shards", "2", "--parity-shards", "2", *extra, "--timeout", str(timeout)]


def test_an_init_job_waits_for_its_nodes_forms_once_and_names_resolve(tmp_path):
    # Nothing answers yet: without --wait a clear failure at once, with
    # --wait a failure when its time is up.
    r = subprocess.run(init("http://127.0.0.1:9", "--nodes", "4"), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "cannot form the cluster: connecting to http://127.0.0.1:9" in r.stderr
    r = subprocess.run(init("http://127.0.0.1:9", "--nodes", "4", "--wait", timeout=3), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "waiting: connecting" in r.stderr and "cannot form the cluster" in r.stderr

    etcd = Etcd(str(tmp_path))
    nodes = []
    try:
        # Node 1 advertises a DNS name; its RPC listener is on every address.
        nodes.append(Node(str(tmp_path), 1, etcd.url, advertise_host="localhost"))
        for i in (2, 3):
            nodes.append(Node(str(tmp_path), i, etcd.url))
        job = subprocess.Popen(init(nodes[0].admin, "--nodes", "4", "--wait", "--if-not-formed"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # Three of four: the job waits (it would have formed a 3-node cluster).
        with pytest.raises(subprocess.TimeoutExpired):
            job.wait(timeout=5)
        assert status(nodes[0])["formed"] is False
        nodes.append(Node(str(tmp_path), 4, etcd.url))
        out, err = job.communicate(timeout=60)
        assert job.returncode == 0, err
        assert "cluster formed" in out and "3 of 4 nodes registered and live" in err
        for n in nodes:
            n.wait_serving()
        # Run again (a Job retried, a second install): nothing changes.
        epoch = status(nodes[0])["epoch"]
        r = subprocess.run(init(nodes[1].admin, "--nodes", "4", "--wait", "--if-not-formed"), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and "already formed" in r.stdout, r.stderr
        r = subprocess.run(init(nodes[1].admin), capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "already formed" in r.stderr
        st = status(nodes[0])
        assert st["epoch"] == epoch
        (n1,) = [n for n in st["nodes"] if n["id"] == "n1"]
        assert n1["address"] == f"localhost:{nodes[0].rpc_port}" and n1["live"]
        # The other nodes reach n1's drives by its name: writes through them
        # put shards there, and every object reads back through n1.
        s3 = nodes[1].client()
        s3.create_bucket(Bucket="named")
        before = node_shard_files(nodes[0])
        bodies = {f"k{i}": data(f"named{i}", 200_000) for i in range(8)}
        for k, body in bodies.items():
            s3.put_object(Bucket="named", Key=k, Body=body)
        assert node_shard_files(nodes[0]) > before
        for k, body in bodies.items():
            assert nodes[0].client().get_object(Bucket="named", Key=k)["Body"].read() == body
        assert not any(n.errors() for n in nodes), [n.errors() for n in nodes]
    finally:
        stop_all(etcd, nodes)
