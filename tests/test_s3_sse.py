"""Server-side encryption (issue 42): SSE-S3, SSE-KMS, SSE-C and bucket
default encryption. Before, every request that asked for encryption was
refused with 501. Now each object is sealed with its own data key (AES-256-GCM
per 64 KiB block), the data key kept only wrapped; what the drives hold has
none of the plaintext; ranged reads, multipart, copies, heal and the cluster
work on encrypted objects; and the refusals are AWS's."""

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys

import botocore.exceptions
import pytest
import requests

from conftest import data, md5hex
from tarnproc import ACCESS_KEY, SECRET_KEY, add_user, admin, metric, wait_for

MiB = 1 << 20
# A marker no drive holds unless an object's plaintext is stored there.
MARK = b"tarn-plaintext-marker-0123456789"


def key_line(name, seed):
    return f"{name}:{base64.b64encode(hashlib.sha256(seed.encode()).digest()).decode()}\n"


def key_bytes(seed):
    return hashlib.sha256(seed.encode()).digest()


def write_keys(path, *lines):
    path.write_text("".join(lines))
    path.chmod(0o600)
    return str(path)


def err(call):
    with pytest.raises(botocore.exceptions.ClientError) as e:
        call()
    r = e.value.response
    return r["ResponseMetadata"]["HTTPStatusCode"], r["Error"]["Code"]


def drive_bytes(server):
    """Every byte every drive holds (files read raw)."""
    out = []
    for d in server.drives:
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    with open(os.path.join(root, f), "rb") as fh:
                        out.append(fh.read())
                except OSError:
                    pass
    return b"".join(out)


def drive_states(server):
    r = requests.get(f"{server.admin}/admin/drives", headers={"Authorization": f"Bearer {SECRET_KEY}"})
    return [d["state"] for d in r.json()]


def marked(n, seed):
    """n bytes with the marker repeated through them."""
    body = bytearray(data(seed, n))
    for at in range(0, max(n - len(MARK), 0), 4096):
        body[at:at + len(MARK)] = MARK
    return bytes(body)


