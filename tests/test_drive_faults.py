"""Drive faults seen and handled while running (issue 12, items 3 and 4).

Before: a drive whose writes failed stayed "online" in /admin/drives and
metrics, /health/ready said ready, and every request kept trying it. Now an
I/O error on a drive takes it out (a log line, state "faulty" with the error
in /admin/drives, tarn_drive_online 0, /health/ready "degraded"), requests go
to the others, and the drive is probed every 2 s: once it works again it
rejoins without a restart and is healed.

The fault: the drive's shard directory made immutable (`chattr +i`), which
refuses writes even to root (tests run as root, which chmod does not stop).
"""

import contextlib
import os
import shutil
import subprocess
import time

import botocore.exceptions
import pytest
import requests

from tarnproc import SECRET_KEY, Server, metric, wait_for

MiB = 1 << 20



def drives(server):
    r = requests.get(f"{server.admin}/admin/drives", headers={"Authorization": f"Bearer {SECRET_KEY}"})
    return r.json()


def immutable(path, on):
    if shutil.which("chattr") is None:
        pytest.skip("needs chattr (e2fsprogs)")
    r = subprocess.run(["chattr", "-R", "+i" if on else "-i", path], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr does not work here: {r.stderr}")


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


@contextlib.contextmanager
def server_with_small_drive(tmp_path, name, extra_args=(), expected_errors=()):
    """Four drives, the second a 40 MiB tmpfs: (server, its mount point)."""
    root = tmp_path / name
    small = root / "d1"
    small.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(small)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small filesystem here: {r.stderr}")
    server = None
    try:
        server = Server(str(root), drives=4, extra_args=extra_args, expected_errors=expected_errors)
        yield server, small
    finally:
        if server is not None:
            server.stop()
        subprocess.run(["umount", str(small)], capture_output=True)


def test_a_full_drive_keeps_serving_reads_and_deletes(tmp_path):
    cfg = tmp_path / "full.toml"
    cfg.write_text("drive_reserve_bytes = 4194304\n")
    errors = [r"drive full", r"no space left", r"shard write failed"]
    with server_with_small_drive(tmp_path, "full", ["--config", str(cfg)], errors) as (server, _):
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



def test_a_drive_offline_at_start_joins_once_mounted(make_server):
    server = make_server(drives=4, expected_errors=[r"drive offline", r"erasure set is degraded", r"lost write quorum"])
    s3 = server.client()
    s3.create_bucket(Bucket="late")
    before = {f"k{i}": os.urandom(2 * MiB + i) for i in range(3)}
    for k, b in before.items():
        s3.put_object(Bucket="late", Key=k, Body=b)
    server.stop()
    late = server.drives[3]
    os.rename(late, late + ".unmounted")
    server.start()
    s3 = server.client()
    assert drives(server)[3]["state"] == "offline"
    during = {f"d{i}": os.urandom(2 * MiB + i) for i in range(3)}
    for k, b in during.items():
        s3.put_object(Bucket="late", Key=k, Body=b)
    # Mounted again while running: it joins without a restart, catches up
    # on what it missed, and serves reads once healed.
    os.rename(late + ".unmounted", late)
    wait_for("the drive to join", lambda: drives(server)[3]["state"] == "online")
    assert metric(server, "tarn_drive_rejoins_total") == 1
    report = heal(server)
    assert report["failures"] == 0, report
    server.stop()
    shutil.rmtree(server.drives[1])
    shutil.rmtree(server.drives[2])
    server.start()
    s3 = server.client()
    for k, b in {**before, **during}.items():
        assert s3.get_object(Bucket="late", Key=k)["Body"].read() == b

# ---------------------------------------------------------------------------
# A corrupt drive index is set aside and rebuilt by heal while the node
# serves (issue 12, item 4), and an index write that failed for lack of space
# is recovered by reopening the index (item 3).
#
# Before: one flipped byte in a drive's metadata index (fjall's journal or
# tables) kept that drive offline for good ("open metadata index:
# ChecksumMismatch"), and heal could not touch it; a journal write that failed
# with ENOSPC left the index refusing every later write ("Poisoned") until a
# restart. Now a damaged index is moved to `.tarn/meta.corrupt`, a fresh one is
# opened and the drive is "rebuilding": it takes every write and serves its
# shards but answers no metadata reads until a heal filled it from the other
# drives of its set (records, inline copies, uploads in progress). A rebuild
# that cannot finish (too few other drives) answers 503, never a wrong 404, and
# survives a restart.

EXPECTED = [r"metadata index corrupt", r"drive offline", r"erasure set is degraded", r"lost write quorum",
            r"drive faulty", r"metadata write failed", r"shard write failed", r"cannot create shard file",
            r"internal error", r"index not rebuilt", r"heal failed", r"listing keys to heal failed",
            r"healing bucket records failed", r"copying uploads"]  # fmt: skip


def heal(server):
    return requests.post(f"{server.admin}/admin/heal", headers={"Authorization": f"Bearer {SECRET_KEY}"}).json()


def flip_journal_byte(drive, where=0.5):
    """Flips one byte in the written part of the drive's index journal."""
    meta = os.path.join(drive, ".tarn", "meta")
    journals = sorted(f for f in os.listdir(meta) if f.endswith(".jnl"))
    assert journals, os.listdir(meta)
    path = os.path.join(meta, journals[-1])
    with open(path, "r+b") as f:
        data = f.read()
        written = len(data.rstrip(b"\0"))
        assert written > 1000, written
        at = int(written * where)
        f.seek(at)
        f.write(bytes([data[at] ^ 0x5A]))


def fill(s3):
    """Objects of every kind: erasure-coded, inline, versions, and an upload
    in progress. Returns what must read back."""
    s3.create_bucket(Bucket="idx")
    s3.create_bucket(Bucket="ver")
    s3.put_bucket_versioning(Bucket="ver", VersioningConfiguration={"Status": "Enabled"})
    bodies = {f"big{i}": os.urandom(3 * MiB + i) for i in range(3)}
    bodies.update({f"small{i}": os.urandom(100 + i) for i in range(20)})
    for k, b in bodies.items():
        s3.put_object(Bucket="idx", Key=k, Body=b)
    versions = []
    for i in range(3):
        b = os.urandom(2000 + i)
        vid = s3.put_object(Bucket="ver", Key="doc", Body=b)["VersionId"]
        versions.append((vid, b))
    up = s3.create_multipart_upload(Bucket="idx", Key="pending")["UploadId"]
    part = os.urandom(5 * MiB)
    etag = s3.upload_part(Bucket="idx", Key="pending", UploadId=up, PartNumber=1, Body=part)["ETag"]
    return bodies, versions, (up, etag, part)


def check_all(s3, bodies, versions, upload):
    for k, b in bodies.items():
        assert s3.get_object(Bucket="idx", Key=k)["Body"].read() == b, k
    for vid, b in versions:
        assert s3.get_object(Bucket="ver", Key="doc", VersionId=vid)["Body"].read() == b
    listed = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="idx")["Contents"])
    assert listed == sorted(bodies)
    up, etag, _ = upload
    uploads = s3.list_multipart_uploads(Bucket="idx").get("Uploads", [])
    assert [(u["Key"], u["UploadId"]) for u in uploads] == [("pending", up)]
    parts = s3.list_parts(Bucket="idx", Key="pending", UploadId=up)["Parts"]
    assert [(p["PartNumber"], p["ETag"]) for p in parts] == [(1, etag)]


