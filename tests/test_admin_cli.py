"""`tarn admin` for operators (issue 43): status, drives, heal jobs with
progress, jobs, and where the endpoint and token come from (flags, the
environment, a config file, the loopback defaults), against a live server
and a cluster."""

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request

from conftest import data
from tarnproc import BIN, SECRET_KEY, metric, wait_for


def run(*args, env=None, check=True):
    e = dict(os.environ)
    for k in ("TARN_ADMIN_TOKEN", "TARN_ADMIN_ENDPOINT", "TARN_ADMIN_CONFIG", "TARN_SECRET_KEY", "TARN_ACCESS_KEY"):
        e.pop(k, None)
    e["HOME"] = env.pop("HOME") if env and "HOME" in env else "/nonexistent"
    e.update(env or {})
    r = subprocess.run([BIN, "admin", *args], capture_output=True, text=True, timeout=120, env=e)
    if check:
        assert r.returncode == 0, f"tarn admin {args}: {r.stdout}\n{r.stderr}"
    return r


def test_status_drives_heal_and_jobs_on_the_loopback_defaults(server):
    s3 = server.client()
    s3.create_bucket(Bucket="ckpt")
    s3.create_bucket(Bucket="other")
    bodies = {f"step-{i}": data(i, 200_000 + i) for i in range(12)}
    for k, b in bodies.items():
        s3.put_object(Bucket="ckpt", Key=k, Body=b)
    s3.put_object(Bucket="other", Key="x", Body=data(99, 300_000))

    # No --token: a loopback endpoint gets the built-in secret this
    # server (no configured credentials) uses.
    st = json.loads(run("--endpoint", server.admin, "status", "--json").stdout)
    assert st["health"] == "ready" and st["mode"] == "single node"
    assert st["drives"] == {"total": 4, "online": 4, "offline": 0, "rebuilding": 0, "syncing": 0, "full": 0}
    assert st["capacity"]["total_bytes"] > st["capacity"]["free_bytes"] > 0
    assert st["buckets"] == 2 and st["uptime_seconds"] >= 0 and st["version"]
    human = run("--endpoint", server.admin, "status").stdout
    assert "health:     ready" in human and "drives:     4 (4 online)" in human, human

    drives = json.loads(run("--endpoint", server.admin, "drives", "--json").stdout)
    assert [d["state"] for d in drives] == ["online"] * 4
    for d in drives:
        assert d["total_bytes"] == d["used_bytes"] + d["free_bytes"] > 0
    # The same figures as /metrics.
    assert metric(server, "tarn_drive_total_bytes", drive=drives[0]["path"]) == drives[0]["total_bytes"]
    assert metric(server, "tarn_build_info") == 1
    assert metric(server, "tarn_uptime_seconds") > 0
    table = run("--endpoint", server.admin, "drives").stdout.splitlines()
    assert table[0].split() == ["SET", "STATE", "USED", "FREE", "SIZE", "DRIVE", "REASON"]
    assert len(table) == 5 and all("online" in row for row in table[1:])

    # A drive's shard directories removed by hand: a heal of one bucket
    # (followed to its end) rebuilds that bucket's shards and makes the
    # directories again; the other bucket waits for a full heal.
    shutil.rmtree(os.path.join(server.drives[1], "data"))
    r = run("--endpoint", server.admin, "heal", "--bucket", "ckpt", "--wait")
    assert "done in" in r.stdout and "12 healed" in r.stdout and "no failures" in r.stdout, r.stdout
    full = json.loads(run("--endpoint", server.admin, "heal", "--wait", "--json").stdout)
    assert full["state"] == "done" and full["bucket"] is None
    assert full["report"]["objects_healed"] == 1 and full["report"]["failures"] == 0
    assert full["objects_done"] == full["objects_total"] >= 13
    # Every object reads back whole from the healed drive's shards too.
    shutil.rmtree(os.path.join(server.drives[0], "data"))
    shutil.rmtree(os.path.join(server.drives[2], "data"))
    for k, b in bodies.items():
        assert s3.get_object(Bucket="ckpt", Key=k)["Body"].read() == b

    # A background job: started, then seen in `jobs` with its progress.
    started = json.loads(run("--endpoint", server.admin, "heal", "--json").stdout)
    assert started["kind"] == "heal" and started["id"].startswith("heal-")
    job = wait_for("the heal job to end", lambda: next(
        (j for j in json.loads(run("--endpoint", server.admin, "jobs", "--json").stdout)["jobs"]
         if j["id"] == started["id"] and j["state"] != "running"), None))
    # (Reads that met the missing shards queued heals of their own, so the
    # job may find some already rebuilt.)
    assert job["state"] == "done" and job["report"]["failures"] == 0
    assert job["objects_done"] == job["objects_total"]
    shutil.rmtree(os.path.join(server.drives[1], "data"))
    shutil.rmtree(os.path.join(server.drives[3], "data"))
    for k, b in bodies.items():
        assert s3.get_object(Bucket="ckpt", Key=k)["Body"].read() == b
    jobs = json.loads(run("--endpoint", server.admin, "jobs", "--json").stdout)["jobs"]
    assert {"heal", "lifecycle"} <= {j["kind"] for j in jobs}
    assert len([j for j in jobs if j["kind"] == "heal"]) == 3
    human = run("--endpoint", server.admin, "jobs").stdout
    assert human.splitlines()[0].split() == ["ID", "KIND", "STATE", "PROGRESS", "DETAIL"]
    assert started["id"] in human and "lifecycle" in human

    # A bucket that does not exist: an error, no job.
    r = run("--endpoint", server.admin, "heal", "--bucket", "nope", check=False)
    assert r.returncode != 0 and "404" in r.stderr and "nope" in r.stderr
    # Heal through the plain API still answers the report (scripts).
    req = urllib.request.Request(server.admin + "/admin/heal", method="POST",
                                 headers={"Authorization": f"Bearer {SECRET_KEY}"})
    report = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert report["failures"] == 0 and report["objects_scanned"] >= 13


