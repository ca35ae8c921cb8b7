"""Cache bucket benchmark, driven by scripts/bench-cache: the same
safetensors model loaded with tarn.loader from the upstream directly,
through a cache bucket cold and warm, and from a plain bucket of the cache's
server, each load in a fresh process (warm and plain interleaved, with the
page cache holding both, then, where it may be dropped (root), dropped
before each load); a prefetch of it; the same through an upstream slowed to
a given rate by a proxy, and a prefetch through it. Prints a Markdown table: GB/s,
the share of its reference, and the bytes read from the upstream.

    python bench_cache.py UPSTREAM CACHE CACHE_ADMIN TARN_BIN SIZE_BYTES ROUNDS SLOW_BYTES_PER_SEC
"""

import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

import bench_load  # noqa: E402
from faultproxy import FaultProxy  # noqa: E402

MIB = 1 << 20


def load(endpoint, bucket, prefix, concurrency=16):
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "bench_load.py"), "run", "tarn", endpoint, bucket, prefix, "cpu",
         str(concurrency)],
        capture_output=True, text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"load of s3://{bucket}/{prefix} at {endpoint} failed:\n{out.stdout}\n{out.stderr}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["bytes"] / r["seconds"] / 1e9


def admin(bin_, admin_url, *args):
    r = subprocess.run([bin_, "admin", "--endpoint", admin_url, "--token", os.environ["AWS_SECRET_ACCESS_KEY"],
                        "cache", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"tarn admin cache {args}: {r.stderr}")
    return r.stdout


def status(bin_, admin_url, bucket):
    return next(b for b in json.loads(admin(bin_, admin_url, "status", "--json")) if b["bucket"] == bucket)


def drop_page_cache():
    """Empties the kernel's page cache (root only): whether it could."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def upstream_get_rate(bin_, endpoint):
    """The upstream's GET rate by tarn bench's own client (8 MiB objects,
    the prefetch's chunk, at its concurrency)."""
    out = subprocess.run([bin_, "bench", "s3", "--endpoint", endpoint, "--op", "get", "--size", "8MiB",
                          "--objects", "64", "--concurrency", "32", "--duration", "5s", "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["mb_per_sec"] / 1e3


def main():
    upstream, cache, cache_admin, bin_ = sys.argv[1:5]
    size, rounds, slow = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7])
    rows = []
    bench_load.make(upstream, "origin", "model/", size, 4, "cpu")
    bench_load.make(cache, "plain", "model/", size, 4, "cpu")
    admin(bin_, cache_admin, "add", "cached", "--upstream", "s3://origin/", "--upstream-endpoint", upstream,
          "--validate", "never")

    def rounds_of(fn):
        return statistics.median(fn() for _ in range(rounds))

    load(upstream, "origin", "model/")  # untimed: the page cache holds it, as below
    direct = rounds_of(lambda: load(upstream, "origin", "model/"))
    colds, ups = [], []
    for _ in range(rounds):
        admin(bin_, cache_admin, "drop", "cached", "--prefix", "model/")
        before = status(bin_, cache_admin, "cached")["bytes_from_upstream"]
        colds.append(load(cache, "cached", "model/"))
        # What the cold load read through without keeping (every fill slot
        # taken) is kept now: the warm loads find everything cached.
        admin(bin_, cache_admin, "prefetch", "cached", "--prefix", "model/", "--wait")
        ups.append(status(bin_, cache_admin, "cached")["bytes_from_upstream"] - before)
    cold = statistics.median(colds)
    # Warm against plain in the same state: the page cache holds both (one
    # untimed load each first), loads interleaved; then, where this process
    # may drop the page cache, both read from the drives.
    mid = status(bin_, cache_admin, "cached")["bytes_from_upstream"]
    load(cache, "plain", "model/")
    load(cache, "cached", "model/")
    plains, warms = [], []
    for _ in range(rounds):
        plains.append(load(cache, "plain", "model/"))
        warms.append(load(cache, "cached", "model/"))
    plain, warm = statistics.median(plains), statistics.median(warms)
    dropped = None
    if drop_page_cache():
        dplains, dwarms = [], []
        for _ in range(rounds):
            drop_page_cache()
            dplains.append(load(cache, "plain", "model/"))
            drop_page_cache()
            dwarms.append(load(cache, "cached", "model/"))
        dropped = statistics.median(dplains), statistics.median(dwarms)
    warm_up = status(bin_, cache_admin, "cached")["bytes_from_upstream"] - mid
    rows.append(("direct from the upstream (tarn.loader)", direct, "-", "all"))
    rows.append(("cache, cold (streams while filling)", cold, f"{cold / direct:.0%} of direct",
                 f"{statistics.median(ups) / MIB:.0f} MiB (with the prefetch that keeps what it read through)"))
    rows.append(("plain bucket on the cache's server, page cache hot", plain, "-", "0"))
    rows.append(("cache, warm, page cache hot", warm, f"{warm / plain:.0%} of plain", f"{warm_up} B"))
    if dropped:
        rows.append(("plain bucket, page cache dropped before each load", dropped[0], "-", "0"))
        rows.append(("cache, warm, page cache dropped before each load", dropped[1],
                     f"{dropped[1] / dropped[0]:.0%} of plain", "0"))
    get_rate = upstream_get_rate(bin_, upstream)
    pf = []
    for _ in range(rounds):
        admin(bin_, cache_admin, "drop", "cached", "--prefix", "model/")
        job = json.loads(admin(bin_, cache_admin, "prefetch", "cached", "--prefix", "model/", "--wait", "--json"))
        pf.append(job["bytes_per_second"] / 1e9)
    rows.append(("upstream GET rate (tarn bench s3, 8 MiB x 32)", get_rate, "-", "all"))
    rows.append(("prefetch of the model", statistics.median(pf), f"{statistics.median(pf) / get_rate:.0%} of GET rate", "all"))

    if slow:
        host, port = upstream.rsplit("//", 1)[1].rsplit(":", 1)
        proxy = FaultProxy(host, int(port))
        proxy.limit(slow)
        try:
            admin(bin_, cache_admin, "add", "slowcache", "--upstream", "s3://origin/", "--upstream-endpoint",
                  proxy.endpoint, "--validate", "never")
            sdirect = load(proxy.endpoint, "origin", "model/")
            before = status(bin_, cache_admin, "slowcache")["bytes_from_upstream"]
            scold = load(cache, "slowcache", "model/")
            admin(bin_, cache_admin, "prefetch", "slowcache", "--prefix", "model/", "--wait")
            sup = status(bin_, cache_admin, "slowcache")["bytes_from_upstream"] - before
            load(cache, "slowcache", "model/")
            swarm = load(cache, "slowcache", "model/")
            sget = upstream_get_rate(bin_, proxy.endpoint)
            admin(bin_, cache_admin, "drop", "slowcache", "--prefix", "model/")
            job = json.loads(admin(bin_, cache_admin, "prefetch", "slowcache", "--prefix", "model/", "--wait",
                                   "--json"))
            spf = job["bytes_per_second"] / 1e9
        finally:
            proxy.close()
        label = f"{slow * 8 / 1e9:.1f} Gbit/s"
        rows.append((f"direct from the upstream at {label}", sdirect, "-", "all"))
        rows.append(("cache over it, cold", scold, f"{scold / sdirect:.0%} of direct", f"{sup / MIB:.0f} MiB"))
        rows.append(("cache over it, warm (page cache hot)", swarm, f"{swarm / plain:.0%} of plain", "0"))
        rows.append((f"its GET rate (tarn bench s3, 8 MiB x 32)", sget, "-", "all"))
        rows.append(("prefetch over it", spf, f"{spf / sget:.0%} of its GET rate", "all"))

    print(f"model {size / MIB:.0f} MiB in 4 files; median of {rounds} load(s) each, each in a fresh process")
    print("| load | GB/s | vs | from the upstream |")
    print("|---|---|---|---|")
    for name, gbps, vs, up in rows:
        print(f"| {name} | {gbps:.2f} | {vs} | {up} |")


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"({time.time() - t0:.0f} s)", file=sys.stderr)
