"""A soak of the cluster under a random fault schedule, with the history
checker of tests/test_cluster_partitions.py (issue 40). Four nodes, each in
a network namespace with a data link and an etcd link, eight clients racing
`If-None-Match: *` creates, PUTs, DELETEs and GETs on four keys through
every node, while faults play one after another for MINUTES:

- a node cut off entirely for 10-20 s, then its data link back while its
  etcd link stays cut for 5-10 s, then etcd back;
- two or three nodes cut off from etcd only, for 30-60 s;
- a node killed (-9) and started again 3-5 s later;
- a node paused (SIGSTOP) for 3-8 s;
- etcd stopped for 5-10 s;
- two nodes cut off at once for 4-8 s.

It prints each fault, then the checker's verdict (every create found the
key absent, every refusal found it present, every read and the final reads
are allowed by the writes around them) and the worst write through the
untouched nodes in the 3-8 s after each heal. The next fault waits
`QUIET` seconds after a heal, so that what is measured after a heal is the
heal's and not the next fault's (with 4 s, writes caught by the next fault
counted against the heal before it: a kill's "12 s stall"). Exit status 1
on any violation.

    python scripts/soak_partitions.py [MINUTES] [SEED]      (scripts/soak-partitions)

With TARN_SOAK_OPS=FILE the whole history goes to FILE as JSON; with
TARN_SOAK_ROOT=DIR the nodes' drives and logs are kept in DIR.
"""

import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from clusterproc import Fabric  # noqa: E402
from history import name_of  # noqa: E402
from test_cluster_partitions import check, run, write_stalls  # noqa: E402


# Seconds from a heal to the next fault: past the 3-8 s window measured.
QUIET = 10


def schedule(fabric, minutes, rng):
    steps = [("start", lambda e, n: None, 3)]
    touched = []  # per step: the nodes its fault touched
    total = 3.0

    def add(what, action, wait, nodes=()):
        nonlocal total
        steps.append((what, action, wait))
        touched.append(set(nodes))
        total += wait

    while total < minutes * 60:
        kind = rng.choice(["cut", "etcd", "kill", "stop", "etcdstop", "two"])
        i = rng.randint(1, 4)
        if kind == "cut":
            add(f"n{i} cut off", lambda e, n, i=i: fabric.cut(i), rng.uniform(10, 20), [i])
            add(f"n{i} data back, etcd still cut", lambda e, n, i=i: fabric.restore_data(i), rng.uniform(5, 10), [i])
            add(f"n{i} etcd back", lambda e, n, i=i: fabric.restore_etcd(i), QUIET, [i])
        elif kind == "etcd":
            some = rng.sample(range(1, 5), rng.choice([2, 3]))
            add(f"{some} cut from etcd", lambda e, n, s=some: [fabric.cut_etcd(j) for j in s], rng.uniform(30, 60), some)
            add(f"{some} etcd back", lambda e, n, s=some: [fabric.restore_etcd(j) for j in s], QUIET, some)
        elif kind == "kill":
            add(f"n{i} killed", lambda e, n, i=i: (n[i - 1].signal(signal.SIGKILL), n[i - 1].proc.wait()),
                rng.uniform(3, 5), [i])
            add(f"n{i} started back", lambda e, n, i=i: (n[i - 1].start(), n[i - 1].wait_serving()), QUIET, [i])
        elif kind == "stop":
            add(f"n{i} paused", lambda e, n, i=i: n[i - 1].signal(signal.SIGSTOP), rng.uniform(3, 8), [i])
            add(f"n{i} resumed back", lambda e, n, i=i: n[i - 1].signal(signal.SIGCONT), QUIET, [i])
        elif kind == "etcdstop":
            add("etcd stopped", lambda e, n: e.stop(), rng.uniform(5, 10))
            add("etcd started back", lambda e, n: e.start(), QUIET)
        else:
            a, b = rng.sample(range(1, 5), 2)
            add(f"n{a}+n{b} cut off", lambda e, n, a=a, b=b: (fabric.cut(a), fabric.cut(b)), rng.uniform(4, 8), [a, b])
            add(f"n{a}+n{b} back", lambda e, n, a=a, b=b: (fabric.restore(a), fabric.restore(b)), QUIET, [a, b])
    return steps, touched


def main():
    minutes = float(sys.argv[1]) if len(sys.argv) > 1 else 5
    seed = int(sys.argv[2]) if len(sys.argv) > 2 else int(time.time())
    rng = random.Random(seed)
    fabric = Fabric.create(4)
    if fabric is None:
        raise SystemExit("soak-partitions: needs root and iproute2 (network namespaces, veth)")
    steps, touched = schedule(fabric, minutes, rng)
    print(f"soak: {len(steps)} steps over {minutes} min, seed {seed}", flush=True)
    keep = os.environ.get("TARN_SOAK_ROOT")
    with contextlib.nullcontext(keep) if keep else tempfile.TemporaryDirectory(prefix="tarn-soak-") as root:
        os.makedirs(root, exist_ok=True)
        try:
            ops, final, timeline, _ = run(root, fabric, steps)
        finally:
            fabric.remove()
    t0 = timeline[0][1]
    for what, t in timeline:
        print(f"  {t - t0:7.1f} s  {what}")
    errors = check(ops, final)
    done = [o for o in ops if o["ok"]]
    print(f"ops: {sum(1 for o in done if o.get('cond'))} creates succeeded, "
          f"{sum(1 for o in done if o['kind'] == 'refused')} refused (412), "
          f"{sum(1 for o in done if o['kind'] == 'put' and not o.get('cond'))} PUTs, "
          f"{sum(1 for o in done if o['kind'] == 'delete')} DELETEs, {sum(1 for o in done if o['kind'] == 'get')} GETs, "
          f"{sum(1 for o in ops if not o['ok'])} indeterminate")
    print("worst write after each heal, through the nodes the fault did not touch:")
    for (what, t), nodes in zip(timeline[1:], touched):
        if not what.endswith("back"):
            continue
        live = tuple(j for j in range(1, 5) if j not in nodes)
        took = write_stalls(ops, [t], live)
        worst = max(took, key=lambda w: w[1], default=None)
        said = ""
        if worst is not None and worst[1] > 2:
            o = worst[0]
            said = f" (via n{o['via']}, {o['key']}, +{o['start'] - t:.1f} s{', ' + o['error'][:100] if not o['ok'] else ''})"
        print(f"  {t - t0:7.1f} s  {what}: {worst[1] if worst else 0.0:.2f} s over {len(took)} writes{said}")
    if os.environ.get("TARN_SOAK_OPS"):
        # The whole history, for a closer look (each value by its name).
        with open(os.environ["TARN_SOAK_OPS"], "w") as f:
            json.dump({"timeline": timeline, "ops": [dict(o, value=name_of(o.get("value"))) for o in ops]}, f, default=str)
    print(f"violations: {len(errors)}")
    for e in errors[:20]:
        print("  " + e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
