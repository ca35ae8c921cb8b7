"""Exact S3 semantics where Tarn claims support (issue 13). Each test opens
with the bug it pins: what Tarn answered before, and what S3 answers."""

import base64
import hashlib
import json
import os
import re
import subprocess
import xml.etree.ElementTree as ET

import botocore.exceptions
import pytest
from awscrt import checksums as crt

from conftest import data, md5hex
from sigv4 import signed_request
from tarnproc import ACCESS_KEY, SECRET_KEY

NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"
MIB = 1 << 20


def code(e):
    return e.value.response["Error"]["Code"]


def status(e):
    return e.value.response["ResponseMetadata"]["HTTPStatusCode"]


def test_conditional_writes_with_etags_and_star(s3):
    """Bug: a PUT or CompleteMultipartUpload with `If-None-Match: "<etag>"`
    ignored the condition (only `*` was read) and overwrote the object; one
    with `If-Match: *` on a missing key created it. Neither writes anything:
    a failed condition is 412 naming it in `<Condition>` (issue 42: clients
    map If-None-Match to FileExistsError by that element; it was missing),
    and If-Match on a key with no current version is 404 NoSuchKey, as AWS
    answers (it was 412)."""
    s3.create_bucket(Bucket="cond")
    etag = s3.put_object(Bucket="cond", Key="k", Body=b"v1")["ETag"]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="cond", Key="k", Body=b"v2", IfNoneMatch=etag)
    assert status(e) == 412
    assert e.value.response["Error"]["Condition"] == "If-None-Match"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="cond", Key="k", Body=b"v2", IfNoneMatch="*")
    assert e.value.response["Error"]["Condition"] == "If-None-Match"
    assert "x-tarn-condition" not in e.value.response["ResponseMetadata"]["HTTPHeaders"]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="cond", Key="k", Body=b"v2", IfMatch='"0123456789abcdef0123456789abcdef"')
    assert status(e) == 412
    assert e.value.response["Error"]["Condition"] == "If-Match"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="cond", Key="k", IfMatch='"0123456789abcdef0123456789abcdef"')
    assert e.value.response["Error"]["Condition"] == "If-Match"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.copy_object(Bucket="cond", Key="c", CopySource="cond/k", CopySourceIfNoneMatch=etag)
    assert e.value.response["Error"]["Condition"] == "x-amz-copy-source-If-None-Match"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.delete_object(Bucket="cond", Key="k", IfMatch='"0123456789abcdef0123456789abcdef"')
    assert e.value.response["Error"]["Condition"] == "If-Match"
    assert s3.get_object(Bucket="cond", Key="k")["Body"].read() == b"v1"
    # Another ETag does not match: the write goes ahead.
    s3.put_object(Bucket="cond", Key="k", Body=b"v2", IfNoneMatch='"0123456789abcdef0123456789abcdef"')
    assert s3.get_object(Bucket="cond", Key="k")["Body"].read() == b"v2"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="cond", Key="missing", Body=b"x", IfMatch="*")
    assert (status(e), code(e)) == (404, "NoSuchKey")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_object(Bucket="cond", Key="missing")
    assert status(e) == 404
    s3.put_object(Bucket="cond", Key="k", Body=b"v3", IfMatch="*")
    assert s3.get_object(Bucket="cond", Key="k")["Body"].read() == b"v3"

    def upload(key, body):
        up = s3.create_multipart_upload(Bucket="cond", Key=key)["UploadId"]
        p = s3.upload_part(Bucket="cond", Key=key, UploadId=up, PartNumber=1, Body=body)
        return up, {"Parts": [{"PartNumber": 1, "ETag": p["ETag"]}]}

    current = s3.head_object(Bucket="cond", Key="k")["ETag"]
    up, parts = upload("k", b"multipart")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.complete_multipart_upload(Bucket="cond", Key="k", UploadId=up, MultipartUpload=parts, IfNoneMatch=current)
    assert status(e) == 412
    assert e.value.response["Error"]["Condition"] == "If-None-Match"
    assert s3.get_object(Bucket="cond", Key="k")["Body"].read() == b"v3"
    up2, parts2 = upload("gone", b"multipart")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.complete_multipart_upload(Bucket="cond", Key="gone", UploadId=up2, MultipartUpload=parts2, IfMatch="*")
    assert (status(e), code(e)) == (404, "NoSuchKey")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_object(Bucket="cond", Key="gone")
    assert status(e) == 404
    # The refused uploads are still there to complete.
    s3.complete_multipart_upload(Bucket="cond", Key="k", UploadId=up, MultipartUpload=parts, IfMatch=current)
    assert s3.get_object(Bucket="cond", Key="k")["Body"].read() == b"multipart"


def _b64(raw):
    return base64.b64encode(raw).decode()


def _checksum(algo, body):
    if algo == "CRC32":
        return _b64(crt.crc32(body).to_bytes(4, "big"))
    if algo == "CRC32C":
        return _b64(crt.crc32c(body).to_bytes(4, "big"))
    if algo == "CRC64NVME":
        return _b64(crt.crc64nvme(body).to_bytes(8, "big"))
    if algo == "SHA1":
        return _b64(hashlib.sha1(body).digest())
    return _b64(hashlib.sha256(body).digest())


def _composite(algo, parts):
    raw = b"".join(base64.b64decode(_checksum(algo, p)) for p in parts)
    return f"{_checksum(algo, raw)}-{len(parts)}"