def customer(seed):
    return {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": key_bytes(seed)}


def copy_customer(seed):
    return {"CopySourceSSECustomerAlgorithm": "AES256", "CopySourceSSECustomerKey": key_bytes(seed)}


@pytest.fixture
def keyed(make_server, tmp_path):
    """A server with an SSE-S3 master key and two KMS keys."""

    def make(extra=(), **kw):
        master = write_keys(tmp_path / "master.keys", key_line("m1", "master-1"))
        kms = write_keys(tmp_path / "kms.keys", key_line("k1", "kms-1"), key_line("k2", "kms-2"))
        return make_server(extra_args=["--sse-master-key-file", master, "--kms-key-file", kms, *extra], **kw)

    return make


@pytest.mark.parametrize("defaults", ["aws", "legacy"])
def test_sse_s3_round_trip_and_what_the_drives_hold(keyed, make_server, defaults):
    server = keyed(["--bucket-defaults", defaults])
    s3 = server.client()
    s3.create_bucket(Bucket="enc")
    # The same bodies unencrypted, on another server, for their ETags.
    other = make_server(name="cmp").client()
    other.create_bucket(Bucket="cmp")
    bodies = {"empty": b"", "small": marked(3000, 1), "block": marked(64 * 1024, 2), "big": marked(3 * MiB + 17, 3)}
    for k, b in bodies.items():
        r = s3.put_object(Bucket="enc", Key=k, Body=b, ServerSideEncryption="AES256")
        assert r["ServerSideEncryption"] == "AES256"
        # SSE-S3 ETags are what the plaintext's would be (its MD5, or the
        # fast digest of large bodies), as AWS's.
        assert r["ETag"] == other.put_object(Bucket="cmp", Key=k, Body=b)["ETag"]
    plain = marked(300_000, 4)
    s3.put_object(Bucket="enc", Key="plain", Body=plain)
    for k, b in bodies.items():
        g = s3.get_object(Bucket="enc", Key=k)
        assert g["Body"].read() == b and g["ContentLength"] == len(b)
        assert g["ServerSideEncryption"] == "AES256"
        h = s3.head_object(Bucket="enc", Key=k)
        assert h["ContentLength"] == len(b) and h["ServerSideEncryption"] == "AES256"
    assert "ServerSideEncryption" not in s3.head_object(Bucket="enc", Key="plain")
    # Ranges across block boundaries read exactly their bytes.
    big = bodies["big"]
    for a, z in [(0, 0), (65535, 65536), (65536, 3 * 65536 + 5), (len(big) - 10, len(big) - 1), (1000, 2 * MiB)]:
        got = s3.get_object(Bucket="enc", Key="big", Range=f"bytes={a}-{z}")
        assert got["Body"].read() == big[a:z + 1], (a, z)
        assert got["ContentRange"] == f"bytes {a}-{z}/{len(big)}"
    assert s3.get_object(Bucket="enc", Key="big", Range="bytes=-5")["Body"].read() == big[-5:]
    # Listings and attributes give the plaintext's sizes.
    sizes = {o["Key"]: o["Size"] for o in s3.list_objects_v2(Bucket="enc")["Contents"]}
    assert sizes == {**{k: len(b) for k, b in bodies.items()}, "plain": len(plain)}
    attrs = s3.get_object_attributes(Bucket="enc", Key="big", ObjectAttributes=["ObjectSize", "ETag"])
    assert attrs["ObjectSize"] == len(big) and attrs["ETag"] == s3.head_object(Bucket="enc", Key="big")["ETag"].strip('"')
    # A Content-MD5 is checked against the plaintext.
    assert err(lambda: s3.put_object(Bucket="enc", Key="bad", Body=b"abc", ServerSideEncryption="AES256",
                                     ContentMD5=base64.b64encode(hashlib.md5(b"abd").digest()).decode())) == (400, "BadDigest")
    # Checksums (boto3 sends CRC trailers by default) are the plaintext's.
    c = s3.put_object(Bucket="enc", Key="sum", Body=b"x" * 100_000, ServerSideEncryption="AES256", ChecksumAlgorithm="SHA256")
    assert c["ChecksumSHA256"] == base64.b64encode(hashlib.sha256(b"x" * 100_000).digest()).decode()
    # The drives hold the unencrypted object's marker, no encrypted one's,
    # and not the master key.
    raw = drive_bytes(server)
    assert plain[100:164] in raw, "the scan finds plaintext where it is stored"
    for k in ("small", "block", "big"):
        assert bodies[k][100:164] not in raw, k
    assert key_bytes("master-1") not in raw
    assert base64.b64encode(key_bytes("master-1")) not in raw


def test_sse_s3_multipart_and_copies(keyed):
    server = keyed()
    s3 = server.client()
    s3.create_bucket(Bucket="mpu")
    parts = [marked(5 * MiB, 10), marked(5 * MiB + 3, 11), marked(70_000, 12)]
    up = s3.create_multipart_upload(Bucket="mpu", Key="obj", ServerSideEncryption="AES256")
    assert up["ServerSideEncryption"] == "AES256"
    etags = []
    for n, p in enumerate(parts, 1):
        r = s3.upload_part(Bucket="mpu", Key="obj", UploadId=up["UploadId"], PartNumber=n, Body=p)
        assert r["ServerSideEncryption"] == "AES256"
        etags.append(r["ETag"])
    listed = s3.list_parts(Bucket="mpu", Key="obj", UploadId=up["UploadId"])["Parts"]
    assert [p["Size"] for p in listed] == [len(p) for p in parts]
    done = s3.complete_multipart_upload(Bucket="mpu", Key="obj", UploadId=up["UploadId"],
                                        MultipartUpload={"Parts": [{"PartNumber": n, "ETag": e} for n, e in enumerate(etags, 1)]})
    assert done["ServerSideEncryption"] == "AES256"
    whole = b"".join(parts)
    assert s3.get_object(Bucket="mpu", Key="obj")["Body"].read() == whole
    # Ranges across part boundaries, and one part.
    a = len(parts[0]) - 100
    assert s3.get_object(Bucket="mpu", Key="obj", Range=f"bytes={a}-{a + len(parts[1]) + 200}")["Body"].read() == whole[a:a + len(parts[1]) + 201]
    p2 = s3.get_object(Bucket="mpu", Key="obj", PartNumber=2)
    assert p2["Body"].read() == parts[1] and p2["PartsCount"] == 3
    assert s3.head_object(Bucket="mpu", Key="obj", PartNumber=3)["ContentLength"] == len(parts[2])
    # Copies: encrypted to plain, plain to encrypted, onto itself with new encryption.
    s3.copy_object(Bucket="mpu", Key="plain-copy", CopySource={"Bucket": "mpu", "Key": "obj"})
    h = s3.head_object(Bucket="mpu", Key="plain-copy")
    assert "ServerSideEncryption" not in h and h["ContentLength"] == len(whole)
    assert s3.get_object(Bucket="mpu", Key="plain-copy")["Body"].read() == whole
    r = s3.copy_object(Bucket="mpu", Key="enc-copy", CopySource={"Bucket": "mpu", "Key": "plain-copy"}, ServerSideEncryption="AES256")
    assert r["ServerSideEncryption"] == "AES256"
    assert s3.get_object(Bucket="mpu", Key="enc-copy")["Body"].read() == whole
    r = s3.copy_object(Bucket="mpu", Key="plain-copy", CopySource={"Bucket": "mpu", "Key": "plain-copy"}, ServerSideEncryption="AES256")
    assert s3.head_object(Bucket="mpu", Key="plain-copy")["ServerSideEncryption"] == "AES256"
    # UploadPartCopy from an encrypted source into an encrypted upload.
    up = s3.create_multipart_upload(Bucket="mpu", Key="pc", ServerSideEncryption="AES256")
    pc = s3.upload_part_copy(Bucket="mpu", Key="pc", UploadId=up["UploadId"], PartNumber=1,
                             CopySource={"Bucket": "mpu", "Key": "obj"}, CopySourceRange="bytes=100-200099")
    s3.complete_multipart_upload(Bucket="mpu", Key="pc", UploadId=up["UploadId"],
                                 MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": pc["CopyPartResult"]["ETag"]}]})
    assert s3.get_object(Bucket="mpu", Key="pc")["Body"].read() == whole[100:200100]


def test_sse_c_needs_its_key_everywhere(keyed):
    server = keyed()
    s3 = server.client()
    s3.create_bucket(Bucket="cust")
    body = marked(200_000, 20)
    r = s3.put_object(Bucket="cust", Key="c", Body=body, **customer("alice"))
    assert r["SSECustomerAlgorithm"] == "AES256"
    assert r["SSECustomerKeyMD5"] == base64.b64encode(hashlib.md5(key_bytes("alice")).digest()).decode()
    # SSE-C ETags do not reveal the plaintext's MD5.
    assert r["ETag"].strip('"') != md5hex(body)
    g = s3.get_object(Bucket="cust", Key="c", **customer("alice"))
    assert g["Body"].read() == body and g["SSECustomerAlgorithm"] == "AES256"
    assert s3.get_object(Bucket="cust", Key="c", Range="bytes=70000-70009", **customer("alice"))["Body"].read() == body[70000:70010]
    assert s3.head_object(Bucket="cust", Key="c", **customer("alice"))["ContentLength"] == len(body)
    # Without the key, with another key, with a bad MD5: refused as AWS does.
    assert err(lambda: s3.get_object(Bucket="cust", Key="c")) == (400, "InvalidRequest")
    assert err(lambda: s3.head_object(Bucket="cust", Key="c"))[0] == 400
    assert err(lambda: s3.get_object(Bucket="cust", Key="c", **customer("mallory"))) == (403, "AccessDenied")
    assert err(lambda: s3.get_object_attributes(Bucket="cust", Key="c", ObjectAttributes=["ObjectSize"])) == (400, "InvalidRequest")
    bad_md5 = {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": base64.b64encode(key_bytes("alice")).decode(),
               "SSECustomerKeyMD5": base64.b64encode(b"0" * 16).decode()}
    assert err(lambda: s3.get_object(Bucket="cust", Key="c", **bad_md5)) == (400, "InvalidArgument")
    assert err(lambda: s3.put_object(Bucket="cust", Key="x", Body=b"1", SSECustomerAlgorithm="AES256",
                                     SSECustomerKey=b"short")) == (400, "InvalidArgument")
    assert err(lambda: s3.put_object(Bucket="cust", Key="x", Body=b"1", ServerSideEncryption="AES256",
                                     **customer("alice"))) == (400, "InvalidArgument")
    # A customer key for an object not encrypted with one.
    s3.put_object(Bucket="cust", Key="p", Body=b"plain")
    assert err(lambda: s3.get_object(Bucket="cust", Key="p", **customer("alice"))) == (400, "InvalidRequest")
    # Copies need the source's key; the target may take another.
    assert err(lambda: s3.copy_object(Bucket="cust", Key="d", CopySource={"Bucket": "cust", "Key": "c"}))[0] == 400
    s3.copy_object(Bucket="cust", Key="d", CopySource={"Bucket": "cust", "Key": "c"}, **copy_customer("alice"), **customer("bob"))
    assert s3.get_object(Bucket="cust", Key="d", **customer("bob"))["Body"].read() == body
    assert err(lambda: s3.get_object(Bucket="cust", Key="d", **customer("alice"))) == (403, "AccessDenied")
    # Multipart: every part needs the upload's key.
    up = s3.create_multipart_upload(Bucket="cust", Key="m", **customer("carol"))
    assert err(lambda: s3.upload_part(Bucket="cust", Key="m", UploadId=up["UploadId"], PartNumber=1, Body=b"x"))[0] == 400
    assert err(lambda: s3.upload_part(Bucket="cust", Key="m", UploadId=up["UploadId"], PartNumber=1, Body=b"x",
                                      **customer("dave"))) == (403, "AccessDenied")
    p1 = s3.upload_part(Bucket="cust", Key="m", UploadId=up["UploadId"], PartNumber=1, Body=marked(5 * MiB, 21), **customer("carol"))
    p2 = s3.upload_part_copy(Bucket="cust", Key="m", UploadId=up["UploadId"], PartNumber=2,
                             CopySource={"Bucket": "cust", "Key": "c"}, **copy_customer("alice"), **customer("carol"))
    s3.complete_multipart_upload(Bucket="cust", Key="m", UploadId=up["UploadId"], MultipartUpload={"Parts": [
        {"PartNumber": 1, "ETag": p1["ETag"]}, {"PartNumber": 2, "ETag": p2["CopyPartResult"]["ETag"]}]})
    assert s3.get_object(Bucket="cust", Key="m", **customer("carol"))["Body"].read() == marked(5 * MiB, 21) + body
    raw = drive_bytes(server)
    assert body[100:164] not in raw and key_bytes("alice") not in raw


def test_sse_kms_keys_bucket_keys_and_bucket_defaults(keyed, make_server):
    server = keyed()
    s3 = server.client()
    s3.create_bucket(Bucket="kms")
    r = s3.put_object(Bucket="kms", Key="a", Body=b"a" * 1000, ServerSideEncryption="aws:kms", SSEKMSKeyId="alias/k2")
    assert r["ServerSideEncryption"] == "aws:kms" and r["SSEKMSKeyId"] == "k2"
    assert r["ETag"].strip('"') != md5hex(b"a" * 1000)
    h = s3.head_object(Bucket="kms", Key="a")
    assert h["SSEKMSKeyId"] == "k2" and h["ServerSideEncryption"] == "aws:kms"
    r = s3.put_object(Bucket="kms", Key="b", Body=b"b", ServerSideEncryption="aws:kms", BucketKeyEnabled=True)
    assert r["SSEKMSKeyId"] == "k1" and r["BucketKeyEnabled"] is True
    g = s3.get_object(Bucket="kms", Key="b")
    assert g["Body"].read() == b"b" and g["BucketKeyEnabled"] is True
    ctx = base64.b64encode(b'{"project":"llm"}').decode()
    s3.put_object(Bucket="kms", Key="ctx", Body=b"c", ServerSideEncryption="aws:kms", SSEKMSEncryptionContext=ctx)
    assert s3.get_object(Bucket="kms", Key="ctx")["Body"].read() == b"c"
    assert err(lambda: s3.put_object(Bucket="kms", Key="x", Body=b"x", ServerSideEncryption="aws:kms",
                                     SSEKMSKeyId="nope")) == (400, "KMS.NotFoundException")
    assert err(lambda: s3.put_object(Bucket="kms", Key="x", Body=b"x", ServerSideEncryption="aws:kms",
                                     SSEKMSEncryptionContext="not json")) == (400, "InvalidArgument")
    assert err(lambda: s3.put_object(Bucket="kms", Key="x", Body=b"x", SSEKMSKeyId="k1")) == (400, "InvalidArgument")
    # Bucket default encryption.
    assert err(lambda: s3.get_bucket_encryption(Bucket="kms")) == (404, "ServerSideEncryptionConfigurationNotFoundError")
    rule = {"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": "k2"}, "BucketKeyEnabled": True}
    s3.put_bucket_encryption(Bucket="kms", ServerSideEncryptionConfiguration={"Rules": [rule]})
    got = s3.get_bucket_encryption(Bucket="kms")["ServerSideEncryptionConfiguration"]["Rules"]
    assert got == [rule]
    s3.put_object(Bucket="kms", Key="d", Body=b"default")
    h = s3.head_object(Bucket="kms", Key="d")
    assert h["ServerSideEncryption"] == "aws:kms" and h["SSEKMSKeyId"] == "k2" and h["BucketKeyEnabled"] is True
    # A request's own choice wins over the default.
    s3.put_object(Bucket="kms", Key="e", Body=b"e", ServerSideEncryption="AES256")
    assert s3.head_object(Bucket="kms", Key="e")["ServerSideEncryption"] == "AES256"
    s3.put_bucket_encryption(Bucket="kms", ServerSideEncryptionConfiguration={"Rules": [
        {"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]})
    s3.put_object(Bucket="kms", Key="f", Body=b"f")
    assert s3.head_object(Bucket="kms", Key="f")["ServerSideEncryption"] == "AES256"
    for bad in ({"SSEAlgorithm": "aws:kms", "KMSMasterKeyID": "nope"}, {"SSEAlgorithm": "AES256", "KMSMasterKeyID": "k1"}):
        assert err(lambda: s3.put_bucket_encryption(Bucket="kms", ServerSideEncryptionConfiguration={"Rules": [
            {"ApplyServerSideEncryptionByDefault": bad}]}))[0] == 400
    s3.delete_bucket_encryption(Bucket="kms")
    assert err(lambda: s3.get_bucket_encryption(Bucket="kms"))[0] == 404
    s3.put_object(Bucket="kms", Key="g", Body=b"g")
    assert "ServerSideEncryption" not in s3.head_object(Bucket="kms", Key="g")
    for k, b in {"a": b"a" * 1000, "d": b"default", "e": b"e", "f": b"f"}.items():
        assert s3.get_object(Bucket="kms", Key=k)["Body"].read() == b
    # A bucket-key object copied into another bucket (its key is derived
    # from the source bucket's, the copy's from the target's).
    s3.create_bucket(Bucket="kms2")
    s3.copy_object(Bucket="kms2", Key="b", CopySource={"Bucket": "kms", "Key": "b"},
                   ServerSideEncryption="aws:kms", BucketKeyEnabled=True)
    assert s3.get_object(Bucket="kms2", Key="b")["Body"].read() == b"b"
    # The same by a user the buckets' policies allow (a judged request: the
    # source's key comes from the source bucket, not the request's).
    erin = add_user(server, "erin")
    for b in ("kms", "kms2"):
        s3.put_bucket_policy(Bucket=b, Policy=(
            '{"Statement": [{"Effect": "Allow", "Principal": {"AWS": ["erin"]}, "Action": "s3:*",'
            f' "Resource": ["arn:aws:s3:::{b}", "arn:aws:s3:::{b}/*"]}}]}}'))
    e = server.client(erin)
    e.copy_object(Bucket="kms2", Key="by-erin", CopySource={"Bucket": "kms", "Key": "b"})
    assert e.get_object(Bucket="kms2", Key="by-erin")["Body"].read() == b"b"
    # Headers that choose an encryption where none can be chosen: refused,
    # never ignored (a part takes its upload's; a read its object's).
    up = s3.create_multipart_upload(Bucket="kms2", Key="parts")

    def with_header(event, name, value):
        def add(request, **_):
            request.headers[name] = value
        s3.meta.events.register(event, add)
        return add
    add = with_header("before-sign.s3.UploadPart", "x-amz-server-side-encryption", "AES256")
    assert err(lambda: s3.upload_part(Bucket="kms2", Key="parts", UploadId=up["UploadId"], PartNumber=1,
                                      Body=b"x")) == (400, "InvalidArgument")
    s3.meta.events.unregister("before-sign.s3.UploadPart", add)
    add = with_header("before-sign.s3.GetObject", "x-amz-server-side-encryption", "aws:kms")
    assert err(lambda: s3.get_object(Bucket="kms2", Key="b")) == (400, "InvalidArgument")
    s3.meta.events.unregister("before-sign.s3.GetObject", add)
    # A server without keys refuses what it cannot do, and stores nothing.
    bare = make_server(name="bare").client()
    bare.create_bucket(Bucket="nokeys")
    assert err(lambda: bare.put_object(Bucket="nokeys", Key="k", Body=b"x", ServerSideEncryption="AES256")) == (501, "NotImplemented")
    assert err(lambda: bare.put_object(Bucket="nokeys", Key="k", Body=b"x", ServerSideEncryption="aws:kms")) == (501, "NotImplemented")
    assert err(lambda: bare.put_bucket_encryption(Bucket="nokeys", ServerSideEncryptionConfiguration={"Rules": [
        {"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]})) == (501, "NotImplemented")
    assert err(lambda: bare.head_object(Bucket="nokeys", Key="k"))[0] == 404
    # SSE-C needs no server key.
    bare.put_object(Bucket="nokeys", Key="c", Body=b"cust", **customer("z"))
    assert bare.get_object(Bucket="nokeys", Key="c", **customer("z"))["Body"].read() == b"cust"


def test_master_key_rotation_rewrites_no_data(make_server, tmp_path):
    keys = tmp_path / "master.keys"
    write_keys(keys, key_line("m1", "one"))
    server = make_server(extra_args=["--sse-master-key-file", str(keys)],
                         expected_errors=[r"read failed", r"no longer holds"])
    s3 = server.client()
    s3.create_bucket(Bucket="rot")
    old = marked(2 * MiB, 30)
    s3.put_object(Bucket="rot", Key="old", Body=old, ServerSideEncryption="AES256")
    s3.put_object(Bucket="rot", Key="old-small", Body=b"tiny", ServerSideEncryption="AES256")
    shards_before = sorted(os.path.join(r, f) for d in server.drives for r, _, fs in os.walk(os.path.join(d, "data")) for f in fs)
    # Rotate: the new key first, the old one kept to read older objects.
    server.stop()
    write_keys(keys, key_line("m2", "two"), key_line("m1", "one"))
    server.start()
    s3 = server.client()
    assert s3.get_object(Bucket="rot", Key="old")["Body"].read() == old
    s3.put_object(Bucket="rot", Key="new", Body=b"new data", ServerSideEncryption="AES256")
    shards_after = sorted(os.path.join(r, f) for d in server.drives for r, _, fs in os.walk(os.path.join(d, "data")) for f in fs)
    assert set(shards_before) <= set(shards_after), "no shard of the old object was rewritten"
    # Only the new key left: new objects read, old ones are refused clearly
    # (never garbage).
    server.stop()
    write_keys(keys, key_line("m2", "two"))
    server.start()
    s3 = server.client()
    assert s3.get_object(Bucket="rot", Key="new")["Body"].read() == b"new data"
    for k in ("old", "old-small"):
        assert err(lambda: s3.get_object(Bucket="rot", Key=k)) == (500, "InternalError")
    # A bad key file stops the server from starting.
    server.stop()
    keys.write_text("m3:tooshort\n")
    with pytest.raises(Exception):
        server.start()
    write_keys(keys, key_line("m2", "two"), key_line("m1", "one"))
    server.start()
    s3 = server.client()
    assert s3.get_object(Bucket="rot", Key="old")["Body"].read() == old
    # Retiring m1: `tarn admin sse rewrap` rewraps every data key still
    # under it (versions too), rewriting no data; then m1 can go.
    s3.create_bucket(Bucket="rotv")
    s3.put_bucket_versioning(Bucket="rotv", VersioningConfiguration={"Status": "Enabled"})
    server.stop()
    write_keys(keys, key_line("m1", "one"), key_line("m2", "two"))
    server.start()
    s3 = server.client()
    v1 = s3.put_object(Bucket="rotv", Key="k", Body=b"first", ServerSideEncryption="AES256")["VersionId"]
    s3.put_object(Bucket="rotv", Key="k", Body=b"second", ServerSideEncryption="AES256")
    server.stop()
    write_keys(keys, key_line("m2", "two"), key_line("m1", "one"))
    server.start()
    shards_before = sorted(os.path.join(r, f) for d in server.drives for r, _, fs in os.walk(os.path.join(d, "data")) for f in fs)
    out = json.loads(admin(server, "sse", "rewrap", "--json").stdout)
    assert out == {"active_master_key": "m2", "versions_scanned": 5, "rewrapped": 4, "failed": 0}, out
    human = admin(server, "sse", "rewrap").stdout
    assert "0 rewrapped under master key m2, 0 failed" in human, human
    shards_after = sorted(os.path.join(r, f) for d in server.drives for r, _, fs in os.walk(os.path.join(d, "data")) for f in fs)
    assert shards_before == shards_after, "a rewrap rewrites no data"
    server.stop()
    write_keys(keys, key_line("m2", "two"))
    server.start()
    s3 = server.client()
    assert s3.get_object(Bucket="rot", Key="old")["Body"].read() == old
    assert s3.get_object(Bucket="rot", Key="old-small")["Body"].read() == b"tiny"
    assert s3.get_object(Bucket="rotv", Key="k", VersionId=v1)["Body"].read() == b"first"
    assert s3.get_object(Bucket="rotv", Key="k")["Body"].read() == b"second"


def test_encrypted_objects_read_after_drive_loss_and_heal(keyed):
    server = keyed(expected_errors=[r"drive faulty", r"drive offline", r"erasure set is degraded",
                                    r"lost write quorum", r"metadata write failed", r"shard write failed",
                                    r"cannot create shard file", r"read failed", r"shard"])
    s3 = server.client()
    s3.create_bucket(Bucket="heal")
    objs = {"s3": (marked(3 * MiB + 5, 40), {"ServerSideEncryption": "AES256"}),
            "kms": (marked(200_000, 41), {"ServerSideEncryption": "aws:kms"}),
            "tiny": (b"tiny secret", {"ServerSideEncryption": "AES256"}),
            "cust": (marked(1 * MiB, 42), customer("k"))}
    for k, (b, extra) in objs.items():
        s3.put_object(Bucket="heal", Key=k, Body=b, **extra)

    def read_all(c):
        for k, (b, extra) in objs.items():
            get = {kk: v for kk, v in extra.items() if kk.startswith("SSECustomer")}
            assert c.get_object(Bucket="heal", Key=k, **get)["Body"].read() == b, k
            if len(b) > 65546:
                assert c.get_object(Bucket="heal", Key=k, Range="bytes=65530-65545", **get)["Body"].read() == b[65530:65546], k

    # A drive's contents go while the server runs (a replaced disk): reads
    # reconstruct from parity, the drive is formatted and healed.
    wiped = server.drives[1]
    for name in os.listdir(wiped):
        p = os.path.join(wiped, name)
        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    read_all(s3)
    wait_for("the wipe to be noticed", lambda: metric(server, "tarn_drive_faults_total") >= 1)
    wait_for("the drive to rejoin", lambda: drive_states(server)[1] == "online")
    report = requests.post(f"{server.admin}/admin/heal", headers={"Authorization": f"Bearer {SECRET_KEY}"}).json()
    assert report["failures"] == 0, report
    # The healed drive carries its share: lose two others, read everything.
    server.stop()
    shutil.rmtree(server.drives[2])
    shutil.rmtree(server.drives[3])
    server.start()
    read_all(server.client())


def test_aws_cli_sse(keyed, tmp_path):
    server = keyed()
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1",
               AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null")
    aws = [os.path.join(os.path.dirname(sys.executable), "aws"), "--endpoint-url", server.endpoint]

    def run(*args):
        r = subprocess.run([*aws, *args], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, f"{args}: {r.stderr}"
        return r.stdout

    run("s3", "mb", "s3://cli")
    src = tmp_path / "f.bin"
    body = marked(9 * MiB + 3, 50)  # multipart in the CLI (8 MiB parts)
    src.write_bytes(body)
    ckey = tmp_path / "c.key"
    ckey.write_bytes(key_bytes("cli"))
    run("s3", "cp", str(src), "s3://cli/s3.bin", "--sse", "AES256", "--only-show-errors")
    run("s3", "cp", str(src), "s3://cli/kms.bin", "--sse", "aws:kms", "--sse-kms-key-id", "k2", "--only-show-errors")
    run("s3", "cp", str(src), "s3://cli/c.bin", "--sse-c", "AES256", "--sse-c-key", f"fileb://{ckey}", "--only-show-errors")
    assert '"SSEKMSKeyId": "k2"' in run("s3api", "head-object", "--bucket", "cli", "--key", "kms.bin")
    for name, extra in (("s3.bin", []), ("kms.bin", []), ("c.bin", ["--sse-c", "AES256", "--sse-c-key", f"fileb://{ckey}"])):
        out = tmp_path / f"out-{name}"
        run("s3", "cp", f"s3://cli/{name}", str(out), "--only-show-errors", *extra)
        assert out.read_bytes() == body, name
    r = subprocess.run([*aws, "s3", "cp", "s3://cli/c.bin", str(tmp_path / "x")], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "400" in r.stderr


def test_form_upload_encryption_must_be_in_its_policy(keyed):
    from test_s3_post import post
    server = keyed()
    s3 = server.client()
    s3.create_bucket(Bucket="forms")
    sse = {"x-amz-server-side-encryption": "AES256"}
    r = post(s3, "forms", "signed", b"form body", fields=sse, conditions=[sse])
    assert r.status_code == 204, r.text
    assert s3.head_object(Bucket="forms", Key="signed")["ServerSideEncryption"] == "AES256"
    assert s3.get_object(Bucket="forms", Key="signed")["Body"].read() == b"form body"

    def add(form):
        form["x-amz-server-side-encryption"] = "AES256"
    r = post(s3, "forms", "unsigned", b"x", tamper=add)
    assert r.status_code == 403 and "Extra input fields" in r.text, r.text
    assert err(lambda: s3.head_object(Bucket="forms", Key="unsigned"))[0] == 404


def test_encryption_in_a_cluster(tmp_path):
    from clusterproc import form, stop_all
    master = write_keys(tmp_path / "master.keys", key_line("m1", "cluster"))
    etcd, nodes = form(str(tmp_path), extra=["--sse-master-key-file", master])
    try:
        a, b = nodes[0].client(), nodes[2].client()
        a.create_bucket(Bucket="enc")
        body = marked(4 * MiB + 1, 60)
        a.put_object(Bucket="enc", Key="k", Body=body, ServerSideEncryption="AES256")
        a.put_object(Bucket="enc", Key="c", Body=body, **customer("n"))
        assert b.get_object(Bucket="enc", Key="k")["Body"].read() == body
        assert b.get_object(Bucket="enc", Key="k", Range="bytes=100-200")["Body"].read() == body[100:201]
        assert b.get_object(Bucket="enc", Key="c", **customer("n"))["Body"].read() == body
        assert err(lambda: b.get_object(Bucket="enc", Key="c")) == (400, "InvalidRequest")
    finally:
        stop_all(etcd, nodes)
