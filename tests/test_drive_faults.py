"""Drive faults seen and handled while running (issue 12, item 3, first part).

Before: a drive whose writes failed stayed "online" in /admin/drives and
metrics, /health/ready said ready, and every request kept trying it. Now an
I/O error on a drive takes it out (a log line, state "faulty" with the error
in /admin/drives, tarn_drive_online 0, /health/ready "degraded"), requests go
to the others, and the drive is probed every 2 s: once it works again it
rejoins without a restart and is healed.

The fault: the drive's shard directory made immutable (`chattr +i`), which
refuses writes even to root (tests run as root, which chmod does not stop).
"""

import os
import shutil
import subprocess
import time

import pytest
import requests

from tarnproc import SECRET_KEY

MiB = 1 << 20

pytestmark = pytest.mark.skipif(shutil.which("chattr") is None, reason="needs chattr (e2fsprogs)")


def drives(server):
    r = requests.get(f"{server.admin}/admin/drives", headers={"Authorization": f"Bearer {SECRET_KEY}"})
    return r.json()


def metric(server, name, drive=None):
    for line in requests.get(f"{server.admin}/metrics").text.splitlines():
        if line.startswith(name) and (drive is None or f'drive="{drive}"' in line):
            return float(line.split()[-1])
    raise AssertionError(f"no metric {name}")


def immutable(path, on):
    r = subprocess.run(["chattr", "-R", "+i" if on else "-i", path], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr does not work here: {r.stderr}")


def wait_for(what, cond, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_an_unwritable_drive_is_taken_out_and_rejoins(make_server):
    server = make_server(drives=4, expected_errors=[r"drive faulty", r"cannot create shard file", r"shard write failed",
                                                    r"metadata write failed", r"finishing shard file", r"drive offline",
                                                    r"erasure set is degraded", r"lost write quorum"])  # fmt: skip
    s3 = server.client()
    s3.create_bucket(Bucket="faults")
    before = {f"k{i}": os.urandom(3 * MiB + i) for i in range(3)}
    for k, b in before.items():
        s3.put_object(Bucket="faults", Key=k, Body=b)
    bad = server.drives[1]
    data_dir = os.path.join(bad, "data")
    immutable(data_dir, True)
    try:
        # The next write finds out; it still succeeds on the other three.
        during = {f"d{i}": os.urandom(3 * MiB + i) for i in range(3)}
        for k, b in during.items():
            s3.put_object(Bucket="faults", Key=k, Body=b)
        state = drives(server)[1]
        assert state["online"] is False and state["state"] == "faulty", state
        assert "not permitted" in state["reason"], state
        assert metric(server, "tarn_drive_online", bad) == 0
        assert metric(server, "tarn_drive_faults_total") == 1
        ready = requests.get(f"{server.admin}/health/ready")
        assert ready.status_code == 200 and ready.text.startswith("degraded"), ready.text
        assert "drive faulty" in open(server.logs[-1]).read()
        # Everything reads back meanwhile.
        for k, b in {**before, **during}.items():
            assert s3.get_object(Bucket="faults", Key=k)["Body"].read() == b
        # Still failing: it stays out, and says why.
        time.sleep(2.5)
        assert drives(server)[1]["state"] == "faulty"
    finally:
        immutable(data_dir, False)
    # Working again: it rejoins without a restart and is healed.
    wait_for("the drive to rejoin", lambda: drives(server)[1]["state"] == "online")
    assert metric(server, "tarn_drive_rejoins_total") == 1
    assert metric(server, "tarn_drive_online", bad) == 1
    wait_for("ready", lambda: requests.get(f"{server.admin}/health/ready").text == "ready\n")
    report = requests.post(f"{server.admin}/admin/heal", headers={"Authorization": f"Bearer {SECRET_KEY}"}).json()
    assert report["failures"] == 0, report
    assert metric(server, "tarn_shards_rebuilt_total") + report["shards_rebuilt"] >= len(during), report
    # The rejoined drive carries its share again: lose two others, read all
    # (the objects written while it was out need its rebuilt shards).
    server.stop()
    shutil.rmtree(server.drives[2])
    shutil.rmtree(server.drives[3])
    server.start()
    s3 = server.client()
    for k, b in {**before, **during}.items():
        assert s3.get_object(Bucket="faults", Key=k)["Body"].read() == b


def test_a_full_drive_keeps_serving_reads_and_deletes(tmp_path):
    from tarnproc import Server

    root = tmp_path / "full"
    small = root / "d1"
    small.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(small)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {r.stderr}")
    server = None
    try:
        cfg = tmp_path / "full.toml"
        cfg.write_text("drive_reserve_bytes = 4194304\n")
        server = Server(str(root), drives=4, extra_args=["--config", str(cfg)],
                        expected_errors=[r"drive full", r"no space left", r"shard write failed"])  # fmt: skip
        s3 = server.client()
        s3.create_bucket(Bucket="full")
        # ~1.5 MiB per object lands on each drive: the 40 MiB one fills up
        # after ~20 objects; the rest go to the other three (write quorum).
        bodies = {f"k{i:02}": os.urandom(3 * MiB + i) for i in range(32)}
        for k, b in bodies.items():
            s3.put_object(Bucket="full", Key=k, Body=b)
        state = drives(server)[1]
        assert state["online"] is True and state["state"] == "full", state
        ready = requests.get(f"{server.admin}/health/ready")
        assert ready.status_code == 200 and "full" in ready.text, ready.text
        # Still in service: reads, and DELETEs (which write metadata to it).
        for k, b in bodies.items():
            assert s3.get_object(Bucket="full", Key=k)["Body"].read() == b
        doomed = sorted(bodies)[:20]
        r = s3.delete_objects(Bucket="full", Delete={"Objects": [{"Key": k} for k in doomed]})
        assert sorted(d["Key"] for d in r["Deleted"]) == doomed and not r.get("Errors"), r
        for k in doomed:
            s3.delete_object(Bucket="full", Key=k)  # idempotent, and a single DELETE works too
        # The space came back: the drive takes new data again.
        wait_for("the drive to have room", lambda: drives(server)[1]["state"] == "online")
        s3.put_object(Bucket="full", Key="after", Body=b"x" * (3 * MiB))
        left = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="full")["Contents"])
        assert left == sorted((set(bodies) - set(doomed)) | {"after"})
        for k in left:
            if k != "after":
                assert s3.get_object(Bucket="full", Key=k)["Body"].read() == bodies[k]
    finally:
        if server is not None:
            server.stop()
        subprocess.run(["umount", str(small)], capture_output=True)