@pytest.mark.parametrize(
    "algo,kind",
    [("CRC32", "COMPOSITE"), ("CRC32C", "FULL_OBJECT"), ("CRC64NVME", "FULL_OBJECT"), ("SHA256", "COMPOSITE")],
)
def test_multipart_checksums(s3, algo, kind):
    """Bug: a multipart object had no checksum at all: Complete, HEAD and
    GET with checksum mode returned none and no x-amz-checksum-type, and a
    wrong checksum on Complete was accepted. S3 forms the composite (or, for
    CRCs, full-object) checksum from the parts and refuses a wrong one."""
    s3.create_bucket(Bucket="mpck")
    key = f"obj-{algo}"
    parts = [data(algo, 5 * MIB), data(algo + "2", MIB + 7)]
    r = s3.create_multipart_upload(Bucket="mpck", Key=key, ChecksumAlgorithm=algo, ChecksumType=kind)
    assert r["ChecksumAlgorithm"] == algo and r["ChecksumType"] == kind
    up = r["UploadId"]
    listed = []
    field = f"Checksum{algo}"
    for n, body in enumerate(parts, 1):
        p = s3.upload_part(Bucket="mpck", Key=key, UploadId=up, PartNumber=n, Body=body, ChecksumAlgorithm=algo)
        assert p[field] == _checksum(algo, body)
        listed.append({"PartNumber": n, "ETag": p["ETag"], field: p[field]})
    whole = b"".join(parts)
    want = _checksum(algo, whole) if kind == "FULL_OBJECT" else _composite(algo, parts)
    # A wrong whole-object checksum is refused, and nothing is created.
    wrong = _checksum(algo, b"not the object")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.complete_multipart_upload(
            Bucket="mpck", Key=key, UploadId=up, MultipartUpload={"Parts": listed}, **{field: wrong}
        )
    assert status(e) == 400
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_object(Bucket="mpck", Key=key)
    assert status(e) == 404
    # A part checksum that is not the part's is an invalid part.
    bad = [dict(listed[0], **{field: wrong}), listed[1]]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.complete_multipart_upload(Bucket="mpck", Key=key, UploadId=up, MultipartUpload={"Parts": bad})
    assert code(e) == "InvalidPart"
    done = s3.complete_multipart_upload(
        Bucket="mpck", Key=key, UploadId=up, MultipartUpload={"Parts": listed}, ChecksumType=kind
    )
    assert done[field] == want and done["ChecksumType"] == kind
    h = s3.head_object(Bucket="mpck", Key=key, ChecksumMode="ENABLED")
    assert h[field] == want and h["ChecksumType"] == kind
    g = s3.get_object(Bucket="mpck", Key=key, ChecksumMode="ENABLED")
    assert g["Body"].read() == whole
    assert g[field] == want and g["ChecksumType"] == kind
    # A part on its own carries its own checksum.
    g = s3.get_object(Bucket="mpck", Key=key, PartNumber=2, ChecksumMode="ENABLED")
    assert g["Body"].read() == parts[1]
    assert g[field] == _checksum(algo, parts[1]) and g["ChecksumType"] == "FULL_OBJECT"
    h = s3.head_object(Bucket="mpck", Key=key, PartNumber=1, ChecksumMode="ENABLED")
    assert h[field] == _checksum(algo, parts[0])


def test_multipart_checksum_rules(s3):
    """Bug: a part without the checksum its upload was created with was
    taken (and the object then had none), and impossible combinations (a
    FULL_OBJECT SHA-256) were accepted and ignored."""
    s3.create_bucket(Bucket="mprule")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.create_multipart_upload(Bucket="mprule", Key="k", ChecksumAlgorithm="SHA256", ChecksumType="FULL_OBJECT")
    assert code(e) == "InvalidRequest"
    up = s3.create_multipart_upload(Bucket="mprule", Key="k", ChecksumAlgorithm="CRC32")["UploadId"]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.upload_part(Bucket="mprule", Key="k", UploadId=up, PartNumber=1, Body=b"x", ChecksumAlgorithm="SHA1")
    assert code(e) == "InvalidRequest"
    assert "Parts" not in s3.list_parts(Bucket="mprule", Key="k", UploadId=up)
    # A copied part gets the upload's checksum computed from the copied bytes.
    src = data("copy-src", 3000)
    s3.put_object(Bucket="mprule", Key="src", Body=src)
    r = s3.upload_part_copy(Bucket="mprule", Key="k", UploadId=up, PartNumber=1, CopySource="mprule/src")
    assert r["CopyPartResult"]["ChecksumCRC32"] == _checksum("CRC32", src)
    done = s3.complete_multipart_upload(
        Bucket="mprule",
        Key="k",
        UploadId=up,
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": r["CopyPartResult"]["ETag"]}]},
    )
    assert done["ChecksumCRC32"] == _composite("CRC32", [src]) and done["ChecksumType"] == "COMPOSITE"


def _list_xml(server, path, query):
    r = signed_request(server.endpoint, "GET", path, query=query)
    assert r.status_code == 200, r.text
    return ET.fromstring(r.content)