def lose_two_others_and_check(server, bodies, versions, upload):
    """After a heal that finds nothing to fail, the rebuilt drive carries its
    share: with two other drives of the set gone, everything reads from it
    and one more."""
    report = heal(server)
    assert report["failures"] == 0, report
    server.stop()
    shutil.rmtree(server.drives[2])
    shutil.rmtree(server.drives[3])
    server.start()
    check_all(server.client(), bodies, versions, upload)


def test_a_corrupt_index_found_at_start_is_rebuilt_by_heal(make_server):
    server = make_server(drives=4, expected_errors=EXPECTED)
    bodies, versions, upload = fill(server.client())
    server.stop()
    bad = server.drives[1]
    flip_journal_byte(bad)
    server.start()
    log = open(server.logs[-1]).read()
    assert "metadata index corrupt" in log and "ChecksumMismatch" in log, log
    # Rebuilt while serving, without a restart or an operator.
    wait_for("the rebuild", lambda: drives(server)[1]["state"] == "online")
    assert metric(server, "tarn_index_corruptions_total") == 1
    assert metric(server, "tarn_index_rebuilds_total") == 1
    assert metric(server, "tarn_drive_rebuilding", bad) == 0
    assert os.path.isdir(os.path.join(bad, ".tarn", "meta.corrupt"))
    assert not os.path.exists(os.path.join(bad, ".tarn", "rebuilding"))
    s3 = server.client()
    check_all(s3, bodies, versions, upload)
    lose_two_others_and_check(server, bodies, versions, upload)


