"""Model load benchmark, driven by scripts/bench-load: the same safetensors
model from the same S3 endpoint, loaded by the Tarn loader,
runai-model-streamer and boto3 (parallel ranged GETs, then
safetensors.torch.load), in alternation, each load in a fresh process.
Reports GB/s to the destination, CPU seconds per GB, peak RSS and the
requests the server counted.

    python bench_load.py make ENDPOINT BUCKET PREFIX SIZE_BYTES SHARDS
    python bench_load.py run LOADER ENDPOINT BUCKET PREFIX DEVICE CONCURRENCY   (one load; prints JSON)
    python bench_load.py compare ENDPOINT BUCKET PREFIX DEVICE ROUNDS CONCURRENCY LOADERS
    python bench_load.py copyrate DEVICE       (host-to-device copies, pinned and pageable)
"""

import json
import os
import resource
import statistics
import subprocess
import sys
import time
import urllib.request

MIB = 1 << 20


def s3_client(endpoint):
    import boto3
    import botocore.config

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        config=botocore.config.Config(max_pool_connections=64, s3={"addressing_style": "path"}),
    )


def make(endpoint, bucket, prefix, size, shards):
    """A Llama-like bf16 model: per layer four 2-D weights and a norm,
    split into `shards` files with an index."""
    import tempfile

    import safetensors.torch as st
    import torch

    s3 = s3_client(endpoint)
    try:
        s3.create_bucket(Bucket=bucket)
    except s3.exceptions.ClientError:
        pass
    hidden = 2048
    per_layer = (3 * hidden * hidden + hidden * 5632) * 2
    layers = max(1, size // per_layer)
    g = torch.Generator().manual_seed(0)
    names = []
    for i in range(layers):
        names += [
            (f"model.layers.{i}.self_attn.qkv_proj.weight", (2 * hidden, hidden)),
            (f"model.layers.{i}.self_attn.o_proj.weight", (hidden, hidden)),
            (f"model.layers.{i}.mlp.up_proj.weight", (5632, hidden)),
            (f"model.layers.{i}.input_layernorm.weight", (hidden,)),
        ]
    per_shard = -(-len(names) // shards)
    index = {"metadata": {}, "weight_map": {}}
    with tempfile.TemporaryDirectory() as d:
        for s in range(shards):
            part = {n: torch.randn(shape, generator=g).to(torch.bfloat16) for n, shape in names[s * per_shard : (s + 1) * per_shard]}
            if not part:
                break
            fname = f"model-{s + 1:05}-of-{shards:05}.safetensors"
            st.save_file(part, os.path.join(d, fname))
            s3.upload_file(os.path.join(d, fname), bucket, prefix + fname)
            os.remove(os.path.join(d, fname))
            for n in part:
                index["weight_map"][n] = fname
    s3.put_object(Bucket=bucket, Key=prefix + "model.safetensors.index.json", Body=json.dumps(index).encode())
    s3.put_object(Bucket=bucket, Key=prefix + "config.json", Body=b"{}")


def files(endpoint, bucket, prefix):
    s3 = s3_client(endpoint)
    keys = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [(o["Key"], o["Size"]) for o in page.get("Contents", []) if o["Key"].endswith(".safetensors")]
    return sorted(keys)


def run(loader, endpoint, bucket, prefix, device, concurrency):
    """One load into `device`; prints seconds, bytes, the CPU seconds of the
    load itself (imports and the listing excluded) and the peak RSS."""
    import torch

    dev = torch.device(device)
    keys = files(endpoint, bucket, prefix)
    if loader == "tarn":
        import tarn.loader
        import tarn.objects
    elif loader == "runai":
        from runai_model_streamer import SafetensorsStreamer
    elif loader == "boto3":
        from concurrent.futures import ThreadPoolExecutor

        import safetensors.torch as st

        s3 = s3_client(endpoint)
    else:
        raise SystemExit(f"unknown loader {loader}")
    if dev.type == "cuda":
        torch.zeros(1, device=dev)  # CUDA initialized before the clock starts, for every loader
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.monotonic()
    nbytes = 0
    if loader == "tarn":
        c = tarn.objects.Client(endpoint, connections=concurrency)
        for _, t in tarn.loader.stream(f"s3://{bucket}/{prefix}", device=dev, client=c):
            nbytes += t.numel() * t.element_size()
    elif loader == "runai":
        with SafetensorsStreamer() as s:
            s.stream_files([f"s3://{bucket}/{k}" for k, _ in keys])
            for _, t in s.get_tensors():
                t = t.to(dev)
                nbytes += t.numel() * t.element_size()
    elif loader == "boto3":
        chunk = 8 * MIB
        with ThreadPoolExecutor(concurrency) as ex:
            for key, size in keys:
                buf = bytearray(size)

                def get(a, key=key, size=size, buf=buf):
                    b = min(size, a + chunk)
                    body = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={a}-{b - 1}")["Body"].read()
                    buf[a:b] = body

                list(ex.map(get, range(0, size, chunk)))
                for _, t in st.load(bytes(buf)).items():
                    t = t.to(dev)
                    nbytes += t.numel() * t.element_size()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    secs = time.monotonic() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru.ru_utime + ru.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    print(json.dumps({"seconds": secs, "bytes": nbytes, "cpu_seconds": cpu, "max_rss_kib": ru.ru_maxrss}))


def requests_counted(metrics_url):
    if not metrics_url:
        return None
    req = urllib.request.Request(
        metrics_url, headers={"Authorization": f"Bearer {os.environ.get('AWS_SECRET_ACCESS_KEY', '')}"}
    )
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("tarn_requests_total{"))


def compare(endpoint, bucket, prefix, device, rounds, concurrency, loaders):
    metrics = os.environ.get("TARN_METRICS_URL")
    loaders = loaders.split(",")
    results = {name: [] for name in loaders}
    env = dict(os.environ)
    env.setdefault("AWS_EC2_METADATA_DISABLED", "true")
    env.setdefault("RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING", "0")
    env.setdefault("RUNAI_STREAMER_CONCURRENCY", str(concurrency))
    env["AWS_ENDPOINT_URL"] = endpoint
    for r in range(rounds):
        order = loaders[r % len(loaders) :] + loaders[: r % len(loaders)]
        for name in order:
            before = requests_counted(metrics)
            out = subprocess.run(
                [sys.executable, __file__, "run", name, endpoint, bucket, prefix, device, str(concurrency)],
                env=env, capture_output=True, text=True,
            )
            if out.returncode != 0:
                raise SystemExit(f"{name} failed:\n{out.stdout}\n{out.stderr}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            after = requests_counted(metrics)
            res["requests"] = None if before is None else int(after - before)
            results[name].append(res)
            print(f"round {r + 1} {name}: {res['bytes'] / res['seconds'] / 1e9:.2f} GB/s", file=sys.stderr)
    base = "runai" if "runai" in loaders else loaders[0]
    med = {n: statistics.median(x["bytes"] / x["seconds"] / 1e9 for x in results[n]) for n in loaders}
    print(f"| loader | GB/s (median of {rounds}) | vs {base} | CPU s per GB | peak RSS MiB | requests |")
    print("|---|---|---|---|---|---|")
    for n in loaders:
        xs = results[n]
        cpu = statistics.median(x["cpu_seconds"] / (x["bytes"] / 1e9) for x in xs)
        rss = max(x["max_rss_kib"] for x in xs) / 1024
        reqs = xs[-1]["requests"]
        print(f"| {n} | {med[n]:.2f} | {med[n] / med[base]:.2f}x | {cpu:.2f} | {rss:.0f} | {reqs if reqs is not None else '-'} |")


def copyrate(device):
    """GB/s of 1 GiB host-to-device copies from pinned and from pageable
    memory (median of 5): the other ceiling of a load onto a GPU."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return
    n = 1 << 30
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    for kind, src in (("pinned", torch.ones(n, dtype=torch.uint8).pin_memory()), ("pageable", torch.ones(n, dtype=torch.uint8))):
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.monotonic()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.monotonic() - t0)
        print(f"host-to-device copy, {kind}: {n / statistics.median(times[1:]) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "make":
        make(args[0], args[1], args[2], int(args[3]), int(args[4]))
    elif cmd == "run":
        run(args[0], args[1], args[2], args[3], args[4], int(args[5]))
    elif cmd == "copyrate":
        copyrate(args[0])
    elif cmd == "compare":
        compare(args[0], args[1], args[2], args[3], int(args[4]), int(args[5]), args[6])
    else:
        raise SystemExit(__doc__)