def test_listing_encoding_delimiter_and_marker(server, s3):
    """Bugs: `encoding-type=url` escaped `/` as %2F (S3 leaves it, and
    clients split on it); an empty `delimiter=` was echoed as
    <Delimiter></Delimiter>; V1 listings left out <Marker> when none was
    given (S3 always sends it)."""
    s3.create_bucket(Bucket="enc")
    for k in ["a b/c+d/é.txt", "top"]:
        s3.put_object(Bucket="enc", Key=k, Body=b"x")
    for query in ([("list-type", "2"), ("encoding-type", "url")], [("encoding-type", "url")]):
        root = _list_xml(server, "/enc", query)
        keys = [c.find(f"{NS}Key").text for c in root.findall(f"{NS}Contents")]
        assert keys == ["a%20b/c%2Bd/%C3%A9.txt", "top"]
    root = _list_xml(server, "/enc", [("encoding-type", "url"), ("delimiter", "/")])
    assert [p.find(f"{NS}Prefix").text for p in root.findall(f"{NS}CommonPrefixes")] == ["a%20b/"]
    for query in ([("list-type", "2"), ("delimiter", "")], [("delimiter", "")], [("versions", ""), ("delimiter", "")]):
        root = _list_xml(server, "/enc", query)
        assert root.find(f"{NS}Delimiter") is None, query
        assert not root.findall(f"{NS}CommonPrefixes")
    root = _list_xml(server, "/enc", [])
    assert root.find(f"{NS}Marker") is not None and not root.find(f"{NS}Marker").text
    assert s3.list_objects(Bucket="enc")["Marker"] == ""
    assert s3.list_objects(Bucket="enc", Marker="a")["Marker"] == "a"


def test_list_buckets_pages(server, s3):
    """Bug: ListBuckets ignored `max-buckets`, `continuation-token` and
    `prefix`: every bucket came back, and a paginating client looped."""
    names = [f"pg-{i:02}" for i in range(5)] + ["other"]
    for n in names:
        s3.create_bucket(Bucket=n)
    r = s3.list_buckets(MaxBuckets=2)
    assert [b["Name"] for b in r["Buckets"]] == ["other", "pg-00"]
    seen = [b["Name"] for b in r["Buckets"]]
    while "ContinuationToken" in r:
        r = s3.list_buckets(MaxBuckets=2, ContinuationToken=r["ContinuationToken"])
        seen += [b["Name"] for b in r["Buckets"]]
    assert seen == sorted(names)
    pages = s3.get_paginator("list_buckets").paginate(Prefix="pg-", PaginationConfig={"PageSize": 3})
    assert [b["Name"] for p in pages for b in p["Buckets"]] == names[:5]
    assert len(s3.list_buckets()["Buckets"]) == 6
    r = signed_request(server.endpoint, "GET", "/", query=[("max-buckets", "0")])
    assert r.status_code == 400 and ET.fromstring(r.content).find("Code").text == "InvalidArgument"


def test_create_own_bucket_and_delete_with_uploads(server, s3):
    """Bugs: creating a bucket one already owns was 409 (S3 in us-east-1
    answers 200 and changes nothing); deleting a bucket whose only content
    is multipart uploads in progress was BucketNotEmpty (S3 aborts them and
    deletes the bucket)."""
    s3.create_bucket(Bucket="own")
    s3.put_bucket_versioning(Bucket="own", VersioningConfiguration={"Status": "Enabled"})
    s3.create_bucket(Bucket="own")
    assert s3.get_bucket_versioning(Bucket="own")["Status"] == "Enabled"
    # A durability the bucket does not have would not be honoured: 409.
    r = signed_request(server.endpoint, "PUT", "/own", headers={"x-tarn-durability": "single"})
    assert r.status_code == 409, r.text
    r = signed_request(server.endpoint, "PUT", "/own", headers={"x-tarn-durability": "erasure"})
    assert r.status_code == 200, r.text
    ups = [s3.create_multipart_upload(Bucket="own", Key=f"k{i}")["UploadId"] for i in range(3)]
    s3.upload_part(Bucket="own", Key="k0", UploadId=ups[0], PartNumber=1, Body=b"part")
    s3.put_object(Bucket="own", Key="obj", Body=b"x")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.delete_bucket(Bucket="own")
    assert code(e) == "BucketNotEmpty"
    assert len(s3.list_multipart_uploads(Bucket="own")["Uploads"]) == 3
    vid = s3.list_object_versions(Bucket="own")["Versions"][0]["VersionId"]
    s3.delete_object(Bucket="own", Key="obj", VersionId=vid)
    s3.delete_bucket(Bucket="own")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_bucket(Bucket="own")
    assert status(e) == 404
    # Recreated, the bucket holds none of the old uploads.
    s3.create_bucket(Bucket="own")
    assert "Uploads" not in s3.list_multipart_uploads(Bucket="own")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.list_parts(Bucket="own", Key="k0", UploadId=ups[0])
    assert code(e) == "NoSuchUpload"


def test_aws_chunked_is_not_stored_as_content_encoding(server, s3):
    """Bug: `Content-Encoding: aws-chunked` (how the request body was sent)
    was stored and served back as the object's encoding, so a browser or
    client would try to decode it."""
    s3.create_bucket(Bucket="cee")
    body = b"hello"
    trailer = f"x-amz-checksum-crc32:{_checksum('CRC32', body)}\r\n\r\n".encode()
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n" + trailer
    for key, sent, kept in [("plain", "aws-chunked", None), ("gz", "aws-chunked,gzip", "gzip")]:
        r = signed_request(
            server.endpoint,
            "PUT",
            f"/cee/{key}",
            body=chunked,
            payload_hash="STREAMING-UNSIGNED-PAYLOAD-TRAILER",
            headers={
                "content-encoding": sent,
                "x-amz-decoded-content-length": str(len(body)),
                "x-amz-trailer": "x-amz-checksum-crc32",
                "content-length": str(len(chunked)),
            },
        )
        assert r.status_code == 200, r.text
        h = s3.head_object(Bucket="cee", Key=key)
        assert h.get("ContentEncoding") == kept
        assert s3.get_object(Bucket="cee", Key=key)["Body"].read() == body


