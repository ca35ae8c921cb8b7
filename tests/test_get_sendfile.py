"""GET bodies from the shard files (issue 44): on a plain connection the bytes
a GET read from this node's shard files go to the socket from the files
(`sendfile`), the rest from memory; the client gets the same bytes either
way, whatever the geometry, size and range, with a corrupt block rebuilt
from parity (never sent from the file), and with `--no-sendfile`."""

import glob
import os
import random

import pytest

from conftest import data
from tarnproc import metric

SIZES = [1, 4095, 300 << 10, 1 << 20, (1 << 20) + 1, (3 << 20) + 12345, 20 << 20]


def bucket_of_sizes(s, tag):
    """A client and bucket "bkt" holding an object of each of SIZES (keys
    o<size>, bodies named by `tag`)."""
    c = s.client()
    c.create_bucket(Bucket="bkt")
    objs = {f"o{n}": data(f"{tag}-{n}", n) for n in SIZES}
    for k, v in objs.items():
        c.put_object(Bucket="bkt", Key=k, Body=v)
    return c, objs


def check_gets(c, bucket, objs, rng):
    for key, body in objs.items():
        assert c.get_object(Bucket=bucket, Key=key)["Body"].read() == body, key
        for _ in range(4):
            a = rng.randrange(len(body))
            b = rng.randrange(a, len(body))
            got = c.get_object(Bucket=bucket, Key=key, Range=f"bytes={a}-{b}")["Body"].read()
            assert got == body[a : b + 1], (key, a, b)


@pytest.mark.parametrize("drives", [1, 4, 6])
def test_plain_gets_send_shard_bytes_from_the_files(make_server, drives):
    s = make_server(drives=drives)
    c, objs = bucket_of_sizes(s, str(drives))
    # A multipart object: parts of their own shard files.
    mp = data("mp", (5 << 20) * 2 + 777)
    up = c.create_multipart_upload(Bucket="bkt", Key="mp")["UploadId"]
    parts = []
    for i, a in enumerate(range(0, len(mp), 5 << 20)):
        r = c.upload_part(Bucket="bkt", Key="mp", UploadId=up, PartNumber=i + 1, Body=mp[a : a + (5 << 20)])
        parts.append({"PartNumber": i + 1, "ETag": r["ETag"]})
    c.complete_multipart_upload(Bucket="bkt", Key="mp", UploadId=up, MultipartUpload={"Parts": parts})
    objs["mp"] = mp
    check_gets(c, "bkt", objs, random.Random(drives))
    sent = metric(s, "tarn_get_sendfile_bytes_total")
    # Most of what was read went from the files (inline objects and the
    # parts of stripes padded at the end are written from memory).
    assert sent > sum(len(v) for v in objs.values()) // 2, sent
    assert metric(s, "tarn_get_sendfile_fallbacks_total") == 0


def data_shard_files(s, k):
    out = []
    for path in glob.glob(os.path.join(s.root, "d*", "data", "*", "*")):
        with open(path, "rb") as f:
            f.seek(-32, os.SEEK_END)
            footer = f.read(32)
        if footer[:4] == b"TRNS" and footer[6] < k:
            out.append(path)
    return out


def flip_in_shard_0(files, at, mask):
    """XORs byte `at` of data shard 0's file (of `files`) with `mask`, on
    the drive (written and synced under the server)."""
    victim = next(f for f in files if open(f, "rb").read()[-32:][6] == 0)
    with open(victim, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))
        f.flush()
        os.fsync(f.fileno())


def test_a_corrupt_block_is_rebuilt_not_sent_from_its_file(make_server):
    s = make_server(drives=4, expected_errors=("failed its checksum", "corrupt", "reconstruct"))
    c = s.client()
    c.create_bucket(Bucket="bkt")
    body = data("corrupt", 8 << 20)
    c.put_object(Bucket="bkt", Key="k", Body=body)
    files = data_shard_files(s, 2)
    assert len(files) == 2, files
    # A byte of the second block of data shard 0, flipped under the server.
    flip_in_shard_0(files, (512 << 10) + 1000, 0xFF)
    assert c.get_object(Bucket="bkt", Key="k")["Body"].read() == body
    got = c.get_object(Bucket="bkt", Key="k", Range="bytes=500000-1600000")["Body"].read()
    assert got == body[500000:1600001]
    assert metric(s, "tarn_shards_reconstructed_total") >= 1


def test_no_sendfile_writes_every_body_from_memory(make_server):
    s = make_server(drives=4, extra_args=["--no-sendfile"])
    c, objs = bucket_of_sizes(s, "off")
    check_gets(c, "bkt", objs, random.Random(7))
    assert metric(s, "tarn_get_sendfile_bytes_total") == 0