def test_an_index_corrupted_while_serving_is_rebuilt_when_reopened(make_server):
    server = make_server(drives=4, expected_errors=EXPECTED)
    s3 = server.client()
    bodies, versions, upload = fill(s3)
    bad = server.drives[1]
    # Damaged on disk under the running server...
    flip_journal_byte(bad)
    # ...which finds out when the drive next opens its index: after an I/O
    # fault (its shard directory refuses writes) it is reopened to rejoin.
    data_dir = os.path.join(bad, "data")
    immutable(data_dir, True)
    try:
        during = os.urandom(3 * MiB)
        s3.put_object(Bucket="idx", Key="during", Body=during)
        bodies["during"] = during
        assert drives(server)[1]["state"] == "faulty"
    finally:
        immutable(data_dir, False)
    wait_for("the corrupt index to be found", lambda: metric(server, "tarn_index_corruptions_total") == 1)
    wait_for("the rebuild", lambda: drives(server)[1]["state"] == "online")
    assert metric(server, "tarn_index_rebuilds_total") >= 1
    assert os.path.isdir(os.path.join(bad, ".tarn", "meta.corrupt"))
    # Written while it rebuilt, and everything before.
    check_all(s3, bodies, versions, upload)
    lose_two_others_and_check(server, bodies, versions, upload)


def test_a_rebuild_without_enough_sources_answers_503_and_resumes_after_restart(make_server):
    server = make_server(drives=4, expected_errors=EXPECTED)
    bodies, versions, upload = fill(server.client())
    server.stop()
    flip_journal_byte(server.drives[1])
    # Two other drives of the set are missing: only one readable drive is
    # left to heal from, fewer than a read quorum.
    for d in server.drives[2:]:
        os.rename(d, d + ".away")
    server.start()
    state = drives(server)
    assert state[1]["state"] == "rebuilding", state
    assert metric(server, "tarn_drive_rebuilding", server.drives[1]) == 1
    ready = requests.get(f"{server.admin}/health/ready")
    assert ready.status_code == 503, ready.text
    # Its fresh index lacks every record: reads are refused, never answered
    # from it as "no such key".
    s3 = server.client()
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="idx", Key="small0")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503, e.value.response
    server.stop()
    assert os.path.exists(os.path.join(server.drives[1], ".tarn", "rebuilding"))
    for d in server.drives[2:]:
        os.rename(d + ".away", d)
    # After a restart the rebuild goes on (the marker survived); it does not
    # trust the fresh index.
    server.start()
    wait_for("the rebuild", lambda: drives(server)[1]["state"] == "online")
    check_all(server.client(), bodies, versions, upload)
    lose_two_others_and_check(server, bodies, versions, upload)