def test_request_ids_and_tagging_count(server, s3):
    """Bugs: responses carried no x-amz-request-id and error bodies no
    <RequestId>; HEAD left out x-amz-tagging-count."""
    s3.create_bucket(Bucket="rid")
    s3.put_object(Bucket="rid", Key="t", Body=b"x", Tagging="a=1&b=2")
    ok = s3.head_object(Bucket="rid", Key="t")
    assert ok["ResponseMetadata"]["HTTPHeaders"]["x-amz-tagging-count"] == "2"
    ids = {ok["ResponseMetadata"]["RequestId"]}
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="rid", Key="missing")
    ids.add(e.value.response["ResponseMetadata"]["RequestId"])
    r = signed_request(server.endpoint, "GET", "/rid/missing")
    rid = r.headers["x-amz-request-id"]
    assert re.fullmatch(r"[0-9A-F]{16}", rid)
    assert ET.fromstring(r.content).find("RequestId").text == rid
    # Errors answered before the S3 layer (a wrong signing region) too.
    r = signed_request(server.endpoint, "GET", "/rid/t", region="eu-west-1")
    assert r.status_code == 400
    assert ET.fromstring(r.content).find("RequestId").text == r.headers["x-amz-request-id"]
    ids.add(r.headers["x-amz-request-id"])
    assert len(ids) == 3 and all(ids)


def test_copy_keeps_md5_etag(s3):
    """Bug: a CopyObject of an object with an MD5 ETag over 1 MiB got a
    fast `-1` ETag, so `rclone check` and s3cmd saw the copy as different."""
    s3.create_bucket(Bucket="cpy")
    body = data("md5-copy", 3 * MIB)
    md5 = base64.b64encode(hashlib.md5(body).digest()).decode()
    put = s3.put_object(Bucket="cpy", Key="src", Body=body, ContentMD5=md5)
    assert put["ETag"] == f'"{md5hex(body)}"'
    r = s3.copy_object(Bucket="cpy", Key="dst", CopySource="cpy/src")
    assert r["CopyObjectResult"]["ETag"] == f'"{md5hex(body)}"'
    assert s3.get_object(Bucket="cpy", Key="dst")["Body"].read() == body


def _s3cmd(cfg, *args, check=True):
    r = subprocess.run(["s3cmd", "-c", cfg, *args], capture_output=True, text=True, timeout=120)
    if check:
        assert r.returncode == 0, f"s3cmd {args}: {r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def test_s3cmd_default_configuration(server, tmp_path):
    """Bugs: s3cmd with its default configuration signs for the legacy
    region "US" and got InvalidRequest instead of S3's answer naming the
    right region; and it checks each multipart part's ETag against the
    part's MD5, which a fast 32-hex-digit part ETag failed (every upload
    over 15 MiB)."""
    # Debian's package; scripts/test installs it.
    host = server.endpoint.replace("http://", "")
    cfg = tmp_path / "s3cfg"
    # Only what a user must set: keys and endpoint; the rest is s3cmd's default.
    cfg.write_text(
        f"[default]\naccess_key = {ACCESS_KEY}\nsecret_key = {SECRET_KEY}\n"
        f"host_base = {host}\nhost_bucket = {host}\nuse_https = False\n"
    )
    cfg = str(cfg)
    _s3cmd(cfg, "mb", "s3://cmd")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    small = data("s3cmd-small", 1000)
    big = data("s3cmd-big", 20 * MIB)  # two parts of s3cmd's default 15 MiB
    (src / "small.bin").write_bytes(small)
    (src / "sub" / "big.bin").write_bytes(big)
    r = _s3cmd(cfg, "put", str(src / "sub" / "big.bin"), "s3://cmd/big.bin")
    assert "MD5 Sums don't match" not in r.stderr + r.stdout
    out = tmp_path / "out.bin"
    r = _s3cmd(cfg, "get", "s3://cmd/big.bin", str(out))
    assert "MD5 signatures do not match" not in r.stderr + r.stdout
    assert out.read_bytes() == big
    r = _s3cmd(cfg, "sync", str(src) + "/", "s3://cmd/tree/")
    listing = _s3cmd(cfg, "ls", "-r", "s3://cmd/tree/").stdout
    assert "s3://cmd/tree/small.bin" in listing and "s3://cmd/tree/sub/big.bin" in listing
    # A second sync finds everything in place and uploads nothing.
    r = _s3cmd(cfg, "sync", str(src) + "/", "s3://cmd/tree/")
    assert "upload:" not in r.stdout
    back = tmp_path / "back"
    _s3cmd(cfg, "sync", "s3://cmd/tree/", str(back) + "/")
    assert (back / "small.bin").read_bytes() == small
    assert (back / "sub" / "big.bin").read_bytes() == big
    _s3cmd(cfg, "del", "--recursive", "--force", "s3://cmd/tree/")
    _s3cmd(cfg, "del", "s3://cmd/big.bin")
    assert _s3cmd(cfg, "ls", "s3://cmd").stdout.strip() == ""
    _s3cmd(cfg, "rb", "s3://cmd")
    assert os.path.getsize(out) == len(big)


