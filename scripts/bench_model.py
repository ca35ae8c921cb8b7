"""The Llama-shaped bf16 model the load and checkpoint benchmarks move
(scripts/bench_load.py, scripts/bench_checkpoint.py, scripts/gpu_checks.py):
per layer a fused QKV projection, an output projection, an up projection
and a norm. Every tensor is made from a seed of its own on the device it
lives on, so a model of 7.5 GiB appears on a GPU at once (no host tensors,
no copies), and one tensor can be made again to check what a load brought.
The values depend on the device kind that made them (CPU and CUDA
generators differ): a check makes its tensor on the device kind the model
was made on."""

MIB = 1 << 20


def shapes(size):
    """[(name, shape)] of a model of about `size` bytes in bf16: hidden size
    2048 (a 48 MiB layer) from 256 MiB up, 256 below, so a tiny model still
    has several layers."""
    hidden = 2048 if size >= 256 * MIB else 256
    inter = hidden * 11 // 4
    per_layer = (3 * hidden * hidden + hidden * inter + hidden) * 2
    out = []
    for i in range(max(1, size // per_layer)):
        for name, shape in (
            ("self_attn.qkv_proj.weight", (2 * hidden, hidden)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.up_proj.weight", (inter, hidden)),
            ("input_layernorm.weight", (hidden,)),
        ):
            out.append((f"model.layers.{i}.{name}", shape))
    return out


def tensor(index, shape, device):
    """Tensor number `index` of the model: normal bf16 values from its own
    seed, made on `device`."""
    import torch

    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(1000 + index)
    return torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)


def weights(size, device):
    """{name: tensor} of the whole model on `device`."""
    return {name: tensor(i, shape, device) for i, (name, shape) in enumerate(shapes(size))}


def probe(size):
    """(index, name, shape) of the tensor a check compares: one in the
    middle of the model."""
    s = shapes(size)
    i = len(s) // 2
    return i, s[i][0], s[i][1]


def nbytes(size):
    """Bytes of the tensors of a model of about `size` bytes."""
    total = 0
    for _, shape in shapes(size):
        n = 2
        for d in shape:
            n *= d
        total += n
    return total


def create_bucket(endpoint, bucket):
    """Makes `bucket` (one already there and ours is fine), signed with the
    credentials in AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY. Needs only
    `requests`, which GPU hosts with no package index have."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from sigv4 import signed_request

    r = signed_request(
        endpoint, "PUT", f"/{bucket}",
        access_key=os.environ["AWS_ACCESS_KEY_ID"], secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
    )  # fmt: skip
    if r.status_code != 200 and b"BucketAlreadyOwnedByYou" not in r.content:
        raise RuntimeError(f"creating bucket {bucket}: {r.status_code} {r.text}")