def test_an_index_write_that_ran_out_of_space_is_reopened(tmp_path):
    errors = EXPECTED + [r"no space left", r"drive full", r"No space left", r"persist failed"]
    with server_with_small_drive(tmp_path, "enospc", (), errors) as (server, small):
        s3 = server.client()
        s3.create_bucket(Bucket="nospc")
        before = {f"a{i}": os.urandom(200 + i) for i in range(5)}
        for k, b in before.items():
            s3.put_object(Bucket="nospc", Key=k, Body=b)
        # Something else fills the drive's filesystem to the last block.
        filler = small / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)
        # Small objects are metadata only: the index's journal write fails.
        during = {f"b{i}": os.urandom(64 * 1024 + i) for i in range(20)}
        for k, b in during.items():
            s3.put_object(Bucket="nospc", Key=k, Body=b)
        state = drives(server)[1]
        assert state["state"] == "faulty" and "No space left" in state["reason"], state
        # Space comes back: the index is reopened (its journal recovered) and
        # takes writes again, with no restart.
        filler.unlink()
        wait_for("the drive to rejoin", lambda: drives(server)[1]["state"] == "online")
        after = {f"c{i}": os.urandom(300 + i) for i in range(5)}
        for k, b in after.items():
            s3.put_object(Bucket="nospc", Key=k, Body=b)
        assert drives(server)[1]["state"] == "online"
        report = heal(server)
        assert report["failures"] == 0, report
        everything = {**before, **during, **after}
        server.stop()
        shutil.rmtree(server.drives[2])
        shutil.rmtree(server.drives[3])
        server.start()
        s3 = server.client()
        for k, b in everything.items():
            assert s3.get_object(Bucket="nospc", Key=k)["Body"].read() == b, k


def test_a_single_drive_salvages_its_damaged_index(make_server):
    """Alone in its set there is nothing to heal from: what the damaged index
    still holds is salvaged (its journal cut before the damaged batch), the
    rest is lost, nothing is served wrong, and the node serves again."""
    server = make_server(drives=1, expected_errors=[r"metadata index corrupt", r"salvaged", r"NoSuchKey"])
    s3 = server.client()
    s3.create_bucket(Bucket="alone")
    bodies = {f"k{i:02}": os.urandom(150 + i) for i in range(40)}
    bodies.update({f"big{i}": os.urandom(2 * MiB + i) for i in range(2)})
    for k, b in bodies.items():
        s3.put_object(Bucket="alone", Key=k, Body=b)
    server.stop()
    flip_journal_byte(server.drives[0], where=0.8)
    server.start()
    log = open(server.logs[-1]).read()
    assert "salvaged the damaged index up to where its journal is damaged" in log, log
    wait_for("the salvaged drive", lambda: drives(server)[0]["state"] == "online")
    assert requests.get(f"{server.admin}/health/ready").text == "ready\n"
    s3 = server.client()
    kept = 0
    for k, b in bodies.items():
        try:
            got = s3.get_object(Bucket="alone", Key=k)["Body"].read()
        except botocore.exceptions.ClientError as e:
            assert e.response["Error"]["Code"] == "NoSuchKey", e.response
            continue
        assert got == b, k
        kept += 1
    # Written in order: everything before the damaged point survives.
    assert kept >= 25, kept
    assert all(s3.head_object(Bucket="alone", Key=f"k{i:02}") for i in range(20))
    # The set-aside index is kept for inspection, and the files of the lost
    # records with it (no orphan sweep while it is there).
    assert os.path.isdir(os.path.join(server.drives[0], ".tarn", "meta.corrupt"))
    report = heal(server)
    assert report["failures"] == 0 and report["orphans_removed"] == 0, report
    s3.put_object(Bucket="alone", Key="after", Body=b"new")
    server.stop()
    server.start()
    assert drives(server)[0]["state"] == "online"
    assert server.client().get_object(Bucket="alone", Key="after")["Body"].read() == b"new"