def test_get_object_attributes(server, s3):
    """Bug: GetObjectAttributes answered 501. It answers the attributes
    asked for (ETag, checksum, parts, size, storage class) of the latest or
    a named version, pages a multipart object's parts, refuses unknown
    attribute names, and needs both s3:GetObjectAttributes and
    s3:GetObject."""
    from tarnproc import add_user
    s3.create_bucket(Bucket="attrs")
    r = s3.put_object(Bucket="attrs", Key="one", Body=b"hello", ChecksumAlgorithm="CRC32C")
    a = s3.get_object_attributes(Bucket="attrs", Key="one",
                                 ObjectAttributes=["ETag", "Checksum", "ObjectSize", "StorageClass", "ObjectParts"])
    assert a["ETag"] == r["ETag"].strip('"')  # unquoted, as AWS answers it
    assert a["ObjectSize"] == 5 and a["StorageClass"] == "STANDARD"
    assert a["Checksum"]["ChecksumCRC32C"] == r["ChecksumCRC32C"]
    assert "ObjectParts" not in a  # one piece: no parts
    a = s3.get_object_attributes(Bucket="attrs", Key="one", ObjectAttributes=["ObjectSize"])
    assert a["ObjectSize"] == 5 and "ETag" not in a and "Checksum" not in a
    assert a["LastModified"] is not None

    # A multipart object with checksums: parts, paged.
    up = s3.create_multipart_upload(Bucket="attrs", Key="mp", ChecksumAlgorithm="SHA256")["UploadId"]
    parts, sizes = [], [5 * MIB, 5 * MIB, 1234]
    for n, size in enumerate(sizes, 1):
        p = s3.upload_part(Bucket="attrs", Key="mp", UploadId=up, PartNumber=n, Body=data(n, size),
                           ChecksumAlgorithm="SHA256")
        parts.append({"PartNumber": n, "ETag": p["ETag"], "ChecksumSHA256": p["ChecksumSHA256"]})
    s3.complete_multipart_upload(Bucket="attrs", Key="mp", UploadId=up, MultipartUpload={"Parts": parts})
    a = s3.get_object_attributes(Bucket="attrs", Key="mp", ObjectAttributes=["ObjectParts", "ObjectSize"],
                                 MaxParts=2)
    op = a["ObjectParts"]
    assert a["ObjectSize"] == sum(sizes)
    assert op["TotalPartsCount"] == 3 and op["IsTruncated"] is True and op["NextPartNumberMarker"] == 2
    assert [(p["PartNumber"], p["Size"], p["ChecksumSHA256"]) for p in op["Parts"]] == [
        (1, sizes[0], parts[0]["ChecksumSHA256"]), (2, sizes[1], parts[1]["ChecksumSHA256"])]
    op = s3.get_object_attributes(Bucket="attrs", Key="mp", ObjectAttributes=["ObjectParts"],
                                  PartNumberMarker=2)["ObjectParts"]
    assert [p["PartNumber"] for p in op["Parts"]] == [3] and op["IsTruncated"] is False

    # Versions: the latest, a named one, a delete marker.
    s3.put_bucket_versioning(Bucket="attrs", VersioningConfiguration={"Status": "Enabled"})
    v1 = s3.put_object(Bucket="attrs", Key="v", Body=b"first")["VersionId"]
    s3.put_object(Bucket="attrs", Key="v", Body=b"second!")
    assert s3.get_object_attributes(Bucket="attrs", Key="v", ObjectAttributes=["ObjectSize"])["ObjectSize"] == 7
    a = s3.get_object_attributes(Bucket="attrs", Key="v", VersionId=v1, ObjectAttributes=["ObjectSize"])
    assert a["ObjectSize"] == 5 and a["VersionId"] == v1
    s3.delete_object(Bucket="attrs", Key="v")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object_attributes(Bucket="attrs", Key="v", ObjectAttributes=["ObjectSize"])
    assert status(e) == 404
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object_attributes(Bucket="attrs", Key="missing", ObjectAttributes=["ETag"])
    assert code(e) == "NoSuchKey"

    # Unknown attribute names are refused.
    r = signed_request(server.endpoint, "GET", "/attrs/one", query=[("attributes", "")],
                       headers={"x-amz-object-attributes": "ETag,Colour"})
    assert r.status_code == 400 and "InvalidArgument" in r.text, r.text

    # Both actions are needed.
    bob = server.client(add_user(server, "bob"), s3={"addressing_style": "path"})
    def grant(actions):
        s3.put_bucket_policy(Bucket="attrs", Policy=json.dumps({"Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Principal": {"AWS": ["arn:aws:iam::000000000000:user/bob"]},
            "Action": actions, "Resource": ["arn:aws:s3:::attrs/*"]}]}))
    grant(["s3:GetObject"])
    with pytest.raises(botocore.exceptions.ClientError) as e:
        bob.get_object_attributes(Bucket="attrs", Key="one", ObjectAttributes=["ETag"])
    assert code(e) == "AccessDenied"
    grant(["s3:GetObject", "s3:GetObjectAttributes"])
    assert bob.get_object_attributes(Bucket="attrs", Key="one", ObjectAttributes=["ObjectSize"])["ObjectSize"] == 5


