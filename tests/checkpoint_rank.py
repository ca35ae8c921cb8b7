"""One rank of the distributed checkpoint tests (test_checkpoint.py): joins a
gloo group and saves or loads a sharded state dict through
tarn.checkpoint, then writes what happened to a JSON file.

    python checkpoint_rank.py MODE RANK WORLD INIT_FILE ENDPOINT URI OUT

MODE: save (DTensors sharded over the ranks, a replicated tensor, plain
values), load (the same into another sharding, compared with the full
tensors), async (two async_saves, the training state changed while the
first uploads), die (rank 2 exits in the middle of its upload).
"""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import tarn.checkpoint as ckpt
import tarn.objects
from tarnproc import ACCESS_KEY, SECRET_KEY

MIB = 1 << 20


def full_tensors():
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(64, 48, generator=g),
        "emb": torch.randn(100, 33, generator=g).to(torch.float16),
        "big": torch.randn(3 * MIB, generator=g).reshape(1536, 2048),  # 12 MiB: parts sent from its own memory
        "b": torch.arange(48, dtype=torch.bfloat16),
    }


def state(mesh, layout):
    full = full_tensors()
    return {
        "model": {
            "w": distribute_tensor(full["w"], mesh, [Shard(layout["w"])]),
            "emb": distribute_tensor(full["emb"], mesh, [Shard(layout["emb"])]),
            "big": distribute_tensor(full["big"], mesh, [Shard(layout["big"])]),
            "b": full["b"].clone(),
        },
        "extra": {"step": 7, "name": "run1", "ranks": [1, 2, 3]},
    }


def compare(sd, full):
    bad = []
    for k, want in full.items():
        got = sd["model"][k]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        if got.dtype != want.dtype or not torch.equal(got, want):
            bad.append(k)
    return bad


def main():
    mode, rank, world, init, endpoint, uri, out = sys.argv[1:8]
    rank, world = int(rank), int(world)
    dist.init_process_group(
        "gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    client = tarn.objects.Client(endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, retries=2)
    mesh = init_device_mesh("cpu", (world,))
    result = {"rank": rank}
    try:
        if mode == "save":
            sd = state(mesh, {"w": 0, "emb": 1, "big": 0})
            dcp.save(sd, storage_writer=ckpt.StorageWriter(uri, client=client, part_size=5 * MIB, upload_memory=10 * MIB))
        elif mode == "load":
            # Another sharding than the save's: w by columns (boxes that are
            # not one run of the stored rows), emb and big by rows.
            sd = state(mesh, {"w": 1, "emb": 0, "big": 0})
            for v in sd["model"].values():
                (v.to_local() if hasattr(v, "to_local") else v).zero_()
            sd["extra"] = {"step": 0, "name": "", "ranks": []}
            dcp.load(sd, storage_reader=ckpt.StorageReader(uri, client=client))
            result["mismatch"] = compare(sd, full_tensors())
            result["extra"] = sd["extra"]
        elif mode == "async":
            sd = state(mesh, {"w": 0, "emb": 1, "big": 0})
            w = ckpt.StorageWriter(uri + "/a", client=client, part_size=5 * MIB)
            fut = dcp.async_save(sd, storage_writer=w)
            # Training goes on as soon as async_save returns: the upload
            # must carry the state as it was when staged.
            for v in sd["model"].values():
                (v.to_local() if hasattr(v, "to_local") else v).add_(1)
            fut.result()
            first = w._staged
            fut = dcp.async_save(sd, storage_writer=w, checkpoint_id=uri + "/b")
            fut.result()
            result["reused"] = w._staged is first
            w.close()
            for name, bump in (("a", 0), ("b", 1)):
                got = state(mesh, {"w": 0, "emb": 1, "big": 0})
                for v in got["model"].values():
                    (v.to_local() if hasattr(v, "to_local") else v).zero_()
                dcp.load(got, storage_reader=ckpt.StorageReader(f"{uri}/{name}", client=client))
                want = {k: (t + bump).to(t.dtype) for k, t in full_tensors().items()}
                result[f"mismatch_{name}"] = compare(got, want)
        elif mode == "die":

            class Dying(ckpt.StorageWriter):
                def write_data(self, plan, planner):
                    if rank == 2:
                        # Half an upload, then gone.
                        up = client.multipart(self.bucket, self.prefix + plan.storage_data.name)
                        up.send(1, bytearray(5 * MIB))
                        up.wait(min=1)
                        os._exit(17)
                    return super().write_data(plan, planner)

            sd = state(mesh, {"w": 0, "emb": 1, "big": 0})
            dcp.save(sd, storage_writer=Dying(uri, client=client, part_size=5 * MIB))
            result["saved"] = True
        else:
            raise SystemExit(f"unknown mode {mode}")
    except Exception as e:  # reported to the test, which decides
        result["error"] = f"{type(e).__name__}: {e}"
        with open(out, "w") as f:
            json.dump(result, f)
        os._exit(3)  # a group with a dead member cannot be torn down cleanly
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