@pytest.mark.parametrize("how", ["whole", "range", "close"])
def test_a_get_that_fails_after_its_headers_resets_the_connection(tmp_path, how):
    # Issue 40, item 9: a GET whose object cannot be read once its headers
    # are out must end in a reset, never a clean end a client could take for
    # the whole (short) body. Every shard file is cut to nothing under a GET
    # that is reading slowly.
    import glob
    import socket

    from sigv4 import raw_head

    server = Server(str(tmp_path), drives=4, expected_errors=[r"read failed mid-stream", r"shard"])
    try:
        s3 = server.client()
        s3.create_bucket(Bucket="cut")
        s3.put_object(Bucket="cut", Key="obj", Body=os.urandom(64 << 20))
        headers = {"range": {"whole": "bytes=0-", "range": "bytes=1000-60000000", "close": "bytes=0-"}[how]}
        if how == "close":
            headers["connection"] = "close"
        host, port = server.endpoint.replace("http://", "").split(":")
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        s.connect((host, int(port)))
        s.sendall(raw_head(server.endpoint, "GET", "/cut/obj", headers=headers))
        got = s.recv(1 << 16)
        assert got.startswith(b"HTTP/1.1 20"), got[:200]
        shards = [f for f in glob.glob(f"{tmp_path}/d*/data/*/*") if os.path.getsize(f) > (1 << 20)]
        assert len(shards) == 4, shards
        for f in shards:
            os.truncate(f, 0)
        s.settimeout(30)
        ended = "eof"
        try:
            while s.recv(1 << 16):
                pass
        except ConnectionResetError:
            ended = "reset"
        assert ended == "reset"
        s.close()
        # The server goes on serving.
        s3.put_object(Bucket="cut", Key="after", Body=b"v")
        assert s3.get_object(Bucket="cut", Key="after")["Body"].read() == b"v"
    finally:
        server.stop()


def test_full_drives_keep_reads_and_deletes_and_recover_without_a_restart(tmp_path):
    # Issue 40, item 6. Before: with every drive full the metadata journal
    # took the last bytes: every GET, LIST and DELETE answered 503; after a
    # restart on the full disk the bucket answered NoSuchBucket, and after
    # the disk grew, still NoSuchBucket until a second restart.
    root = tmp_path / "allfull"
    mounts = []
    for i in range(4):
        d = root / f"d{i}"
        d.mkdir(parents=True)
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(d)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a small filesystem here: {r.stderr}")
        mounts.append(d)
    errors = EXPECTED + [r"no space left", r"drive full", r"No space left", r"persist failed", r"metadata reserve",
                         r"too few drives", r"bucket list", r"ServiceUnavailable"]  # fmt: skip
    server = None
    try:
        server = Server(str(root), drives=4, expected_errors=errors)
        s3 = server.client()
        s3.create_bucket(Bucket="full")
        # Small objects go inline into every drive's metadata: PUTs stop at
        # the drives' reserve with a clear error, before the journal takes
        # the last bytes.
        stored = {}
        for i in range(2000):
            body = os.urandom(60_000)
            try:
                s3.put_object(Bucket="full", Key=f"k{i:04}", Body=body)
            except botocore.exceptions.ClientError as e:
                assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 507, e.response
                assert e.response["Error"]["Code"] == "InsufficientStorage", e.response
                break
            stored[f"k{i:04}"] = body
        else:
            raise AssertionError("24 MiB drives never filled")
        assert len(stored) > 50

        def serves(s3, keys):
            for k in keys:
                assert s3.get_object(Bucket="full", Key=k)["Body"].read() == stored[k]
            listed = [o["Key"] for p in s3.get_paginator("list_objects_v2").paginate(Bucket="full")
                      for o in p.get("Contents", [])]  # fmt: skip
            assert listed == sorted(stored), (len(listed), len(stored))
            return True

        assert serves(s3, list(stored)[:5])
        assert all(d["online"] for d in drives(server)), drives(server)
        gone = sorted(stored)[:3]
        for k in gone:
            s3.delete_object(Bucket="full", Key=k)
            del stored[k]
        assert serves(s3, list(stored)[:5])
        # Then something else fills every filesystem to the last byte: the
        # drives give their metadata reserve back and go on serving reads
        # and DELETEs.
        for d in mounts:
            subprocess.run(["dd", "if=/dev/zero", f"of={d}/filler", "bs=64k"], capture_output=True)
        for k in sorted(stored)[:3]:
            wait_for(f"deleting {k} on full drives", lambda: s3.delete_object(Bucket="full", Key=k), timeout=20)
            del stored[k]
        wait_for("reads on full drives", lambda: serves(s3, list(stored)[:5]), timeout=20)
        # A restart on the full drives: the bucket is there (never NoSuchBucket).
        server.stop()
        server.start()
        s3 = server.client()
        wait_for("reads after a restart on full drives", lambda: serves(s3, list(stored)[-5:]), timeout=20)
        # Each drive gave its reserve back so that its index could open.
        log = open(server.logs[-1]).read()
        assert log.count("released its metadata reserve") == 4, log
        assert "full" in [b["Name"] for b in s3.list_buckets()["Buckets"]]
        # Room comes back: new data is taken again, with no restart.
        for d in mounts:
            os.unlink(f"{d}/filler")

        def put_works():
            try:
                s3.put_object(Bucket="full", Key="after", Body=b"room again")
                return True
            except botocore.exceptions.ClientError as e:
                assert e.response["ResponseMetadata"]["HTTPStatusCode"] in (503, 507), e.response
                return False

        wait_for("a PUT once there is room", put_works, timeout=30)
        assert s3.get_object(Bucket="full", Key="after")["Body"].read() == b"room again"
        wait_for("every drive online", lambda: all(d["state"] == "online" for d in drives(server)), timeout=30)
    finally:
        if server is not None:
            server.stop()
        for d in mounts:
            subprocess.run(["umount", str(d)], capture_output=True)