def test_metrics_name_each_operation_as_aws_does(server, s3):
    """Bug: metrics and logs named operations by request shape:
    PutBucketLifecycleConfiguration counted as CreateBucket,
    GetObjectAttributes as GetObject. Each is counted under its AWS name,
    the refused ones too."""
    from tarnproc import metric

    def count(op):
        try:
            return metric(server, "tarn_requests_total", op=op)
        except AssertionError:  # none yet
            return 0

    s3.create_bucket(Bucket="named")
    s3.put_object(Bucket="named", Key="k", Body=b"v")
    creates, gets = count("CreateBucket"), count("GetObject")
    s3.get_object_attributes(Bucket="named", Key="k", ObjectAttributes=["ObjectSize"])
    s3.put_bucket_lifecycle_configuration(Bucket="named", LifecycleConfiguration={"Rules": [
        {"ID": "x", "Status": "Enabled", "Filter": {"Prefix": ""}, "Expiration": {"Days": 1}}]})
    with pytest.raises(botocore.exceptions.ClientError):
        s3.get_bucket_cors(Bucket="named")
    with pytest.raises(botocore.exceptions.ClientError):  # refused: 501
        s3.get_bucket_encryption(Bucket="named")
    assert count("GetObjectAttributes") == 1
    assert count("PutBucketLifecycleConfiguration") == 1
    assert count("GetBucketCors") == 1
    assert count("GetBucketEncryption") == 1
    assert (count("CreateBucket"), count("GetObject")) == (creates, gets)


def test_invalid_bucket_names_are_explained(server):
    """Bug: an invalid bucket name answered `<Code>InvalidBucketName</Code>`
    with no message (s3s's own refusal). Every error body has one."""
    for method, path in [("PUT", "/Bad_Bucket"), ("PUT", "/ab"), ("PUT", "/a..b"), ("GET", "/Bad_Bucket/key")]:
        r = signed_request(server.endpoint, method, path)
        assert r.status_code == 400, (path, r.text)
        root = ET.fromstring(r.text)
        assert root.findtext("Code") == "InvalidBucketName"
        assert root.findtext("Message") == "The specified bucket is not valid.", r.text
        assert root.findtext("RequestId") == r.headers["x-amz-request-id"]
    # Errors Tarn words itself keep their words.
    r = signed_request(server.endpoint, "GET", "/no-such-bucket-here/k")
    assert ET.fromstring(r.text).findtext("Message"), r.text
    assert r.text.count("<Message>") == 1


def test_content_encoding_is_kept_as_sent(s3):
    """Bug: `Content-Encoding: deflate, gzip` was stored as `deflate,gzip`.
    It is kept as sent; only the transfer's `aws-chunked` is left out."""
    s3.create_bucket(Bucket="encodings")
    s3.put_object(Bucket="encodings", Key="k", Body=b"x" * 100, ContentEncoding="deflate, gzip")
    assert s3.head_object(Bucket="encodings", Key="k")["ContentEncoding"] == "deflate, gzip"
    assert s3.get_object(Bucket="encodings", Key="k")["ContentEncoding"] == "deflate, gzip"
    # boto3 streams with aws-chunked and a trailing checksum: that coding is not the object's.
    import io
    s3.upload_fileobj(io.BytesIO(b"y" * 100), "encodings", "c", ExtraArgs={"ContentEncoding": "gzip"})
    assert s3.head_object(Bucket="encodings", Key="c")["ContentEncoding"] == "gzip"


def test_version_listing_resumes_after_its_marker_was_deleted(s3):
    """Bug (issue 42): ListObjectVersions with a `version-id-marker` whose
    version was deleted meanwhile skipped every older version of that key,
    so a loop that deletes each page and then asks for the next left
    versions behind and DeleteBucket failed. Every version is listed and
    deleted; a malformed marker, or one without a key marker, is 400."""
    s3.create_bucket(Bucket="vpages")
    s3.put_bucket_versioning(Bucket="vpages", VersioningConfiguration={"Status": "Enabled"})
    made = []
    for key, n in (("a", 3), ("k", 7), ("z", 2)):
        for i in range(n):
            made.append((key, s3.put_object(Bucket="vpages", Key=key, Body=b"%d" % i)["VersionId"]))
    s3.delete_object(Bucket="vpages", Key="k")  # a delete marker too
    total = len(made) + 1
    # Paging without deleting lists each version once.
    seen, kw = [], {}
    while True:
        page = s3.list_object_versions(Bucket="vpages", MaxKeys=2, **kw)
        seen += [(v["Key"], v["VersionId"]) for v in page.get("Versions", []) + page.get("DeleteMarkers", [])]
        if not page["IsTruncated"]:
            break
        kw = {"KeyMarker": page["NextKeyMarker"], "VersionIdMarker": page["NextVersionIdMarker"]}
    assert len(seen) == total and len(set(seen)) == total
    # Delete each page, then ask for the next after its (deleted) marker.
    deleted, kw, rounds = 0, {}, 0
    while True:
        rounds += 1
        assert rounds < 50
        page = s3.list_object_versions(Bucket="vpages", MaxKeys=2, **kw)
        batch = [{"Key": v["Key"], "VersionId": v["VersionId"]}
                 for v in page.get("Versions", []) + page.get("DeleteMarkers", [])]
        if batch:
            r = s3.delete_objects(Bucket="vpages", Delete={"Objects": batch})
            assert not r.get("Errors"), r
            deleted += len(batch)
        if not page["IsTruncated"]:
            break
        kw = {"KeyMarker": page["NextKeyMarker"], "VersionIdMarker": page["NextVersionIdMarker"]}
    assert deleted == total
    assert "Versions" not in s3.list_object_versions(Bucket="vpages")
    s3.delete_bucket(Bucket="vpages")
    s3.create_bucket(Bucket="vbad")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.list_object_versions(Bucket="vbad", KeyMarker="k", VersionIdMarker="not-a-version")
    assert (status(e), code(e)) == (400, "InvalidArgument")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.list_object_versions(Bucket="vbad", VersionIdMarker="null")
    assert (status(e), code(e)) == (400, "InvalidArgument")


