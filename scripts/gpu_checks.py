"""GPU checks in one prepared run (issue 39), driven by scripts/gpu-checks:
Tarn's three GPU goals and the ceilings they run toward, measured in one
go on a GPU host that has no package index and little device time.

1. Model load: a Llama-shaped bf16 model in 4 safetensors shards, loaded
   onto the GPU by the Tarn loader, runai-model-streamer and boto3, in
   alternation, each load in a fresh process (goal: Tarn >= 4x runai).
2. Checkpoints: a GPU state dict saved and loaded with tarn.checkpoint's
   DCP storage and s3torchconnector's, and dcp.async_save's blocked time
   (goal: >= 5x s3torchconnector, save and load).
3. KV blocks into GPU memory: batches of 32 x 2 MiB read straight from the
   server's arena (registered with the CUDA driver), through pinned
   staging, next to pinned host-to-device copies of the same bytes
   (goal: direct >= 80% of pinned H2D).
4. Ceilings: the server's GET and PUT of 64 MiB x16 (`tarn bench s3`),
   the same GET of SSE-S3 objects (goal: >= 0.9 of the plain GET), pinned
   and pageable host-to-device copies, the drive's O_DIRECT write.

Every measured run records its client's CPU, the server's CPU and how many
of the host's cores were busy, so a missed goal comes with what bound it.
A part that fails is reported and the others still run; a time budget
skips rounds rather than overrun the device's lease. Tables are printed as
each part ends and, with the raw figures, written to --out (or $OUT).

    python scripts/gpu_checks.py [--quick] [--parts kv,ceilings,load,checkpoint] [--dir DIR] [--out DIR] [--budget-s S]
    python scripts/gpu_checks.py kv-child ENDPOINT DEVICE ROUNDS BATCHES BLOCK BATCH   (one process; prints JSON)
    python scripts/gpu_checks.py device-child DEVICE BYTES                             (prints JSON)

--quick runs every part with tiny sizes on the CPU (device `cpu`): what
the test command runs, so the script works before any GPU run.
"""

import argparse
import base64
import datetime
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import bench_model  # noqa: E402

MIB = 1 << 20
GIB = 1 << 30
PARTS = ("load", "checkpoint", "kv", "ceilings")
# Parts run in this order (the cheap ones, and the one never measured,
# first); tables are shown in PARTS order.
RUN_ORDER = ("kv", "ceilings", "load", "checkpoint")
BUCKET = "gpu-checks"
GOAL_LOADER_VS_RUNAI = 4.0
GOAL_DCP_VS_S3TC = 5.0
GOAL_KV_VS_H2D = 0.8


class Plan:
    """Sizes and rounds of a run: the issue's on a GPU, tiny with --quick."""

    def __init__(self, quick):
        self.quick = quick
        self.device = "cpu" if quick else "cuda"
        self.model_bytes = 8 * MIB if quick else 7680 * MIB
        self.shards = 4
        self.load_rounds = 1 if quick else 2
        self.concurrency = 4 if quick else 16
        self.ckpt_bytes = 8 * MIB if quick else 7680 * MIB
        self.ckpt_rounds = 1 if quick else 2
        self.kv_rounds = 2 if quick else 5
        self.kv_batches = 4 if quick else 20
        self.kv_block = 256 << 10 if quick else 2 * MIB
        self.kv_batch = 32
        self.kv_memory = "256MiB" if quick else "4GiB"
        self.s3_size = "1MiB" if quick else "64MiB"
        self.s3_objects = 4 if quick else 16
        self.s3_concurrency = 4 if quick else 16
        self.s3_duration = "1s" if quick else "5s"
        self.drive_size = "64MiB" if quick else "4GiB"
        self.copy_bytes = 16 * MIB if quick else GIB
        self.budget_s = 300 if quick else 450
        self.child_timeout_s = 120 if quick else 300
        # Scratch space the server's drives need at once: the model and one
        # checkpoint, each written twice (2+2), and the S3 ceilings' objects.
        self.scratch_bytes = 2 * (self.model_bytes + self.ckpt_bytes) + 4 * GIB


# ---------------------------------------------------------------------------
# Accounting: the client's, the server's and the host's CPU around a run
# ---------------------------------------------------------------------------

TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid):
    """User + system CPU seconds of a process (its threads, not children)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def host_busy_seconds():
    """CPU seconds all cores spent busy (everything but idle and iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / TICKS


class Meter:
    """Wall time, the server's CPU seconds and the host's busy cores over a
    `with` block."""

    def __init__(self, server_pid):
        self.pid = server_pid

    def __enter__(self):
        self.t0, self.s0, self.h0 = time.monotonic(), process_cpu_seconds(self.pid), host_busy_seconds()
        return self

    def __exit__(self, *exc):
        self.wall = time.monotonic() - self.t0
        self.server_cpu = process_cpu_seconds(self.pid) - self.s0
        self.host_busy_cores = (host_busy_seconds() - self.h0) / max(self.wall, 1e-9)
        return False

    def figures(self):
        return {"wall_seconds": self.wall, "server_cpu_seconds": self.server_cpu, "host_busy_cores": self.host_busy_cores}


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


class Checks:
    def __init__(self, args):
        self.args = args
        self.plan = Plan(args.quick)
        if args.budget_s:
            self.plan.budget_s = args.budget_s
        self.started = time.monotonic()
        self.out = args.out or os.environ.get("OUT")
        self.results = {"host": {}, "parts": {}}
        self.tables = {}
        self.failures = []
        self.copy_rates = None
        self.env = dict(os.environ)
        self.env.update(
            AWS_ACCESS_KEY_ID="tarnadmin", AWS_SECRET_ACCESS_KEY="tarnadmin-secret", AWS_DEFAULT_REGION="us-east-1",
            AWS_REGION="us-east-1", AWS_EC2_METADATA_DISABLED="true", PYTHONUNBUFFERED="1",
            RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0", RUNAI_STREAMER_CONCURRENCY=str(self.plan.concurrency),
        )  # fmt: skip
        os.environ.update({k: self.env[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")})

    # -- time -------------------------------------------------------------

    def left(self):
        return self.plan.budget_s - (time.monotonic() - self.started)

    def affordable(self, last_seconds):
        """Whether another run like the last one (or a first) fits the budget."""
        return self.left() > max(5.0, 1.3 * last_seconds)

    # -- processes --------------------------------------------------------

    def child(self, argv, timeout=None):
        """Runs a Python child; its last stdout line is JSON, returned."""
        p = subprocess.run(
            [sys.executable, *argv], env=self.env, capture_output=True, text=True,
            timeout=timeout or self.plan.child_timeout_s,
        )  # fmt: skip
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[:3])} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    def failed_run(self, what, e):
        """Records a run that failed (its part goes on with the others) and
        returns the line its table shows."""
        self.failures.append(what)
        print(f"{what} failed: {e}", file=sys.stderr, flush=True)
        last = [line for line in str(e).splitlines() if line.strip()][-1:] or ["?"]
        return last[0][:200].replace("|", "/")

    def importable(self, module):
        """None when `module`'s top-level package is installed for the
        children's interpreter, else why not. Found without importing it
        (each import of torch costs seconds); a package that is there but
        fails to import fails its runs, which the tables name."""
        code = (f"import importlib.util, sys; n = {module.split('.')[0]!r}; "
                "sys.exit(0 if importlib.util.find_spec(n) else f'No module named {n!r}')")
        p = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True)
        return None if p.returncode == 0 else (p.stderr.strip().splitlines() or ["not installed"])[-1]

    def tarn(self, *argv, timeout=120):
        p = subprocess.run([self.bin, *argv], env=self.env, capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            raise RuntimeError(f"tarn {' '.join(argv[:3])} failed ({p.returncode}): {p.stderr[-2000:]}")
        return json.loads(p.stdout.strip().splitlines()[-1])

    # -- output -----------------------------------------------------------

    def table(self, part, header, rows, notes=()):
        if self.plan.quick and part != "host":
            notes = [*notes, "a --quick run: tiny sizes on the CPU, to test the script; the goals are for a GPU host"]
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        lines += [""] + [f"- {n}" for n in notes]
        self.tables[part] = "\n".join(lines)
        print(f"\n### {TITLES[part]}\n\n{self.tables[part]}\n", flush=True)

    def save(self):
        if not self.out:
            return
        os.makedirs(self.out, exist_ok=True)
        md = [f"## GPU checks: {self.results['host'].get('summary', '')}", ""]
        for part in ("host", *PARTS):
            if part in self.tables:
                md += [f"### {TITLES[part]}", "", self.tables[part], ""]
        with open(os.path.join(self.out, "gpu-checks.md"), "w") as f:
            f.write("\n".join(md))
        with open(os.path.join(self.out, "gpu-checks.json"), "w") as f:
            json.dump(self.results, f, indent=1)

    # -- setup ------------------------------------------------------------

    def scratch_dir(self):
        if self.args.dir:
            return self.args.dir
        if os.environ.get("TARN_BENCH_DIR"):
            return os.environ["TARN_BENCH_DIR"]
        # Memory-backed drives where they fit: the server's work, not a
        # disk's, is what the loads and checkpoints measure.
        if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > self.plan.scratch_bytes + 8 * GIB:
            return "/dev/shm"
        return "/var/tmp"

    def host_info(self):
        h = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "cores": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1),
            "device": self.plan.device,
            "python": sys.version.split()[0],
            "scratch": self.root,
            "commit": commit(),
        }
        try:
            # One child for both: the device's figures and its copy rates
            # (a ceiling of part 4), so torch starts once for them.
            info = self.child([__file__, "device-child", self.plan.device, str(self.plan.copy_bytes)])
            self.copy_rates = info.pop("copy_rates")
            h["torch"] = info
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            h["torch"] = {"error": str(e)[-300:]}
        gpu = h["torch"].get("gpu") or "no GPU"
        h["summary"] = f"{gpu}, {h['cores']} cores, {h['memory_gib']} GiB, {h['date']}, commit {h['commit']}"
        self.results["host"] = h
        rows = [[k, v if not isinstance(v, dict) else ", ".join(f"{a} {b}" for a, b in v.items())] for k, v in h.items() if k != "summary"]
        self.table("host", ["", ""], rows)

    def run(self):
        import tarnproc

        parts = [p for p in RUN_ORDER if p in self.args.parts.split(",")]
        base = self.scratch_dir()
        os.makedirs(base, exist_ok=True)
        self.root = os.path.join(base, f"tarn-gpu-checks.{os.getpid()}")
        os.makedirs(self.root)
        self.bin = tarnproc.BIN
        server = None
        failed = []
        try:
            self.host_info()
            self.save()
            # An SSE-S3 master key: the ceilings part reads encrypted objects too.
            keys = os.path.join(self.root, "master.keys")
            with open(os.open(keys, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write("gpu:" + base64.b64encode(os.urandom(32)).decode() + "\n")
            server = tarnproc.Server(
                self.root, drives=4, cores=os.cpu_count(),
                extra_args=["--kv", "--kv-listen", "127.0.0.1:0", "--kv-memory", self.plan.kv_memory,
                            "--sse-master-key-file", keys],
            )  # fmt: skip
            self.server = server
            # Where runai-model-streamer and s3torchconnector find the server.
            self.env["AWS_ENDPOINT_URL"] = server.endpoint
            bench_model.create_bucket(server.endpoint, BUCKET)
            for part in parts:
                print(f"== {part} ({self.left():.0f} s of the budget left)", file=sys.stderr, flush=True)
                t0 = time.monotonic()
                try:
                    getattr(self, "part_" + part)()
                except Exception as e:  # noqa: BLE001 - one part's failure must not hide the others
                    failed.append(part)
                    self.results["parts"][part] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
                    self.table(part, ["failed"], [[f"{type(e).__name__}: {str(e)[:400]}".replace("\n", " ")]])
                    print(traceback.format_exc(), file=sys.stderr)
                self.results["parts"].setdefault(part, {})["seconds"] = time.monotonic() - t0
                self.save()
        finally:
            if server is not None:
                server.stop()
                bad = server.unexpected_errors()
                self.results["server_errors"] = bad[:20]
                if bad:
                    failed.append("server log")
                    print("server logged errors:\n" + "\n".join(bad[:20]), file=sys.stderr)
            failed += self.failures
            self.results["seconds"] = time.monotonic() - self.started
            self.results["failed"] = failed
            self.save()
            shutil.rmtree(self.root, ignore_errors=True)
        print(f"\ngpu-checks: {time.monotonic() - self.started:.0f} s; " + (f"FAILED: {', '.join(failed)}" if failed else "every part ran"))
        return 1 if failed else 0

    # -- 1. model load ----------------------------------------------------

    def part_load(self):
        p, ep = self.plan, self.server.endpoint
        loaders = [("tarn", "tarn.loader"), ("tarn-http", "tarn.loader"), ("runai", "runai_model_streamer"), ("boto3", "boto3")]
        missing = {name: self.importable(mod) for name, mod in loaders}
        present = [n for n, _ in loaders if missing[n] is None]
        t0 = time.monotonic()
        self.child([os.path.join(HERE, "bench_load.py"), "make", ep, BUCKET, "model/", str(p.model_bytes), str(p.shards), p.device],
                   timeout=max(p.child_timeout_s, 600))  # fmt: skip
        made = time.monotonic() - t0
        runs = {n: [] for n in present}
        skipped, last, errors = 0, 0.0, {}
        for r in range(p.load_rounds):
            order = present[r % len(present) :] + present[: r % len(present)]
            for name in order:
                if not self.affordable(last):
                    skipped += 1
                    continue
                if name in errors:
                    continue
                try:
                    with Meter(self.server.proc.pid) as m:
                        res = self.child([os.path.join(HERE, "bench_load.py"), "run", name, ep, BUCKET, "model/", p.device, str(p.concurrency)])
                except (RuntimeError, subprocess.TimeoutExpired) as e:
                    errors[name] = self.failed_run(f"load {name}", e)
                    continue
                res.update(m.figures())
                last = m.wall
                runs[name].append(res)
                print(f"round {r + 1} {name}: {res['bytes'] / res['seconds'] / 1e9:.2f} GB/s", file=sys.stderr, flush=True)
        med = {n: statistics.median(gbps(x) for x in xs) for n, xs in runs.items() if xs}
        base = med.get("runai")
        rows = []
        for name, _ in loaders:
            xs = runs.get(name) or []
            if missing[name] is not None:
                rows.append([LABELS[name], f"not importable here: {missing[name][:120]}", "", "", "", "", "", ""])
                continue
            if name in errors:
                rows.append([LABELS[name], f"failed: {errors[name]}", "", "", "", "", "", ""])
                continue
            if not xs:
                rows.append([LABELS[name], "skipped (time budget)", "", "", "", "", "", ""])
                continue
            rows.append([
                LABELS[name], f"**{med[name]:.2f}**" if name == "tarn" else f"{med[name]:.2f}",
                ", ".join(f"{gbps(x):.2f}" for x in xs), f"{med[name] / base:.2f}x" if base else "-",
                f"{per_gb(xs, 'cpu_seconds'):.2f}", f"{per_gb(xs, 'server_cpu_seconds'):.2f}",
                f"{statistics.median(x['host_busy_cores'] for x in xs):.1f}", f"{max(x['max_rss_kib'] for x in xs) / 1024:.0f}",
            ])  # fmt: skip
        notes = [f"{bench_model.nbytes(p.model_bytes) / GIB:.2f} GiB bf16 model in {p.shards} safetensors shards, made and uploaded in {made:.0f} s;"
                 f" onto `{p.device}`, concurrency {p.concurrency}, each load a fresh process, loaders in alternation"]  # fmt: skip
        notes.append(goal_line("Tarn loader vs runai-model-streamer", med.get("tarn"), base, GOAL_LOADER_VS_RUNAI))
        if skipped:
            notes.append(f"{skipped} run(s) skipped to stay within the {p.budget_s} s budget")
        self.results["parts"]["load"] = {
            "runs": runs, "not_importable": {k: v for k, v in missing.items() if v}, "failed": errors, "median_gbps": med,
        }  # fmt: skip
        self.table("load", ["loader", f"GB/s onto {p.device} (median)", "rounds", "vs runai", "client CPU s/GB",
                            "server CPU s/GB", "busy cores", "peak RSS MiB"], rows, notes)  # fmt: skip

    # -- 2. checkpoints ---------------------------------------------------

    def part_checkpoint(self):
        p, ep = self.plan, self.server.endpoint
        s3tc = self.importable("s3torchconnector.dcp")
        methods = ["tarn-dcp", "tarn-async"] + ([] if s3tc else ["s3tc-dcp", "s3tc-async"])
        runs = {(m, op): [] for m in methods for op in ("save", "load")}
        skipped, last, errors = 0, 0.0, {}
        for r in range(p.ckpt_rounds):
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            for m in order:
                uri = f"s3://{BUCKET}/ckpt/{m}/r{r}"
                for op in ("save",) if m.endswith("async") else ("save", "load"):
                    if m in errors:
                        break
                    if not self.affordable(last):
                        skipped += 1
                        break
                    try:
                        with Meter(self.server.proc.pid) as meter:
                            res = self.child([os.path.join(HERE, "bench_checkpoint.py"), "run", m, op, ep, uri, str(p.ckpt_bytes), p.device])
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        errors[m] = self.failed_run(f"checkpoint {m} {op}", e)
                        break
                    res.update(meter.figures())
                    last = meter.wall
                    runs[(m, op)].append(res)
                    extra = f", blocked {res['blocked_seconds']:.2f} s" if "blocked_seconds" in res else ""
                    print(f"round {r + 1} {m} {op}: {gbps(res):.2f} GB/s{extra}", file=sys.stderr, flush=True)
                delete_prefix(ep, BUCKET, f"ckpt/{m}/r{r}/")
        med = {k: statistics.median(gbps(x) for x in xs) for k, xs in runs.items() if xs}
        rows = []
        for m in methods:
            for op in ("save", "load"):
                xs = runs[(m, op)]
                if m.endswith("async") and op == "load":
                    continue
                if not xs:
                    why = f"failed: {errors[m]}" if m in errors else "skipped (time budget)"
                    rows.append([m, op, why, "", "", "", "", "", "", ""])
                    continue
                base = med.get(("s3tc-dcp", op))
                blocked = statistics.median(x["blocked_seconds"] for x in xs) if "blocked_seconds" in xs[0] else None
                rows.append([
                    m, op, f"**{med[(m, op)]:.2f}**" if m == "tarn-dcp" else f"{med[(m, op)]:.2f}",
                    ", ".join(f"{gbps(x):.2f}" for x in xs), f"{med[(m, op)] / base:.2f}x" if base else "-",
                    f"{blocked:.2f}" if blocked is not None else "-", f"{per_gb(xs, 'cpu_seconds'):.2f}",
                    f"{per_gb(xs, 'server_cpu_seconds'):.2f}", f"{statistics.median(x['host_busy_cores'] for x in xs):.1f}",
                    f"{max(x['added_peak_mib'] for x in xs):.0f}",
                ])  # fmt: skip
        if s3tc:
            rows.append(["s3torchconnector DCP", "", f"not importable here: {s3tc[:120]}", "", "", "", "", "", "", ""])
        notes = [f"{bench_model.nbytes(p.ckpt_bytes) / GIB:.2f} GiB bf16 state dict on `{p.device}`; each save and load a fresh process,"
                 " methods in alternation; the async rate is to the end of the upload"]  # fmt: skip
        for op in ("save", "load"):
            notes.append(goal_line(f"tarn.checkpoint DCP {op} vs s3torchconnector's", med.get(("tarn-dcp", op)),
                                   med.get(("s3tc-dcp", op)), GOAL_DCP_VS_S3TC))  # fmt: skip
        if skipped:
            notes.append(f"{skipped} run(s) skipped to stay within the {p.budget_s} s budget")
        self.results["parts"]["checkpoint"] = {
            "runs": {f"{m} {op}": xs for (m, op), xs in runs.items()}, "not_importable": s3tc, "failed": errors,
            "median_gbps": {f"{m} {op}": v for (m, op), v in med.items()},
        }  # fmt: skip
        self.table("checkpoint", ["method", "op", "GB/s (median)", "rounds", "vs s3torchconnector DCP", "async_save blocks s",
                                  "client CPU s/GB", "server CPU s/GB", "busy cores", "added peak host MiB"], rows, notes)  # fmt: skip

    # -- 3. KV blocks into GPU memory --------------------------------------

    def part_kv(self):
        p = self.plan
        with Meter(self.server.proc.pid) as m:
            res = self.child([__file__, "kv-child", self.server.kv_endpoint, p.device, str(p.kv_rounds), str(p.kv_batches),
                              str(p.kv_block), str(p.kv_batch)])  # fmt: skip
        res.update(m.figures())
        cuda = p.device == "cuda"
        ceiling = "pinned H2D" if cuda else "host copy"
        rows = [[r + 1, f"{x['h2d_one']:.1f}", f"{x['h2d_each']:.1f}", f"{x['direct']:.1f}", f"{x['staged']:.1f}",
                 f"{x['direct'] / x['h2d_one']:.0%}", f"{x['locate_and_check']:.1f}"] for r, x in enumerate(res["rounds"])]  # fmt: skip
        med = {k: statistics.median(x[k] for x in res["rounds"]) for k in res["rounds"][0]}
        path = "straight from the arena, registered with the CUDA driver" if res["path"] == "arena" else f"staged: {res['why']}"
        if cuda:
            path += f" (the device's read-only host registration attribute: {res['read_only_register_supported']})"
        if not cuda:
            path = "straight from the arena (the CUDA path's calls, run with CPU tensors)"
        notes = [
            f"{p.kv_batch} x {p.kv_block >> 10} KiB per batch, {p.kv_batches} batches per figure, rounds in alternation; "
            f"`get_into` into `{p.device}` tensors: {path}",
            f"client CPU s/GB: direct {res['cpu_per_gb']['direct']:.2f}, staged {res['cpu_per_gb']['staged']:.2f}; "
            f"the last column locates a batch and checks its CRCs in the arena, with no copy (on up to {res['verify_threads']} threads)",
            goal_line("KV get_into direct vs " + ceiling, med["direct"], med["h2d_one"], GOAL_KV_VS_H2D, ratio=False),
        ]
        self.results["parts"]["kv"] = res
        self.table("kv", ["round", f"{ceiling}, one copy GB/s", f"{ceiling}, {p.kv_batch} copies GB/s", "direct GB/s",
                          "staged GB/s", f"direct / {ceiling}", "locate + CRC only GB/s"], rows, notes)  # fmt: skip

    # -- 4. ceilings --------------------------------------------------------

    def part_ceilings(self):
        p, ep = self.plan, self.server.endpoint
        rows, raw = [], {}
        for op in ("get", "put"):
            r = self.tarn("bench", "s3", "--endpoint", ep, "--op", op, "--size", p.s3_size, "--objects", str(p.s3_objects),
                          "--concurrency", str(p.s3_concurrency), "--duration", p.s3_duration, "--json")  # fmt: skip
            raw[f"s3_{op}"] = r
            rows.append([f"server {op.upper()} {p.s3_size} x{p.s3_concurrency} (`tarn bench s3`)", f"{r['mb_per_sec'] / 1e3:.2f}",
                         f"p50 {r['latency_ms']['p50']:.1f} ms, p99 {r['latency_ms']['p99']:.1f} ms, errors {r.get('errors', {})}"])  # fmt: skip
        # The same GET of SSE-S3 objects (issue 42's "under 10%" on a host
        # with cores to spare): a bucket whose default encryption is AES256.
        from sigv4 import signed_request

        sse_bucket = BUCKET + "-sse"
        signed_request(ep, "PUT", f"/{sse_bucket}")
        conf = (b'<ServerSideEncryptionConfiguration><Rule><ApplyServerSideEncryptionByDefault>'
                b'<SSEAlgorithm>AES256</SSEAlgorithm></ApplyServerSideEncryptionByDefault></Rule>'
                b'</ServerSideEncryptionConfiguration>')  # fmt: skip
        md5 = base64.b64encode(hashlib.md5(conf).digest()).decode()
        put = signed_request(ep, "PUT", f"/{sse_bucket}", query=[("encryption", "")], body=conf, headers={"content-md5": md5})
        if put.status_code != 200:
            raise RuntimeError(f"PutBucketEncryption: {put.status_code} {put.text[:300]}")
        r = self.tarn("bench", "s3", "--endpoint", ep, "--bucket", sse_bucket, "--keep", "--op", "get", "--size", p.s3_size,
                      "--objects", str(p.s3_objects), "--concurrency", str(p.s3_concurrency), "--duration", p.s3_duration,
                      "--json")  # fmt: skip
        raw["s3_get_sse"] = r
        plain = raw["s3_get"]["mb_per_sec"]
        rows.append([f"server GET {p.s3_size} x{p.s3_concurrency}, SSE-S3 (`tarn bench s3`)", f"{r['mb_per_sec'] / 1e3:.2f}",
                     f"{r['mb_per_sec'] / plain:.2f} of the plain GET above (goal >= 0.90); p50 {r['latency_ms']['p50']:.1f} ms, "
                     f"p99 {r['latency_ms']['p99']:.1f} ms, errors {r.get('errors', {})}"])  # fmt: skip
        copies = self.copy_rates
        if copies is None:
            raise RuntimeError("the device's copy rates were not measured (see the host table)")
        raw["h2d"] = copies
        for kind in ("pinned", "pageable"):
            rows.append([f"host-to-device copy, {kind}", f"{copies[kind]:.1f}" if kind in copies else "-",
                         f"{p.copy_bytes >> 20} MiB, median of 5" if kind in copies else "no GPU"])  # fmt: skip
        seen = set()
        for d in (os.path.dirname(self.root), "/var/tmp"):
            if not os.path.isdir(d) or os.stat(d).st_dev in seen:
                continue
            seen.add(os.stat(d).st_dev)
            r = self.tarn("bench", "drive", "--dir", d, "--size", p.drive_size, "--json", timeout=300)
            raw[f"drive {d}"] = r
            how = "O_DIRECT" if r["direct"] else "buffered: the filesystem refuses O_DIRECT"
            if r["filesystem"] == "tmpfs":
                how += " (tmpfs: memory, not a drive)"
            rows.append([f"drive write under {d}, {r['filesystem']} (`tarn bench drive`)", f"{r['gb_per_sec']:.2f}",
                         f"{how}, {r['bytes'] >> 20} MiB in {r['block_bytes'] >> 10} KiB writes, {r['depth']} in flight, fsync {r['fsync_seconds']:.2f} s"])  # fmt: skip
        self.results["parts"]["ceilings"] = raw
        self.table("ceilings", ["ceiling", "GB/s", "detail"], rows,
                   [f"the server's drives: 4 directories under {os.path.dirname(self.root)} (2+2), {os.cpu_count()} runtime cores"])  # fmt: skip


TITLES = {
    "host": "Host",
    "load": "1. Model load onto the device: Tarn loader, runai-model-streamer, boto3",
    "checkpoint": "2. Checkpoints: tarn.checkpoint DCP vs s3torchconnector DCP",
    "kv": "3. KV blocks into device memory",
    "ceilings": "4. Ceilings of the same run",
}
LABELS = {"tarn": "tarn (short-circuit reads)", "tarn-http": "tarn over HTTP", "runai": "runai-model-streamer", "boto3": "boto3"}
def gbps(x):
    return x["bytes"] / x["seconds"] / 1e9


def per_gb(xs, key):
    return statistics.median(x[key] / (x["bytes"] / 1e9) for x in xs)


def goal_line(what, value, base, goal, ratio=True):
    if value is None or not base:
        return f"{what}: not measured in this run (goal {goal:g}{'x' if ratio else ''})"
    r = value / base
    shown = f"{r:.2f}x (goal {goal:g}x)" if ratio else f"{r:.0%} (goal {goal:.0%})"
    return f"**{what}: {shown}: {'met' if r >= goal else 'missed'}**"


def commit():
    try:
        with open(os.path.join(ROOT, ".dev", "COMMIT")) as f:
            return f.read().strip()
    except OSError:
        pass
    p = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return p.stdout.strip() or "unknown"


def delete_prefix(endpoint, bucket, prefix):
    """Deletes every object under `prefix` (space on the drives for the
    next round)."""
    import tarn.objects
    from sigv4 import signed_request

    for o in tarn.objects.Client(endpoint).list(bucket, prefix):
        r = signed_request(endpoint, "DELETE", f"/{bucket}/{o.key}", access_key=os.environ["AWS_ACCESS_KEY_ID"],
                           secret_key=os.environ["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
        if r.status_code != 204:
            raise RuntimeError(f"deleting {o.key}: {r.status_code} {r.text[:200]}")


# ---------------------------------------------------------------------------
# Children
# ---------------------------------------------------------------------------


def kv_child(endpoint, device, rounds, batches, block, batch):
    """KV gets into `device` tensors: direct from the arena, staged, the
    host-to-device ceiling, and a batch's locate + CRC check alone."""
    import resource

    import torch

    import tarn.kv as kv

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    c = kv.Client(endpoint, "gpu-checks", transport="shm")
    path, why = c.device_path(dev)
    read_only_register = read_only_register_supported() if cuda else None
    sources = 8
    keys = [kv.key("gpu-checks", i) for i in range(batch * sources)]
    g = torch.Generator().manual_seed(7)
    src = [torch.randint(0, 256, (block,), dtype=torch.uint8, generator=g) for _ in range(sources)]
    for s in range(sources):
        got = c.put_from(keys[s * batch : (s + 1) * batch], [src[s]] * batch)
        assert all(x.stored for x in got), got
    src_dev = [t.to(dev) for t in src]
    dst = [torch.empty(block, dtype=torch.uint8, device=dev) for _ in range(batch)]
    host = torch.ones(batch * block, dtype=torch.uint8, pin_memory=cuda)
    flat = torch.empty(batch * block, dtype=torch.uint8, device=dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def batch_keys(b):
        return keys[(b % sources) * batch : (b % sources + 1) * batch]

    def direct(b):
        ks = batch_keys(b)
        # CPU tensors would take the native host path: run the device path's
        # own calls with them instead (what the tests do).
        got = c.get_into(ks, dst) if cuda else c._get_into_via_arena(ks, dst)
        assert got == [block] * batch, got

    def staged(b):
        got = c.get_into(batch_keys(b), dst, offsets=[0] * batch)
        assert got == [block] * batch, got

    def h2d_one(b):
        flat.copy_(host, non_blocking=cuda)

    def h2d_each(b):
        for i in range(batch):
            dst[i].copy_(host[i * block : (i + 1) * block], non_blocking=cuda)

    def locate_and_check(b):
        located = c._locate(batch_keys(b))
        assert all(c._verify(located, True))

    def check(b):
        want = src_dev[b % sources]
        bad = [i for i, t in enumerate(dst) if not torch.equal(t, want)]
        assert not bad, f"blocks {bad} of batch {b} differ in {device} memory from what was stored"

    for fn in (direct, staged):  # warm-up (registration, staging) and the bytes checked
        for b in range(2):
            fn(b)
            sync()
            check(b)
    for fn in (h2d_one, h2d_each, locate_and_check):  # first touches out of the clock
        fn(0)
    cpu = {"direct": 0.0, "staged": 0.0}

    def timed(fn):
        sync()
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t = time.perf_counter()
        for b in range(batches):
            fn(b)
        sync()
        secs = time.perf_counter() - t
        ru = resource.getrusage(resource.RUSAGE_SELF)
        if fn.__name__ in cpu:
            cpu[fn.__name__] += (ru.ru_utime + ru.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
        return batches * batch * block / secs / 1e9

    out = []
    for _ in range(rounds):
        out.append({fn.__name__: timed(fn) for fn in (h2d_one, h2d_each, direct, staged, locate_and_check)})
    direct(batches - 1)
    sync()
    check(batches - 1)
    c.close()
    gb = rounds * batches * batch * block / 1e9
    return {
        "path": path, "why": why, "read_only_register_supported": read_only_register, "rounds": out, "cpu_per_gb": {k: v / gb for k, v in cpu.items()},
        "verify_threads": min(8, os.cpu_count() or 1), "block_bytes": block, "batch": batch,
    }  # fmt: skip


def read_only_register_supported():
    """The device's CU_DEVICE_ATTRIBUTE_READ_ONLY_HOST_REGISTER_SUPPORTED
    (113): whether the driver can register a read-only mapping such as the
    arena's. The value, or why it could not be read."""
    import ctypes

    import torch

    try:
        value = ctypes.c_int()
        rc = ctypes.CDLL("libcuda.so.1").cuDeviceGetAttribute(ctypes.byref(value), 113, torch.cuda.current_device())
        return value.value if rc == 0 else f"cuDeviceGetAttribute error {rc}"
    except OSError as e:
        return str(e)


def device_child(device, nbytes):
    """torch's version and the device's, and its host-to-device copy rates."""
    import torch

    import bench_load

    d = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        d.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count)
    d["copy_rates"] = bench_load.copy_rates(device, nbytes)
    return d


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "kv-child":
        a = sys.argv[2:]
        print(json.dumps(kv_child(a[0], a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]))))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "device-child":
        print(json.dumps(device_child(sys.argv[2], int(sys.argv[3]))))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the CPU: tests the script")
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of " + ",".join(PARTS))
    ap.add_argument("--dir", help="scratch directory for the server's drives (default /dev/shm where it fits)")
    ap.add_argument("--out", help="where the tables and raw JSON go (default $OUT)")
    ap.add_argument("--budget-s", type=float, help="seconds the parts may take in all")
    args = ap.parse_args()
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        ap.error(f"unknown parts {sorted(unknown)}")
    return Checks(args).run()


if __name__ == "__main__":
    sys.exit(main())
