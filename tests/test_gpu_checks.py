"""scripts/gpu-checks --quick: the GPU measurements' one prepared command,
run here with tiny sizes on the CPU, so a GPU host's few minutes are not
spent finding its bugs. Its first run here found two that a device would
have: runai-model-streamer and s3torchconnector were never told where the
server was (AWS_ENDPOINT_URL), and a loader that failed took its whole
part's table with it."""

import json
import os
import subprocess
import sys

import tarnproc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpu-checks")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import bench_model  # noqa: E402


def gpu_checks(tmp_path, *args):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), TARN_BIN=tarnproc.BIN, TARN_BENCH_PYTHON=sys.executable)
    p = subprocess.run([SCRIPT, "--quick", "--dir", str(tmp_path / "scratch"), *args], env=env,
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    return p, out


def test_quick_run_measures_every_part_and_writes_tables_and_json(tmp_path):
    p, out = gpu_checks(tmp_path)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-6000:]
    md = (out / "gpu-checks.md").read_text()
    for title in ("### Host", "### 1. Model load", "### 2. Checkpoints", "### 3. KV blocks", "### 4. Ceilings"):
        assert title in md, md
        assert title in p.stdout
    r = json.loads((out / "gpu-checks.json").read_text())
    assert r["failed"] == [] and r["server_errors"] == []
    assert r["host"]["device"] == "cpu" and r["host"]["cores"] == os.cpu_count()
    parts = r["parts"]

    # 1. Every loader loaded the whole model (each checked one tensor's bytes).
    load = parts["load"]
    model = bench_model.nbytes(8 << 20)
    for name in ("tarn", "runai", "boto3"):
        (run,) = load["runs"][name]
        assert run["bytes"] == model, name
        assert run["server_cpu_seconds"] >= 0 and run["host_busy_cores"] > 0 and run["max_rss_kib"] > 0
    assert "runai-model-streamer" in md and "vs runai" in md and "(goal 4x)" in md

    # 2. Both DCP storages saved and loaded; async_save's blocked time.
    ckpt = parts["checkpoint"]["runs"]
    for key in ("tarn-dcp save", "tarn-dcp load", "s3tc-dcp save", "s3tc-dcp load", "tarn-async save", "s3tc-async save"):
        (run,) = ckpt[key]
        assert run["bytes"] == model, key
    assert 0 <= ckpt["tarn-async save"][0]["blocked_seconds"] <= ckpt["tarn-async save"][0]["seconds"]
    assert "DCP save vs s3torchconnector's" in md and "(goal 5x)" in md

    # 3. KV: the arena path (the CUDA path's calls) and the staged one, each
    # round, with the bytes compared in the child.
    kv = parts["kv"]
    assert kv["path"] == "arena" and kv["why"] is None
    assert len(kv["rounds"]) == 2
    for rnd in kv["rounds"]:
        assert set(rnd) == {"h2d_one", "h2d_each", "direct", "staged", "locate_and_check"}
        assert all(v > 0 for v in rnd.values())
    assert "(goal 80%)" in md

    # 4. Ceilings: the server's GET and PUT, the drive's write.
    ceil = parts["ceilings"]
    assert ceil["s3_get"]["ops_per_sec"] > 0 and ceil["s3_put"]["ops_per_sec"] > 0
    assert not ceil["s3_get"].get("errors") and not ceil["s3_put"].get("errors")
    # The GET of SSE-S3 objects, next to the plain one.
    assert ceil["s3_get_sse"]["ops_per_sec"] > 0 and not ceil["s3_get_sse"].get("errors")
    assert "SSE-S3" in md and "of the plain GET above" in md
    drive = next(v for k, v in ceil.items() if k.startswith("drive "))
    assert drive["bytes"] == 64 << 20 and drive["gb_per_sec"] > 0
    assert ceil["h2d"] == {}  # no GPU here, and the table says so
    assert "no GPU" in md


def test_a_spent_budget_skips_runs_and_says_so(tmp_path):
    """On a device the lease ends the run: rounds that no longer fit the
    budget are skipped and named, never left to be killed mid-table."""
    p, out = gpu_checks(tmp_path, "--parts", "checkpoint", "--budget-s", "1")
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    r = json.loads((out / "gpu-checks.json").read_text())
    assert all(not xs for xs in r["parts"]["checkpoint"]["runs"].values())
    assert "skipped (time budget)" in p.stdout
    assert set(r["parts"]) == {"checkpoint"}
