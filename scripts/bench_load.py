"""Model load benchmark, driven by scripts/bench-load: the same safetensors
model from the same S3 endpoint, loaded by the Tarn loader,
runai-model-streamer and boto3 (parallel ranged GETs, then
safetensors.torch.load), in alternation, each load in a fresh process.
Reports GB/s to the destination, CPU seconds per GB, peak RSS and the
requests the server counted.

    python bench_load.py make ENDPOINT BUCKET PREFIX SIZE_BYTES SHARDS [DEVICE]
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

import bench_model

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


def make(endpoint, bucket, prefix, size, shards, device=None):
    """A Llama-shaped bf16 model (scripts/bench_model.py) of about `size`
    bytes in `shards` safetensors files with an index, made on `device`
    (default: the GPU if there is one, which makes 7.5 GiB at once) and
    uploaded with the Tarn object client. config.json names the tensor a
    load checks and the device kind that made it."""
    import safetensors.torch as st
    import torch

    import tarn.objects

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    bench_model.create_bucket(endpoint, bucket)
    client = tarn.objects.Client(endpoint)
    names = bench_model.shapes(size)
    per_shard = -(-len(names) // shards)
    index = {"metadata": {}, "weight_map": {}}
    for s in range(shards):
        first = s * per_shard
        part = {n: bench_model.tensor(first + j, shape, device).cpu()
                for j, (n, shape) in enumerate(names[first : first + per_shard])}  # fmt: skip
        if not part:
            break
        fname = f"model-{s + 1:05}-of-{shards:05}.safetensors"
        client.put(bucket, prefix + fname, st.save(part))
        for n in part:
            index["weight_map"][n] = fname
    i, name, shape = bench_model.probe(size)
    config = {"bench_probe": {"index": i, "name": name, "shape": list(shape), "made_on": device.type}}
    client.put(bucket, prefix + "model.safetensors.index.json", json.dumps(index).encode())
    client.put(bucket, prefix + "config.json", json.dumps(config).encode())
    print(json.dumps({"files": len(set(index["weight_map"].values())), "tensors": len(index["weight_map"]), "made_on": device.type}))


def check_probe(endpoint, bucket, prefix, got):
    """Compares the tensor a load kept (`got`) with the one the model was
    made from; raises if the bytes differ."""
    import torch

    import tarn.objects

    p = json.loads(tarn.objects.Client(endpoint).get(bucket, prefix + "config.json"))["bench_probe"]
    if got is None:
        raise SystemExit(f"the load brought no tensor {p['name']}")
    want = bench_model.tensor(p["index"], tuple(p["shape"]), p["made_on"]).to(got.device)
    if not torch.equal(got, want):
        raise SystemExit(f"{p['name']} differs from what was stored")


def files(endpoint, bucket, prefix):
    import tarn.objects

    listed = tarn.objects.Client(endpoint).list(bucket, prefix)
    return sorted((o.key, o.size) for o in listed if o.key.endswith(".safetensors"))


def run(loader, endpoint, bucket, prefix, device, concurrency):
    """One load into `device`; prints seconds, bytes, the CPU seconds of the
    load itself (imports and the listing excluded) and the peak RSS. Every
    loader keeps every tensor to the end, as a caller keeps the weights
    (memory it cannot give back to the next tensor); the tensor config.json
    names is compared with what was stored."""
    import torch

    import tarn.objects

    dev = torch.device(device)
    keys = files(endpoint, bucket, prefix)
    probe = json.loads(tarn.objects.Client(endpoint).get(bucket, prefix + "config.json"))["bench_probe"]["name"]
    kept = None
    weights = []
    if loader in ("tarn", "tarn-copy", "tarn-http", "tarn-reuse"):
        import tarn.loader
    elif loader in ("shards", "shards-reuse"):
        from concurrent.futures import ThreadPoolExecutor

        shards = data_shard_files()
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
    if loader in ("tarn", "tarn-copy", "tarn-http"):
        # `tarn-copy`: short-circuit reads copying into the tensors
        # (map_local=False) rather than mapping the shard files' pages.
        c = tarn.objects.Client(endpoint, connections=concurrency, local_reads=loader != "tarn-http")
        load = tarn.loader.stream(f"s3://{bucket}/{prefix}", device=dev, client=c, map_local=loader == "tarn")
        for name, t in load:
            nbytes += t.numel() * t.element_size()
            kept = t if name == probe else kept
            weights.append(t)
        st = c.stats()
        if loader != "tarn-http" and not st["local_bytes"]:
            raise SystemExit(f"no short-circuit reads happened: {st}")
        mappable = any(t.numel() * t.element_size() >= tarn.loader.MAP_MIN_BYTES for t in weights)
        if loader == "tarn" and dev.type == "cpu" and mappable and not st["local_mapped_bytes"]:
            raise SystemExit(f"no mapped reads happened: {st}")
    elif loader == "tarn-reuse":
        # The object client under the loader, with short-circuit reads: the
        # model's files read whole, one after the other, into one buffer it
        # reuses (faulted in by the first file), as `shards-reuse` reads.
        c = tarn.objects.Client(endpoint, connections=concurrency)
        buf = torch.empty(max(size for _, size in keys), dtype=torch.uint8)
        for key, size in keys:
            c.read([(bucket, key, 0, size, buf, 0)])
            nbytes += buf[:size].to(dev).numel()
        if not c.stats()["local_bytes"]:
            raise SystemExit(f"no short-circuit reads happened: {c.stats()}")
    elif loader in ("shards", "shards-reuse"):
        # The ceiling: the data shard files the model's objects are in, read
        # whole by a plain parallel reader (8 MiB preads into one buffer per
        # file, no checksum), then handed to the device. `shards` keeps
        # what it read to the end, as a loader's caller keeps the weights:
        # every byte lands in memory the process never touched before, as
        # the loaders' tensors do. `shards-reuse` drops each file's buffer
        # once handed on, and the allocator gives the same memory to the
        # next file (the files are a few MiB each): reading into memory
        # already faulted in, which no loader that hands out new tensors
        # does.
        keep = [] if loader == "shards" else None
        chunk = 8 * MIB

        def read_file(path):
            size = os.path.getsize(path)
            buf = torch.empty(size, dtype=torch.uint8)
            view = memoryview(buf.numpy())
            fd = os.open(path, os.O_RDONLY)
            try:
                with ThreadPoolExecutor(max(1, concurrency // 4)) as inner:
                    list(inner.map(lambda a: os.preadv(fd, [view[a : min(size, a + chunk)]], a), range(0, size, chunk)))
            finally:
                os.close(fd)
            return buf

        with ThreadPoolExecutor(4) as ex:
            for buf in ex.map(read_file, shards):
                out = buf.to(dev)
                nbytes += out.numel()
                if keep is not None:
                    keep.append(out)
    elif loader == "runai":
        with SafetensorsStreamer() as s:
            s.stream_files([f"s3://{bucket}/{k}" for k, _ in keys])
            for name, t in s.get_tensors():
                # The streamer reuses its host buffers: a caller keeping the
                # weights in host memory copies them out.
                t = t.to(dev) if dev.type != "cpu" else t.clone()
                nbytes += t.numel() * t.element_size()
                kept = t if name == probe else kept
                weights.append(t)
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
                for name, t in st.load(bytes(buf)).items():
                    t = t.to(dev)
                    nbytes += t.numel() * t.element_size()
                    kept = t if name == probe else kept
                    weights.append(t)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    secs = time.monotonic() - t0
    ru = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru.ru_utime + ru.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    if not loader.startswith("shards") and loader != "tarn-reuse":
        check_probe(endpoint, bucket, prefix, kept)
    faults = ru.ru_minflt - ru0.ru_minflt
    print(json.dumps({"seconds": secs, "bytes": nbytes, "cpu_seconds": cpu, "max_rss_kib": ru.ru_maxrss, "minor_faults": faults}))


def data_shard_files():
    """The data shard files under the drives in TARN_BENCH_DRIVES (their
    footer names a shard index below the data shard count, TARN_BENCH_K)."""
    import glob

    drives = os.environ.get("TARN_BENCH_DRIVES", "").split()
    if not drives:
        raise SystemExit("the shards reader needs TARN_BENCH_DRIVES (bench-load sets it when it starts the server)")
    k = int(os.environ.get("TARN_BENCH_K", "2"))
    out = []
    for d in drives:
        for path in glob.glob(os.path.join(d, "data", "*", "*")):
            with open(path, "rb") as f:
                f.seek(-32, os.SEEK_END)
                footer = f.read(32)
            if footer[:4] == b"TRNS" and footer[6] < k:
                out.append(path)
    return out


def server_cpu_seconds():
    """User + system CPU seconds of the server (TARN_SERVER_PID), or None."""
    pid = os.environ.get("TARN_SERVER_PID")
    if not pid:
        return None
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
            cpu0 = server_cpu_seconds()
            out = subprocess.run(
                [sys.executable, __file__, "run", name, endpoint, bucket, prefix, device, str(concurrency)],
                env=env, capture_output=True, text=True,
            )
            if out.returncode != 0:
                raise SystemExit(f"{name} failed:\n{out.stdout}\n{out.stderr}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            after = requests_counted(metrics)
            cpu1 = server_cpu_seconds()
            res["requests"] = None if before is None else int(after - before)
            res["server_cpu"] = None if cpu0 is None else cpu1 - cpu0
            results[name].append(res)
            print(f"round {r + 1} {name}: {res['bytes'] / res['seconds'] / 1e9:.2f} GB/s", file=sys.stderr)
    base = "runai" if "runai" in loaders else loaders[0]
    med = {n: statistics.median(x["bytes"] / x["seconds"] / 1e9 for x in results[n]) for n in loaders}
    print(f"| loader | GB/s (median of {rounds}) | vs {base} | client CPU s per GB | server CPU s per GB | peak RSS MiB | requests |")
    print("|---|---|---|---|---|---|---|")
    for n in loaders:
        xs = results[n]
        cpu = statistics.median(x["cpu_seconds"] / (x["bytes"] / 1e9) for x in xs)
        scpu = [x["server_cpu"] / (x["bytes"] / 1e9) for x in xs if x.get("server_cpu") is not None]
        scpu = f"{statistics.median(scpu):.2f}" if scpu else "-"
        rss = max(x["max_rss_kib"] for x in xs) / 1024
        reqs = xs[-1]["requests"]
        print(f"| {n} | {med[n]:.2f} | {med[n] / med[base]:.2f}x | {cpu:.2f} | {scpu} | {rss:.0f} | {reqs if reqs is not None else '-'} |")


def copy_rates(device, n=1 << 30):
    """{"pinned": GB/s, "pageable": GB/s} of `n`-byte host-to-device copies
    (median of 5 after one warm-up): the other ceiling of a load onto a
    GPU. Empty on a device that is not a GPU."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return {}
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    out = {}
    for kind, src in (("pinned", torch.ones(n, dtype=torch.uint8).pin_memory()), ("pageable", torch.ones(n, dtype=torch.uint8))):
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            t0 = time.monotonic()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.monotonic() - t0)
        out[kind] = n / statistics.median(times[1:]) / 1e9
    return out


def copyrate(device):
    for kind, gbps in copy_rates(device).items():
        print(f"host-to-device copy, {kind}: {gbps:.1f} GB/s")


if __name__ == "__main__":
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "make":
        make(args[0], args[1], args[2], int(args[3]), int(args[4]), *args[5:6])
    elif cmd == "run":
        run(args[0], args[1], args[2], args[3], args[4], int(args[5]))
    elif cmd == "copyrate":
        copyrate(args[0])
    elif cmd == "compare":
        compare(args[0], args[1], args[2], args[3], int(args[4]), int(args[5]), args[6])
    else:
        raise SystemExit(__doc__)
