"""One server per port and per drive (issue 12, item 6).

Before: a second `tarn server` on the S3 port of a running one started (the
listeners use SO_REUSEPORT) and took most of the connections, answering from
its own empty store; a second server on a live server's drives logged
`Locked`, took them offline and served NoSuchBucket; and `tarn heal` on live
drives did nothing and exited 0. Each now refuses with a clear message and a
non-zero exit, and the first server keeps serving.
"""

import os
import re
import subprocess

import pytest
from tarnproc import BIN, Server


def run_tarn(args, cwd, timeout=30):
    env = dict(os.environ, TARN_LOG="info", NO_COLOR="1")
    env.pop("TARN_ACCESS_KEY", None)
    env.pop("TARN_SECRET_KEY", None)
    return subprocess.run([BIN, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def port_of(url):
    return int(re.search(r":(\d+)$", url.rstrip("/")).group(1))


@pytest.fixture
def live(make_server):
    # make_server stops it (by PID) however the test ends.
    s = make_server(drives=2, extra_args=["--kv", "--kv-listen", "127.0.0.1:0", "--kv-memory", "64MiB"], name="a")
    c = s.client()
    c.create_bucket(Bucket="bk1")
    c.put_object(Bucket="bk1", Key="k", Body=b"first server")
    return s


def still_serving(s):
    assert s.client().get_object(Bucket="bk1", Key="k")["Body"].read() == b"first server"


def test_second_server_on_the_same_s3_port_refuses(live, tmp_path):
    other = tmp_path / "b"
    other.mkdir()
    addr = f"127.0.0.1:{port_of(live.endpoint)}"
    r = run_tarn(["server", "--listen", addr, "--admin-listen", "127.0.0.1:0", "--drive", str(other / "d0")], other)
    assert r.returncode != 0
    assert f"already listening on {addr}" in r.stderr, r.stderr
    still_serving(live)


def test_second_server_on_the_same_admin_or_kv_port_refuses(live, tmp_path):
    other = tmp_path / "b"
    other.mkdir()
    admin = f"127.0.0.1:{port_of(live.admin)}"
    r = run_tarn(["server", "--listen", "127.0.0.1:0", "--admin-listen", admin, "--drive", str(other / "d0")], other)
    assert r.returncode != 0 and "admin" in r.stderr, r.stderr
    r = run_tarn(
        ["server", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--drive", str(other / "d1"),
         "--kv", "--kv-listen", live.kv_endpoint, "--kv-memory", "16MiB"],
        other,
    )  # fmt: skip
    assert r.returncode != 0 and "KV listener" in r.stderr, r.stderr
    still_serving(live)


def test_second_server_on_live_drives_refuses(live, tmp_path):
    args = ["server", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0"]
    for d in live.drives:
        args += ["--drive", d]
    r = run_tarn(args, live.root)
    assert r.returncode != 0
    assert "is in use by another tarn process" in r.stderr and f"pid {live.proc.pid}" in r.stderr, r.stderr
    # Even one shared drive is enough to refuse.
    r = run_tarn(["server", "--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0",
                  "--drive", live.drives[1], "--drive", str(tmp_path / "new")], live.root)  # fmt: skip
    assert r.returncode != 0 and "in use" in r.stderr, r.stderr
    still_serving(live)


def test_offline_heal_on_live_drives_refuses(live):
    args = ["heal"]
    for d in live.drives:
        args += ["--drive", d]
    r = run_tarn(args, live.root)
    assert r.returncode != 0
    assert "is in use by another tarn process" in r.stderr, r.stderr
    still_serving(live)


def test_drives_are_free_again_after_the_server_stops(make_server, tmp_path):
    s = make_server(drives=2, name="free")
    s.client().create_bucket(Bucket="bk1")
    s.kill()  # SIGKILL: the kernel releases the locks with the process
    args = ["heal"]
    for d in s.drives:
        args += ["--drive", d]
    r = run_tarn(args, str(tmp_path))
    assert r.returncode == 0, r.stderr
    s.start()
    assert [b["Name"] for b in s.client().list_buckets()["Buckets"]] == ["bk1"]
