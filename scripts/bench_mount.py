"""Driver of scripts/bench-mount: one Tarn server, one bucket holding a large
file and a tree of small ones; each mount (tarn mount with and without
short-circuit reads and with --direct-io, s3fs-fuse, rclone mount) mounted fresh for each round
(so no page cache carries over), then a sequential read of the large file
and a read of every small file; and the object client (tarn.objects)
reading the same large file. Prints a Markdown table.

    python bench_mount.py ENDPOINT BIN SIZE_BYTES FILES FILE_BYTES ROUNDS DIR
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import boto3
from botocore.config import Config

import tarn.objects

BUCKET = "bench-mount"
CHUNK = 1 << 20


def s3(endpoint):
    return boto3.client("s3", endpoint_url=endpoint, config=Config(max_pool_connections=32, s3={"addressing_style": "path"}))


def prepare(endpoint, size, files, file_bytes):
    c = tarn.objects.Client(endpoint)
    c.create_bucket(BUCKET)
    body = bytearray(os.urandom(1 << 20)) * (size >> 20) + os.urandom(size % (1 << 20))
    c.put(BUCKET, "big.bin", body)
    small = os.urandom(file_bytes)
    with ThreadPoolExecutor(16) as ex:
        list(ex.map(lambda i: c.put(BUCKET, f"tree/{i // 1000:02d}/{i:05d}.bin", small), range(files)))


def mounted(path):
    with open("/proc/self/mountinfo") as f:
        return any(l.split(" ")[4] == path for l in f)


def mount(kind, endpoint, binary, at, dirs):
    os.makedirs(at, exist_ok=True)
    env = dict(os.environ)
    logf = open(os.path.join(dirs, f"{kind}.log"), "a")
    if kind in ("tarn", "tarn-http", "tarn-direct"):
        if kind == "tarn-http":
            env["TARN_LOCAL_READS"] = "0"
        cmd = [binary, "mount", f"s3://{BUCKET}", at, "--endpoint", endpoint, "--read-only", "--foreground"]
        if kind == "tarn-direct":
            cmd.append("--direct-io")
    elif kind == "s3fs":
        pw = os.path.join(dirs, "s3fs.passwd")
        with open(pw, "w") as f:
            f.write(f"{os.environ['AWS_ACCESS_KEY_ID']}:{os.environ['AWS_SECRET_ACCESS_KEY']}\n")
        os.chmod(pw, 0o600)
        cmd = ["s3fs", BUCKET, at, "-f", "-o", f"url={endpoint}", "-o", "use_path_request_style",
               "-o", f"passwd_file={pw}", "-o", "ro", "-o", "parallel_count=16", "-o", "multireq_max=16"]
    elif kind == "rclone":
        # rclone cannot take a CA bundle for plain HTTP (its transport
        # refuses AWS_CA_BUNDLE, which some machines set).
        env.pop("AWS_CA_BUNDLE", None)
        cmd = ["rclone", "mount", f":s3:{BUCKET}", at, "--s3-provider", "Other", "--s3-endpoint", endpoint,
               "--s3-access-key-id", os.environ["AWS_ACCESS_KEY_ID"],
               "--s3-secret-access-key", os.environ["AWS_SECRET_ACCESS_KEY"], "--read-only",
               "--vfs-cache-mode", "off", "--dir-cache-time", "1m"]
    else:
        raise SystemExit(f"unknown mount {kind}")
    p = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    while not mounted(at):
        if p.poll() is not None or time.monotonic() - t0 > 30:
            p.kill()
            raise SystemExit(f"{kind} did not mount (see {logf.name})")
        time.sleep(0.05)
    return p


def unmount(p, at):
    subprocess.run(["fusermount3", "-u", at], capture_output=True)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
        subprocess.run(["fusermount3", "-u", "-z", at], capture_output=True)


def read_file(path):
    n = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(CHUNK)
        while True:
            got = f.readinto(buf)
            if not got:
                return n
            n += got


def big(at):
    t0 = time.monotonic()
    n = read_file(os.path.join(at, "big.bin"))
    return n, time.monotonic() - t0


def tree(at):
    """Every small file read whole: one reader walking the tree, as tar or
    a dataset's single worker would."""
    t0 = time.monotonic()
    n = files = 0
    for root, _, names in os.walk(os.path.join(at, "tree")):
        for name in sorted(names):
            n += read_file(os.path.join(root, name))
            files += 1
    return n, files, time.monotonic() - t0


