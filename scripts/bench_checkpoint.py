"""Checkpoint benchmark, driven by scripts/bench-checkpoint: the same state
dict saved to and loaded from the same S3 endpoint by Tarn's DCP
writer/reader, s3torchconnector's DCP classes, and torch.save/torch.load
streams of each (tarn.checkpoint.open_write/open_read, s3torchconnector's
S3Checkpoint), in alternation, each save and each load in a fresh process.
Reports GB/s, the time dcp.async_save blocks the training loop, CPU seconds
per GB and the peak host memory the operation added.

    python bench_checkpoint.py run METHOD OP ENDPOINT URI SIZE_BYTES DEVICE   (one save or load; prints JSON)
    python bench_checkpoint.py compare ENDPOINT BUCKET SIZE_BYTES DEVICE ROUNDS METHODS
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time

import bench_model

REGION = "us-east-1"


def state_dict(size, device):
    """The bf16 weights (scripts/bench_model.py, made on `device`) and an
    optimizer-like step count."""
    return {"model": bench_model.weights(size, device), "step": 1000}


def blank(size, device):
    import torch

    return {"model": {k: torch.zeros(shape, dtype=torch.bfloat16, device=device) for k, shape in bench_model.shapes(size)},
            "step": 0}  # fmt: skip


def nbytes(sd):
    return sum(t.numel() * t.element_size() for t in sd["model"].values())


def rss_kib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def run(method, op, endpoint, uri, size, device):
    import torch
    import torch.distributed.checkpoint as dcp

    dev = torch.device(device)
    if dev.type == "cuda":
        torch.zeros(1, device=dev)
    if method.startswith("tarn"):
        import tarn.checkpoint as ckpt
        import tarn.objects

        client = tarn.objects.Client(endpoint)
    else:
        from s3torchconnector import S3Checkpoint, S3ClientConfig
        from s3torchconnector.dcp import S3StorageReader, S3StorageWriter

        cfg = S3ClientConfig(force_path_style=True)
    sd = state_dict(size, dev) if op == "save" else blank(size, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    base_rss = rss_kib()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    out = {}
    t0 = time.monotonic()
    if method == "tarn-dcp":
        if op == "save":
            dcp.save(sd, storage_writer=ckpt.StorageWriter(uri, client=client))
        else:
            dcp.load(sd, storage_reader=ckpt.StorageReader(uri, client=client))
    elif method == "tarn-async":
        w = ckpt.StorageWriter(uri, client=client)
        fut = dcp.async_save(sd, storage_writer=w)
        out["blocked_seconds"] = time.monotonic() - t0
        fut.result()
    elif method == "s3tc-dcp":
        if op == "save":
            dcp.save(sd, storage_writer=S3StorageWriter(REGION, uri, s3client_config=cfg))
        else:
            dcp.load(sd, storage_reader=S3StorageReader(REGION, uri, s3client_config=cfg))
    elif method == "s3tc-async":
        fut = dcp.async_save(sd, storage_writer=S3StorageWriter(REGION, uri, s3client_config=cfg))
        out["blocked_seconds"] = time.monotonic() - t0
        fut.result()
    elif method == "tarn-stream":
        if op == "save":
            with ckpt.open_write(uri + "/state.pt", client=client) as f:
                torch.save(sd, f)
        else:
            got = torch.load(ckpt.open_read(uri + "/state.pt", client=client), map_location=dev, weights_only=True)
            for k, t in got["model"].items():
                sd["model"][k].copy_(t)
    elif method == "s3tc-stream":
        cp = S3Checkpoint(REGION, endpoint=endpoint, s3client_config=cfg)
        if op == "save":
            with cp.writer(uri + "/state.pt") as f:
                torch.save(sd, f)
        else:
            with cp.reader(uri + "/state.pt") as f:
                got = torch.load(f, map_location=dev, weights_only=True)
            for k, t in got["model"].items():
                sd["model"][k].copy_(t)
    else:
        raise SystemExit(f"unknown method {method}")
    if dev.type == "cuda":
        torch.cuda.synchronize()
    secs = time.monotonic() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    if op == "load":
        # A cheap check that the bytes arrived: one tensor against the original.
        i, k, shape = bench_model.probe(size)
        if not torch.equal(sd["model"][k], bench_model.tensor(i, shape, dev)):
            raise SystemExit(f"{method}: {k} differs after the load")
    out.update(
        seconds=secs,
        bytes=nbytes(sd),
        cpu_seconds=(ru.ru_utime + ru.ru_stime) - (ru0.ru_utime + ru0.ru_stime),
        added_peak_mib=max(0, ru.ru_maxrss - base_rss) / 1024,
    )
    print(json.dumps(out))


def compare(endpoint, bucket, size, device, rounds, methods):
    import boto3

    s3 = boto3.client("s3", endpoint_url=endpoint, region_name=REGION)
    try:
        s3.create_bucket(Bucket=bucket)
    except s3.exceptions.ClientError:
        pass
    methods = methods.split(",")
    results = {(m, op): [] for m in methods for op in ("save", "load")}
    env = dict(os.environ, AWS_ENDPOINT_URL=endpoint, AWS_EC2_METADATA_DISABLED="true", AWS_REGION=REGION)
    for r in range(rounds):
        order = methods[r % len(methods) :] + methods[: r % len(methods)]
        for m in order:
            uri = f"s3://{bucket}/{m}/r{r}"
            for op in ("save", "load") if not m.endswith("async") else ("save",):
                p = subprocess.run(
                    [sys.executable, __file__, "run", m, op, endpoint, uri, str(size), device],
                    env=env, capture_output=True, text=True,
                )
                if p.returncode != 0:
                    raise SystemExit(f"{m} {op} failed:\n{p.stdout}\n{p.stderr}")
                res = json.loads(p.stdout.strip().splitlines()[-1])
                results[(m, op)].append(res)
                extra = f", blocked {res['blocked_seconds']:.2f} s" if "blocked_seconds" in res else ""
                print(f"round {r + 1} {m} {op}: {res['bytes'] / res['seconds'] / 1e9:.2f} GB/s{extra}", file=sys.stderr)
            # Space for the next rounds.
            for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{m}/r{r}/"):
                for o in page.get("Contents", []):
                    s3.delete_object(Bucket=bucket, Key=o["Key"])
    base = {op: statistics.median(x["bytes"] / x["seconds"] / 1e9 for x in results[("s3tc-dcp", op)])
            for op in ("save", "load") if results.get(("s3tc-dcp", op))}
    print(f"| method | op | GB/s (median of {rounds}) | vs s3torchconnector DCP | async_save blocks s | CPU s per GB | added peak host MiB |")
    print("|---|---|---|---|---|---|---|")
    for m in methods:
        for op in ("save", "load"):
            xs = results[(m, op)]
            if not xs:
                continue
            gbps = statistics.median(x["bytes"] / x["seconds"] / 1e9 for x in xs)
            ratio = f"{gbps / base[op]:.2f}x" if op in base else "-"
            blocked = (f"{statistics.median(x['blocked_seconds'] for x in xs):.2f}" if "blocked_seconds" in xs[0] else "-")
            cpu = statistics.median(x["cpu_seconds"] / (x["bytes"] / 1e9) for x in xs)
            peak = max(x["added_peak_mib"] for x in xs)
            print(f"| {m} | {op} | {gbps:.2f} | {ratio} | {blocked} | {cpu:.2f} | {peak:.0f} |")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "run":
        run(args[0], args[1], args[2], args[3], int(args[4]), args[5])
    elif cmd == "compare":
        compare(args[0], args[1], int(args[2]), args[3], int(args[4]), args[5])
    else:
        raise SystemExit(__doc__)