def test_a_wiped_drive_is_noticed_formatted_and_healed(make_server):
    server = make_server(drives=4, expected_errors=[r"drive faulty", r"drive offline", r"erasure set is degraded",
                                                    r"lost write quorum", r"metadata write failed",
                                                    r"shard write failed", r"cannot create shard file"])  # fmt: skip
    s3 = server.client()
    s3.create_bucket(Bucket="wipe")
    bodies = {f"k{i}": os.urandom(2 * MiB + i) for i in range(4)}
    for k, b in bodies.items():
        s3.put_object(Bucket="wipe", Key=k, Body=b)
    wiped = server.drives[1]
    # Everything on it goes, while the server runs (a replaced disk, a
    # mount that went away).
    for name in os.listdir(wiped):
        p = os.path.join(wiped, name)
        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    # Noticed within a couple of seconds, then formatted for its place and
    # brought back.
    wait_for("the wipe to be noticed", lambda: metric(server, "tarn_drive_faults_total") >= 1)
    wait_for("the drive to rejoin", lambda: drives(server)[1]["state"] == "online")
    assert "contents are gone" in open(server.logs[-1]).read()
    assert os.path.exists(os.path.join(wiped, ".tarn"))
    report = requests.post(f"{server.admin}/admin/heal", headers={"Authorization": f"Bearer {SECRET_KEY}"}).json()
    assert report["failures"] == 0, report
    # Its shards are back: with two other drives gone, everything reads.
    server.stop()
    shutil.rmtree(server.drives[2])
    shutil.rmtree(server.drives[3])
    server.start()
    s3 = server.client()
    for k, b in bodies.items():
        assert s3.get_object(Bucket="wipe", Key=k)["Body"].read() == b