def test_a_bucket_list_read_from_too_few_drives_never_says_no_such_bucket(make_server):
    # Issue 40, item 6: a node that read its bucket list from too few drives
    # (the others offline at start) answered NoSuchBucket for buckets that
    # exist. Now 503 until a majority is back; then the list is read again.
    server = make_server(drives=4, expected_errors=EXPECTED + [r"bucket list", r"too few drives", r"ServiceUnavailable"])
    s3 = server.client()
    s3.create_bucket(Bucket="there")
    s3.put_object(Bucket="there", Key="k", Body=b"v")
    server.stop()
    for d in server.drives[2:]:
        os.rename(d, d + ".away")
    server.start()
    s3 = server.client()
    assert s3.get_object(Bucket="there", Key="k")["Body"].read() == b"v"
    for call in (lambda: s3.head_bucket(Bucket="maybe"), lambda: s3.list_buckets(),
                 lambda: s3.create_bucket(Bucket="maybe")):  # fmt: skip
        with pytest.raises(botocore.exceptions.ClientError) as e:
            call()
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503, e.value.response
    for d in server.drives[2:]:
        os.rename(d + ".away", d)
    wait_for("the drives back", lambda: sum(d["online"] for d in drives(server)) == 4)

    def no_such_bucket():
        try:
            s3.head_bucket(Bucket="maybe")
        except botocore.exceptions.ClientError as e:
            return e.response["ResponseMetadata"]["HTTPStatusCode"] == 404
        return False

    wait_for("the bucket list read again", no_such_bucket)
    assert [b["Name"] for b in s3.list_buckets()["Buckets"]] == ["there"]


def test_a_write_short_of_drives_answers_503_not_storage_full(make_server):
    # Issue 40's soak: with two of four drives out of reach (two nodes cut
    # off), small PUTs answered 507 InsufficientStorage ("2 of 4 drives of
    # the set have room beyond their reserve, 3 needed"): the drives out of
    # reach were counted as full. A write short of drives is unavailable
    # (503); 507 only when full drives are what it lacks.
    server = make_server(drives=4, expected_errors=[r"drive offline", r"erasure set is degraded", r"lost write quorum",
                                                    r"not enough drives"])  # fmt: skip
    s3 = server.client()
    s3.create_bucket(Bucket="few")
    s3.put_object(Bucket="few", Key="before", Body=b"kept")
    server.stop()
    shutil.rmtree(server.drives[2])
    shutil.rmtree(server.drives[3])
    server.start()
    s3 = server.client()
    assert s3.get_object(Bucket="few", Key="before")["Body"].read() == b"kept"
    for key, body in (("small", b"x" * 1000), ("large", os.urandom(3 * MiB))):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            s3.put_object(Bucket="few", Key=key, Body=body)
        err = e.value.response
        assert err["ResponseMetadata"]["HTTPStatusCode"] == 503, (key, err)
        assert err["Error"]["Code"] != "InsufficientStorage", (key, err)