def test_the_token_comes_from_flags_the_environment_or_a_config_file(make_server, tmp_path):
    secret = "operators-secret-0123456789"
    server = make_server(env={"TARN_ACCESS_KEY": "ops", "TARN_SECRET_KEY": secret})
    # The built-in secret is tried on loopback, and this server refuses it.
    r = run("--endpoint", server.admin, "status", check=False)
    assert r.returncode != 0 and "401" in r.stderr
    # Flag, TARN_ADMIN_TOKEN, TARN_SECRET_KEY.
    run("--endpoint", server.admin, "--token", secret, "status")
    run("--endpoint", server.admin, "status", env={"TARN_ADMIN_TOKEN": secret})
    run("--endpoint", server.admin, "status", env={"TARN_SECRET_KEY": secret})
    # A config file: endpoint and token; it must be private.
    cfg = tmp_path / "admin.toml"
    cfg.write_text(f'endpoint = "{server.admin}"\ntoken = "{secret}"\n')
    os.chmod(cfg, 0o644)
    r = run("--config", str(cfg), "status", check=False)
    assert r.returncode != 0 and "chmod 600" in r.stderr
    os.chmod(cfg, 0o600)
    assert "health:" in run("--config", str(cfg), "status").stdout
    # The default place: ~/.config/tarn/admin.toml.
    home = tmp_path / "home"
    (home / ".config/tarn").mkdir(parents=True)
    shutil.copy(cfg, home / ".config/tarn/admin.toml")
    os.chmod(home / ".config/tarn/admin.toml", 0o600)
    assert json.loads(run("status", "--json", env={"HOME": str(home)}).stdout)["health"] == "ready"
    # A flag wins over the file.
    r = run("--token", "wrong", "status", env={"HOME": str(home)}, check=False)
    assert r.returncode != 0 and "401" in r.stderr
    # A config file with a field it does not know is refused, not ignored.
    cfg.write_text(f'endpoint = "{server.admin}"\ntokne = "{secret}"\n')
    r = run("--config", str(cfg), "status", check=False)
    assert r.returncode != 0 and "tokne" in r.stderr
    # No token at all for an endpoint that is not loopback: said plainly.
    r = run("--endpoint", "http://10.255.255.1:9001", "status", check=False)
    assert r.returncode != 0 and "no admin token" in r.stderr