def objects_read(endpoint, size, local_reads=True):
    c = tarn.objects.Client(endpoint, local_reads=local_reads)
    buf = bytearray(size)
    t0 = time.monotonic()
    c.read([(BUCKET, "big.bin", 0, size, buf, 0)])
    return size / (time.monotonic() - t0)


def main():
    endpoint, binary, size, files, file_bytes, rounds, dirs = sys.argv[1:8]
    size, files, file_bytes, rounds = int(size), int(files), int(file_bytes), int(rounds)
    print(f"== uploading {size >> 20} MiB and {files} x {file_bytes >> 10} KiB", file=sys.stderr)
    prepare(endpoint, size, files, file_bytes)
    # Once before the rounds, so that no reader is the one that finds the
    # server's shard files out of the page cache.
    objects_read(endpoint, size)
    wanted = os.environ.get("TARN_BENCH_MOUNTS", "tarn,tarn-direct,tarn-http,s3fs,rclone").split(",")
    kinds = [k for k in wanted if k.startswith("tarn") or shutil.which(k)]
    res = {k: {"big": [], "tree": []} for k in kinds}
    res["tarn.objects"] = {"big": [], "tree": []}
    res["tarn.objects-http"] = {"big": [], "tree": []}
    for r in range(rounds):
        for k in kinds[r % len(kinds):] + kinds[: r % len(kinds)]:
            at = os.path.join(dirs, f"mnt-{k}")
            p = mount(k, endpoint, binary, at, dirs)
            try:
                n, s = big(at)
                assert n == size, (k, n)
                res[k]["big"].append(n / s)
            finally:
                unmount(p, at)
            p = mount(k, endpoint, binary, at, dirs)
            try:
                n, count, s = tree(at)
                assert count == files, (k, count)
                res[k]["tree"].append(count / s)
            finally:
                unmount(p, at)
            print(f"round {r + 1} {k}: {res[k]['big'][-1] / 1e9:.2f} GB/s, {res[k]['tree'][-1]:.0f} files/s", file=sys.stderr)
        res["tarn.objects"]["big"].append(objects_read(endpoint, size))
        res["tarn.objects-http"]["big"].append(objects_read(endpoint, size, local_reads=False))
    med = {k: {m: statistics.median(v) if v else None for m, v in d.items()} for k, d in res.items()}
    others = [med[k]["big"] for k in ("s3fs", "rclone") if k in med]
    best_other = max(others) if others else None
    best_tree = max([med[k]["tree"] for k in ("s3fs", "rclone") if k in med] or [0]) or None
    print(f"| reader | {size >> 20} MiB file, GB/s | rounds | vs best of s3fs/rclone | vs tarn.objects "
          f"(same path) | {files} x {file_bytes >> 10} KiB, files/s | vs best of s3fs/rclone |")
    print("|---|---|---|---|---|---|---|")
    for k in [*kinds, "tarn.objects", "tarn.objects-http"]:
        b, t = med[k]["big"], med[k]["tree"]
        rs = ", ".join(f"{x / 1e9:.2f}" for x in res[k]["big"])
        vs = f"{b / best_other:.2f}x" if best_other else "-"
        # The mount over HTTP against the object client over HTTP; every
        # other reader against the object client as it reads by default.
        ref = med["tarn.objects-http" if k == "tarn-http" else "tarn.objects"]["big"]
        vo = f"{b / ref:.0%}"
        tt = f"{t:.0f}" if t else "-"
        vt = f"{t / best_tree:.2f}x" if t and best_tree else "-"
        print(f"| {k} | {b / 1e9:.2f} | {rs} | {vs} | {vo} | {tt} | {vt} |")
    print(json.dumps({"rounds": res}), file=sys.stderr)


if __name__ == "__main__":
    main()
