"""One rank of the distributed loader test (test_loader.py): joins a gloo
group, loads the model with the group, and writes what it got (a digest per
tensor) and what it fetched (its client's counters) to a JSON file.

    python loader_rank.py RANK WORLD INIT_FILE ENDPOINT URI OUT
"""

import hashlib
import json
import sys

import torch
import torch.distributed as dist

import tarn.loader
import tarn.objects
from tarnproc import ACCESS_KEY, SECRET_KEY


def main():
    rank, world, init, endpoint, uri, out = sys.argv[1:7]
    rank, world = int(rank), int(world)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        client = tarn.objects.Client(endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY)
        loader = tarn.loader.Loader(uri, "cpu", client=client, process_group=dist.group.WORLD)
        digests = {}
        for name, t in loader:
            raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            digests[name] = [str(t.dtype), list(t.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest()]
        with open(out, "w") as f:
            json.dump({"digests": digests, "stats": loader.stats}, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