def test_cluster_status_drives_and_heal(formed_cluster):
    etcd, nodes = formed_cluster
    n0 = nodes[0]
    s3 = n0.client()
    s3.create_bucket(Bucket="shared")
    for i in range(8):
        s3.put_object(Bucket="shared", Key=f"k{i}", Body=data(i, 100_000))
    st = json.loads(n0.admin_cmd("status", "--json").stdout)
    assert st["mode"] == "cluster" and st["health"] == "ready"
    assert st["cluster"]["nodes"] == 4 and st["cluster"]["nodes_live"] == 4
    assert "4 of 4 nodes live" in n0.admin_cmd("status").stdout
    # A fresh cluster's drives are in sync within a moment (they check
    # their sets' missed-write logs first), and nothing warned.
    drives = wait_for("every drive online", lambda: (lambda d: all(x["state"] == "online" for x in d) and d)(
        json.loads(n0.admin_cmd("drives", "--json").stdout)), timeout=10)
    assert len(drives) == 8
    # This node's drives have their sizes.
    assert sum(1 for d in drives if d["total_bytes"]) >= 2
    r = n0.admin_cmd("heal", "--bucket", "shared", "--wait")
    assert "8 object(s) checked" in r.stdout and "no failures" in r.stdout, r.stdout
    jobs = json.loads(n0.admin_cmd("jobs", "--json").stdout)["jobs"]
    assert any(j["kind"] == "heal" and j["state"] == "done" for j in jobs)
    for n in nodes:
        warnings = [line for path in n.logs for line in open(path, errors="replace") if " WARN " in line]
        assert not warnings, f"a fresh cluster warned: {warnings}"

    # A node stopped with no request in flight: the others see its drives
    # offline within the documented time (a drive check every 2 s) and
    # say degraded; back, they are online again.
    gone = nodes[3]
    gone.stop()
    t0 = time.time()

    def away():
        d = json.loads(n0.admin_cmd("drives", "--json").stdout)
        off = [x for x in d if x["state"] == "offline"]
        return len(off) == 2 and off

    off = wait_for("the stopped node's drives offline", away, timeout=10)
    assert time.time() - t0 < 6, time.time() - t0
    assert all("does not answer" in x["reason"] for x in off), off
    ready = urllib.request.urlopen(n0.admin + "/health/ready", timeout=10).read().decode()
    assert ready.startswith("degraded: 2 of 8 drives"), ready
    st = json.loads(n0.admin_cmd("status", "--json").stdout)
    assert st["health"] == "degraded" and st["drives"]["offline"] == 2
    # Still serving: 2+2 sets lose at most two drives to one node.
    assert s3.get_object(Bucket="shared", Key="k3")["Body"].read() == data(3, 100_000)
    gone.start()
    gone.wait_serving()
    wait_for("the node's drives back online", lambda: all(
        x["state"] == "online" for x in json.loads(n0.admin_cmd("drives", "--json").stdout)), timeout=20)
    assert urllib.request.urlopen(n0.admin + "/health/ready", timeout=10).read().decode() == "ready\n"

    # Stopped again while writes go on through the other nodes (a restart
    # for an upgrade): no write fails, and no node logs an ERROR, as a node
    # that stops is no drive fault (before, every write in flight logged
    # its drives "faulty").
    stop, failures, written = threading.Event(), [], []

    def writer(node, w):
        c = node.client()
        i = 0
        while not stop.is_set():
            key = f"w{w}-{i}"
            try:
                c.put_object(Bucket="shared", Key=key, Body=data(key, 300_000))
                written.append(key)
            except Exception as e:
                failures.append(f"{key}: {e}")
            i += 1

    threads = [threading.Thread(target=writer, args=(nodes[w % 3], w)) for w in range(3)]
    for t in threads:
        t.start()
    time.sleep(1)
    gone.stop()
    time.sleep(3)
    stop.set()
    for t in threads:
        t.join()
    assert not failures and len(written) > 10, (failures[:3], len(written))
    for n in nodes[:3]:
        assert not n.errors(), f"n{n.i}: {n.errors()[:3]}"
    assert s3.get_object(Bucket="shared", Key=written[-1])["Body"].read() == data(written[-1], 300_000)
    gone.start()
    gone.wait_serving()


def test_nodes_started_before_etcd_wait_for_it(tmp_path):
    """Nodes and etcd started together (a Kubernetes pod, units without an
    order): a node whose etcd does not listen yet waits for it, saying so
    once, instead of exiting; the cluster then forms as usual."""
    import threading

    from clusterproc import Etcd, Node, init_and_serve, stop_all

    etcd = Etcd(str(tmp_path))
    etcd.stop()
    later = threading.Timer(2.0, etcd.start)
    later.start()
    nodes = []
    try:
        for i in range(1, 5):
            nodes.append(Node(str(tmp_path), i, etcd.url, drives=2))
        later.join()
        init_and_serve(nodes, 2, 2)
        s3 = nodes[1].client()
        s3.create_bucket(Bucket="after-etcd")
        s3.put_object(Bucket="after-etcd", Key="k", Body=b"v")
        assert nodes[3].client().get_object(Bucket="after-etcd", Key="k")["Body"].read() == b"v"
        first = open(nodes[0].logs[0], errors="replace").read()
        assert first.count("etcd does not answer yet: waiting for it") == 1, first[-2000:]
    finally:
        later.cancel()
        stop_all(etcd, nodes)