def test_listings_name_the_real_owner_and_initiator(server, s3):
    """Bug (issue 42): Owner and Initiator in ListObjects V1/V2,
    ListObjectVersions, ListBuckets, ListMultipartUploads and ListParts were
    the constant "tarn". They name the real user: the bucket owner for
    objects in a bucket that enforces ownership, the writer where objects
    are the writer's (ObjectWriter), the uploader as Initiator, and the
    caller in ListBuckets."""
    from tarnproc import add_user
    dana = add_user(server, "dana")
    d = server.client(dana)
    policy = lambda b: json.dumps({"Statement": [{"Effect": "Allow", "Principal": {"AWS": ["dana"]},
                                                  "Action": "s3:*", "Resource": [f"arn:aws:s3:::{b}", f"arn:aws:s3:::{b}/*"]}]})
    s3.create_bucket(Bucket="owned")
    s3.create_bucket(Bucket="written", ObjectOwnership="ObjectWriter")
    for b in ("owned", "written"):
        s3.put_bucket_policy(Bucket=b, Policy=policy(b))
        s3.put_bucket_versioning(Bucket=b, VersioningConfiguration={"Status": "Enabled"})
        d.put_object(Bucket=b, Key="by-dana", Body=b"x")
        s3.put_object(Bucket=b, Key="by-root", Body=b"y")
        up = d.create_multipart_upload(Bucket=b, Key="up-dana")["UploadId"]
        expect = {"by-dana": "root" if b == "owned" else "dana", "by-root": "root"}
        for lister in (s3, d):
            v1 = lister.list_objects(Bucket=b)["Contents"]
            assert {o["Key"]: o["Owner"]["ID"] for o in v1} == expect
            v2 = lister.list_objects_v2(Bucket=b, FetchOwner=True)["Contents"]
            assert {o["Key"]: (o["Owner"]["ID"], o["Owner"]["DisplayName"]) for o in v2} == {k: (v, v) for k, v in expect.items()}
            assert all("Owner" not in o for o in lister.list_objects_v2(Bucket=b)["Contents"])
            vs = lister.list_object_versions(Bucket=b)["Versions"]
            assert {o["Key"]: o["Owner"]["ID"] for o in vs} == expect
            [u] = lister.list_multipart_uploads(Bucket=b)["Uploads"]
            assert u["Initiator"]["ID"] == "dana"
            assert u["Owner"]["ID"] == expect["by-dana"]
            parts = lister.list_parts(Bucket=b, Key="up-dana", UploadId=up)
            assert parts["Initiator"]["ID"] == "dana" and parts["Owner"]["ID"] == expect["by-dana"]
        root_up = s3.create_multipart_upload(Bucket=b, Key="up-root")["UploadId"]
        assert s3.list_parts(Bucket=b, Key="up-root", UploadId=root_up)["Initiator"]["ID"] == "root"
        # The internal initiator record does not travel with a completed
        # object or its copies.
        p = d.upload_part(Bucket=b, Key="up-dana", UploadId=up, PartNumber=1, Body=b"z")
        d.complete_multipart_upload(Bucket=b, Key="up-dana", UploadId=up,
                                    MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": p["ETag"]}]})
        head = d.head_object(Bucket=b, Key="up-dana")["ResponseMetadata"]["HTTPHeaders"]
        # (x-tarn-local-read names the node's local-read socket to clients
        # on its host: a header of the response, not of the object.)
        assert not any(h.startswith("x-tarn") and h != "x-tarn-local-read" for h in head), head
    assert s3.list_buckets()["Owner"]["ID"] == "root"
    assert d.list_buckets()["Owner"] == {"ID": "dana", "DisplayName": "dana"}


def test_part_number_past_the_last_part(s3):
    """Bug (issue 42): GET or HEAD with a partNumber past the object's last
    part answered 416 InvalidRange; S3 answers 416 InvalidPartNumber ("The
    requested partnumber is not satisfiable")."""
    s3.create_bucket(Bucket="parts")
    up = s3.create_multipart_upload(Bucket="parts", Key="mp")["UploadId"]
    p1 = s3.upload_part(Bucket="parts", Key="mp", UploadId=up, PartNumber=1, Body=b"a" * (5 * MIB))
    p2 = s3.upload_part(Bucket="parts", Key="mp", UploadId=up, PartNumber=2, Body=b"b" * 10)
    s3.complete_multipart_upload(Bucket="parts", Key="mp", UploadId=up, MultipartUpload={"Parts": [
        {"PartNumber": 1, "ETag": p1["ETag"]}, {"PartNumber": 2, "ETag": p2["ETag"]}]})
    s3.put_object(Bucket="parts", Key="one", Body=b"single")
    assert s3.get_object(Bucket="parts", Key="mp", PartNumber=2)["Body"].read() == b"b" * 10
    assert s3.get_object(Bucket="parts", Key="one", PartNumber=1)["Body"].read() == b"single"
    for key, n in (("mp", 3), ("one", 2)):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            s3.get_object(Bucket="parts", Key=key, PartNumber=n)
        assert (status(e), code(e)) == (416, "InvalidPartNumber")
        assert "partnumber is not satisfiable" in e.value.response["Error"]["Message"]
        with pytest.raises(botocore.exceptions.ClientError) as e:
            s3.head_object(Bucket="parts", Key=key, PartNumber=n)
        assert status(e) == 416


def test_bucket_tagging_logging_request_payment_and_expected_owner(server, s3):
    """Issue 42: bucket tagging was 501; bucket logging and request payment
    were 501 where AWS answers a bucket without them; x-amz-expected-bucket-
    owner was ignored. Tags are kept (50 at most, no aws: keys, unique);
    logging and Requester Pays are refused when asked to be turned on and
    change nothing; a request naming another owner is 403."""
    s3.create_bucket(Bucket="tagged")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_bucket_tagging(Bucket="tagged")
    assert (status(e), code(e)) == (404, "NoSuchTagSet")
    tags = [{"Key": f"k{i}", "Value": f"v{i}"} for i in range(50)]
    s3.put_bucket_tagging(Bucket="tagged", Tagging={"TagSet": tags})
    assert s3.get_bucket_tagging(Bucket="tagged")["TagSet"] == tags
    for bad in ([*tags, {"Key": "x", "Value": "y"}], [{"Key": "a", "Value": "1"}, {"Key": "a", "Value": "2"}],
                [{"Key": "aws:cloudformation", "Value": "x"}], [{"Key": "k" * 129, "Value": "v"}]):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            s3.put_bucket_tagging(Bucket="tagged", Tagging={"TagSet": bad})
        assert (status(e), code(e)) == (400, "InvalidTag")
    assert s3.get_bucket_tagging(Bucket="tagged")["TagSet"] == tags
    s3.delete_bucket_tagging(Bucket="tagged")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_bucket_tagging(Bucket="tagged")
    assert code(e) == "NoSuchTagSet"
    assert "LoggingEnabled" not in s3.get_bucket_logging(Bucket="tagged")
    s3.put_bucket_logging(Bucket="tagged", BucketLoggingStatus={})
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_bucket_logging(Bucket="tagged", BucketLoggingStatus={
            "LoggingEnabled": {"TargetBucket": "tagged", "TargetPrefix": "logs/"}})
    assert (status(e), code(e)) == (501, "NotImplemented")
    assert "LoggingEnabled" not in s3.get_bucket_logging(Bucket="tagged")
    assert s3.get_bucket_request_payment(Bucket="tagged")["Payer"] == "BucketOwner"
    s3.put_bucket_request_payment(Bucket="tagged", RequestPaymentConfiguration={"Payer": "BucketOwner"})
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_bucket_request_payment(Bucket="tagged", RequestPaymentConfiguration={"Payer": "Requester"})
    assert (status(e), code(e)) == (501, "NotImplemented")
    # x-amz-expected-bucket-owner: the owner's canonical ID is its name.
    s3.put_object(Bucket="tagged", Key="k", Body=b"x", ExpectedBucketOwner="root")
    assert s3.head_object(Bucket="tagged", Key="k", ExpectedBucketOwner="root")["ContentLength"] == 1
    for call in (lambda: s3.get_object(Bucket="tagged", Key="k", ExpectedBucketOwner="someone"),
                 lambda: s3.put_object(Bucket="tagged", Key="k2", Body=b"x", ExpectedBucketOwner="someone"),
                 lambda: s3.list_objects_v2(Bucket="tagged", ExpectedBucketOwner="someone"),
                 lambda: s3.copy_object(Bucket="tagged", Key="c", CopySource="tagged/k",
                                        ExpectedSourceBucketOwner="someone")):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            call()
        assert (status(e), code(e)) == (403, "AccessDenied")
    assert [o["Key"] for o in s3.list_objects_v2(Bucket="tagged")["Contents"]] == ["k"]


def test_pre_2023_bucket_defaults(make_server):
    """Issue 42 (migrations): `--bucket-defaults legacy` gives new buckets
    the defaults from before April 2023 (ObjectWriter, no public access
    block) so that clients moved from RGW or MinIO keep their ACLs;
    x-amz-object-ownership still chooses per bucket."""
    srv = make_server(extra_args=["--bucket-defaults", "legacy"])
    c = srv.client()
    c.create_bucket(Bucket="old", ACL="public-read")
    assert c.get_bucket_ownership_controls(Bucket="old")["OwnershipControls"]["Rules"] == [
        {"ObjectOwnership": "ObjectWriter"}]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        c.get_public_access_block(Bucket="old")
    assert code(e) == "NoSuchPublicAccessBlockConfiguration"
    c.put_object(Bucket="old", Key="k", Body=b"x", ACL="public-read")
    assert any(g["Permission"] == "READ" for g in c.get_object_acl(Bucket="old", Key="k")["Grants"])
    import requests
    assert requests.get(f"{srv.endpoint}/old/k").content == b"x"
    c.create_bucket(Bucket="new", ObjectOwnership="BucketOwnerEnforced")
    assert c.get_bucket_ownership_controls(Bucket="new")["OwnershipControls"]["Rules"] == [
        {"ObjectOwnership": "BucketOwnerEnforced"}]
