"""Object operations through boto3 with its default settings (aws-chunked
uploads with trailing CRC checksums)."""

import base64
import datetime
import hashlib
import urllib.parse

import botocore.exceptions
import pytest

from conftest import data, md5hex

KIB = 1024
MIB = 1024 * 1024


def code(excinfo):
    return excinfo.value.response["Error"]["Code"]


def status(excinfo):
    return excinfo.value.response["ResponseMetadata"]["HTTPStatusCode"]


def test_bucket_lifecycle(s3):
    s3.create_bucket(Bucket="alpha")
    s3.head_bucket(Bucket="alpha")
    assert "alpha" in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert s3.get_bucket_location(Bucket="alpha").get("LocationConstraint") in (None, "")
    # S3 in us-east-1 answers 200 to creating a bucket one already owns
    # (test_s3_semantics pins the rest).
    s3.create_bucket(Bucket="alpha")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.create_bucket(Bucket="Bad_Name")
    assert code(e) == "InvalidBucketName"
    s3.put_object(Bucket="alpha", Key="k", Body=b"x")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.delete_bucket(Bucket="alpha")
    assert code(e) == "BucketNotEmpty"
    s3.delete_object(Bucket="alpha", Key="k")
    s3.delete_bucket(Bucket="alpha")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_bucket(Bucket="alpha")
    assert status(e) == 404
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="alpha", Key="k", Body=b"x")
    assert code(e) == "NoSuchBucket"


@pytest.mark.parametrize("size", [0, 1, 128 * KIB - 1, 128 * KIB, 128 * KIB + 1, MIB - 1, MIB, MIB + 1, 9 * MIB + 5])
def test_put_get_sizes(s3, size):
    s3.create_bucket(Bucket="sizes")
    body = data(size, size)
    put = s3.put_object(Bucket="sizes", Key=f"o{size}", Body=body)
    got = s3.get_object(Bucket="sizes", Key=f"o{size}")
    assert got["ContentLength"] == size
    assert got["Body"].read() == body
    assert got["ETag"] == put["ETag"]
    if size <= MIB:
        # Small single-part objects keep an MD5 ETag (clients compare it).
        assert put["ETag"] == f'"{md5hex(body)}"'
    head = s3.head_object(Bucket="sizes", Key=f"o{size}")
    assert head["ContentLength"] == size


def test_large_put_etag_is_not_capped_by_md5(s3):
    """Above the MD5 threshold the ETag is a fast digest in multipart form, which
    MD5-comparing clients skip; it is stable for identical bodies."""
    s3.create_bucket(Bucket="etag")
    body = data(3, 3 * MIB)
    e1 = s3.put_object(Bucket="etag", Key="a", Body=body)["ETag"]
    e2 = s3.put_object(Bucket="etag", Key="b", Body=body)["ETag"]
    assert e1 == e2 and e1.strip('"').endswith("-1")
    # With Content-MD5 the ETag is the real MD5.
    md5 = base64.b64encode(hashlib.md5(body).digest()).decode()
    e3 = s3.put_object(Bucket="etag", Key="c", Body=body, ContentMD5=md5)["ETag"]
    assert e3 == f'"{md5hex(body)}"'


def test_ranges_and_part_numbers(s3):
    s3.create_bucket(Bucket="ranges")
    body = data(1, 3 * MIB + 17)
    s3.put_object(Bucket="ranges", Key="k", Body=body)
    for a, b in [(0, 0), (MIB - 1, MIB), (MIB, 2 * MIB + 5), (len(body) - 1, len(body) - 1), (5, 10 * MIB)]:
        r = s3.get_object(Bucket="ranges", Key="k", Range=f"bytes={a}-{b}")
        want = body[a : b + 1]
        assert r["Body"].read() == want
        assert r["ContentRange"] == f"bytes {a}-{a + len(want) - 1}/{len(body)}"
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
    assert s3.get_object(Bucket="ranges", Key="k", Range="bytes=-100")["Body"].read() == body[-100:]
    assert s3.get_object(Bucket="ranges", Key="k", Range=f"bytes={MIB}-")["Body"].read() == body[MIB:]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="ranges", Key="k", Range=f"bytes={len(body)}-")
    assert code(e) == "InvalidRange" and status(e) == 416
    r = s3.get_object(Bucket="ranges", Key="k", PartNumber=1)
    assert r["Body"].read() == body and r["PartsCount"] == 1


def test_conditional_requests(s3):
    s3.create_bucket(Bucket="cond")
    etag = s3.put_object(Bucket="cond", Key="k", Body=b"hello")["ETag"]
    assert s3.get_object(Bucket="cond", Key="k", IfMatch=etag)["Body"].read() == b"hello"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="cond", Key="k", IfMatch='"nope"')
    assert status(e) == 412
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="cond", Key="k", IfNoneMatch=etag)
    assert status(e) == 304
    future = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    past = datetime.datetime(2000, 1, 1, tzinfo=datetime.timezone.utc)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="cond", Key="k", IfModifiedSince=future)
    assert status(e) == 304
    assert s3.get_object(Bucket="cond", Key="k", IfModifiedSince=past)["Body"].read() == b"hello"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="cond", Key="k", IfUnmodifiedSince=past)
    assert status(e) == 412
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_object(Bucket="cond", Key="k", IfNoneMatch=etag)
    assert status(e) == 304
    # Conditional writes.
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="cond", Key="k", Body=b"other", IfNoneMatch="*")
    assert status(e) == 412
    s3.put_object(Bucket="cond", Key="new", Body=b"first", IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="cond", Key="k", Body=b"other", IfMatch='"nope"')
    assert status(e) == 412
    assert s3.get_object(Bucket="cond", Key="k")["Body"].read() == b"hello"


def test_metadata_headers_and_overrides(s3):
    s3.create_bucket(Bucket="meta")
    s3.put_object(
        Bucket="meta",
        Key="k",
        Body=b"{}",
        ContentType="application/json",
        CacheControl="max-age=60",
        ContentDisposition='attachment; filename="x.json"',
        ContentEncoding="identity",
        ContentLanguage="en",
        Metadata={"Model": "llama", "step": "100"},
    )
    h = s3.head_object(Bucket="meta", Key="k")
    assert h["ContentType"] == "application/json"
    assert h["CacheControl"] == "max-age=60"
    assert h["ContentDisposition"] == 'attachment; filename="x.json"'
    assert h["ContentLanguage"] == "en"
    assert h["Metadata"] == {"model": "llama", "step": "100"}
    g = s3.get_object(Bucket="meta", Key="k", ResponseContentType="text/plain", ResponseCacheControl="no-cache")
    assert g["ContentType"] == "text/plain" and g["CacheControl"] == "no-cache"
    assert g["Metadata"] == {"model": "llama", "step": "100"}


def test_delete_semantics(s3):
    s3.create_bucket(Bucket="del")
    r = s3.delete_object(Bucket="del", Key="missing")
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 204
    for i in range(5):
        s3.put_object(Bucket="del", Key=f"k{i}", Body=b"x")
    # boto3 sends DeleteObjects with its default CRC checksum.
    r = s3.delete_objects(Bucket="del", Delete={"Objects": [{"Key": f"k{i}"} for i in range(5)] + [{"Key": "missing"}]})
    assert sorted(d["Key"] for d in r["Deleted"]) == sorted([f"k{i}" for i in range(5)] + ["missing"])
    assert "Errors" not in r or not r["Errors"]
    assert s3.list_objects_v2(Bucket="del")["KeyCount"] == 0
    s3.put_object(Bucket="del", Key="q", Body=b"x")
    r = s3.delete_objects(Bucket="del", Delete={"Objects": [{"Key": "q"}], "Quiet": True})
    assert not r.get("Deleted")


def test_copy_object(s3):
    s3.create_bucket(Bucket="src")
    s3.create_bucket(Bucket="dst")
    body = data(5, 2 * MIB + 3)
    s3.put_object(Bucket="src", Key="a", Body=body, Metadata={"m": "1"}, ContentType="text/x", Tagging="t=1")
    r = s3.copy_object(Bucket="dst", Key="b", CopySource={"Bucket": "src", "Key": "a"})
    assert r["CopyObjectResult"]["ETag"]
    h = s3.head_object(Bucket="dst", Key="b")
    assert h["Metadata"] == {"m": "1"} and h["ContentType"] == "text/x"
    assert s3.get_object(Bucket="dst", Key="b")["Body"].read() == body
    assert s3.get_object_tagging(Bucket="dst", Key="b")["TagSet"] == [{"Key": "t", "Value": "1"}]
    s3.copy_object(Bucket="dst", Key="c", CopySource="src/a", MetadataDirective="REPLACE", Metadata={"n": "2"}, ContentType="text/y")
    h = s3.head_object(Bucket="dst", Key="c")
    assert h["Metadata"] == {"n": "2"} and h["ContentType"] == "text/y"
    # Self-copy without changes is refused; with REPLACE it updates metadata.
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.copy_object(Bucket="src", Key="a", CopySource="src/a")
    assert code(e) == "InvalidRequest"
    s3.copy_object(Bucket="src", Key="a", CopySource="src/a", MetadataDirective="REPLACE", Metadata={"m": "3"})
    assert s3.head_object(Bucket="src", Key="a")["Metadata"] == {"m": "3"}
    assert s3.get_object(Bucket="src", Key="a")["Body"].read() == body
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.copy_object(Bucket="dst", Key="d", CopySource="src/a", CopySourceIfMatch='"nope"')
    assert status(e) == 412
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.copy_object(Bucket="dst", Key="d", CopySource="src/missing")
    assert code(e) == "NoSuchKey"


def test_listing_v1_v2(s3):
    s3.create_bucket(Bucket="list")
    keys = [f"dir{d}/sub{s}/f{i}" for d in range(3) for s in range(2) for i in range(4)] + ["top1", "top2", "a b+c/ü.txt"]
    for k in keys:
        s3.put_object(Bucket="list", Key=k, Body=b"x")
    pag = s3.get_paginator("list_objects_v2")
    got = [o["Key"] for page in pag.paginate(Bucket="list", PaginationConfig={"PageSize": 7}) for o in page.get("Contents", [])]
    assert got == sorted(keys)
    got = [o["Key"] for page in s3.get_paginator("list_objects").paginate(Bucket="list", PaginationConfig={"PageSize": 5}) for o in page.get("Contents", [])]
    assert got == sorted(keys)
    r = s3.list_objects_v2(Bucket="list", Delimiter="/")
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["a b+c/", "dir0/", "dir1/", "dir2/"]
    assert [o["Key"] for o in r["Contents"]] == ["top1", "top2"]
    r = s3.list_objects_v2(Bucket="list", Prefix="dir1/", Delimiter="/")
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["dir1/sub0/", "dir1/sub1/"]
    # Paging through common prefixes one at a time.
    prefixes = []
    for page in pag.paginate(Bucket="list", Delimiter="/", PaginationConfig={"PageSize": 1}):
        prefixes += [p["Prefix"] for p in page.get("CommonPrefixes", [])]
    assert prefixes == ["a b+c/", "dir0/", "dir1/", "dir2/"]
    r = s3.list_objects_v2(Bucket="list", StartAfter="dir2/sub1/f2")
    assert [o["Key"] for o in r["Contents"]] == ["dir2/sub1/f3", "top1", "top2"]
    r = s3.list_objects_v2(Bucket="list", MaxKeys=0)
    assert r["KeyCount"] == 0 and not r["IsTruncated"]
    # encoding-type=url: boto3 decodes the keys again.
    # encoding-type=url asked for explicitly: boto3 leaves decoding to the caller.
    r = s3.list_objects_v2(Bucket="list", Prefix="a b", EncodingType="url")
    assert [urllib.parse.unquote(o["Key"]) for o in r["Contents"]] == ["a b+c/ü.txt"]
    assert r["Contents"][0]["Key"] == "a%20b%2Bc/%C3%BC.txt"
    r = s3.list_objects(Bucket="list", Prefix="dir0/", MaxKeys=3)
    assert r["IsTruncated"] and len(r["Contents"]) == 3
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.list_objects_v2(Bucket="list", ContinuationToken="not-a-token")
    assert code(e) == "InvalidArgument"


def test_multipart(s3):
    s3.create_bucket(Bucket="mpu")
    s3.put_object(Bucket="mpu", Key="live", Body=b"live object")
    # An aborted upload never touches the live object with the same key.
    up = s3.create_multipart_upload(Bucket="mpu", Key="live")["UploadId"]
    s3.upload_part(Bucket="mpu", Key="live", UploadId=up, PartNumber=1, Body=data(1, 5 * MIB))
    s3.abort_multipart_upload(Bucket="mpu", Key="live", UploadId=up)
    assert s3.get_object(Bucket="mpu", Key="live")["Body"].read() == b"live object"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.list_parts(Bucket="mpu", Key="live", UploadId=up)
    assert code(e) == "NoSuchUpload"

    up = s3.create_multipart_upload(Bucket="mpu", Key="big", ContentType="application/x-ckpt", Metadata={"step": "7"})["UploadId"]
    parts = [data(10 + i, 5 * MIB + i) for i in range(2)] + [data(99, 1234)]
    etags = []
    for i, p in enumerate(parts):
        etags.append(s3.upload_part(Bucket="mpu", Key="big", UploadId=up, PartNumber=i + 1, Body=p)["ETag"])
    listed = s3.list_parts(Bucket="mpu", Key="big", UploadId=up)
    assert [p["PartNumber"] for p in listed["Parts"]] == [1, 2, 3]
    assert [p["Size"] for p in listed["Parts"]] == [len(p) for p in parts]
    uploads = s3.list_multipart_uploads(Bucket="mpu")["Uploads"]
    assert [u["UploadId"] for u in uploads] == [up]
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.complete_multipart_upload(Bucket="mpu", Key="big", UploadId=up, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": '"00000000000000000000000000000000"'}]})
    assert code(e) == "InvalidPart"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.complete_multipart_upload(Bucket="mpu", Key="big", UploadId=up, MultipartUpload={"Parts": [{"PartNumber": 2, "ETag": etags[1]}, {"PartNumber": 1, "ETag": etags[0]}]})
    assert code(e) == "InvalidPartOrder"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.complete_multipart_upload(Bucket="mpu", Key="big", UploadId=up, MultipartUpload={"Parts": [{"PartNumber": 3, "ETag": etags[2]}, {"PartNumber": 4, "ETag": etags[2]}]})
    assert code(e) in ("InvalidPart", "EntityTooSmall")
    r = s3.complete_multipart_upload(Bucket="mpu", Key="big", UploadId=up, MultipartUpload={"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]})
    assert r["ETag"].strip('"').endswith("-3")
    body = b"".join(parts)
    g = s3.get_object(Bucket="mpu", Key="big")
    assert g["Body"].read() == body and g["ContentType"] == "application/x-ckpt" and g["Metadata"] == {"step": "7"}
    p2 = s3.get_object(Bucket="mpu", Key="big", PartNumber=2)
    assert p2["Body"].read() == parts[1] and p2["PartsCount"] == 3
    assert s3.head_object(Bucket="mpu", Key="big", PartNumber=3)["ContentLength"] == 1234
    assert not s3.list_multipart_uploads(Bucket="mpu").get("Uploads")

    # UploadPartCopy from ranges of the finished object.
    up = s3.create_multipart_upload(Bucket="mpu", Key="copied")["UploadId"]
    e1 = s3.upload_part_copy(Bucket="mpu", Key="copied", UploadId=up, PartNumber=1, CopySource="mpu/big", CopySourceRange=f"bytes=0-{5 * MIB - 1}")["CopyPartResult"]["ETag"]
    e2 = s3.upload_part_copy(Bucket="mpu", Key="copied", UploadId=up, PartNumber=2, CopySource="mpu/live")["CopyPartResult"]["ETag"]
    s3.complete_multipart_upload(Bucket="mpu", Key="copied", UploadId=up, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": e1}, {"PartNumber": 2, "ETag": e2}]})
    assert s3.get_object(Bucket="mpu", Key="copied")["Body"].read() == body[: 5 * MIB] + b"live object"


def test_upload_file_transfer_manager(s3, tmp_path):
    """boto3's managed transfer: parallel multipart with default checksums."""
    s3.create_bucket(Bucket="xfer")
    p = tmp_path / "ckpt.bin"
    body = data(77, 21 * MIB + 11)
    p.write_bytes(body)
    from boto3.s3.transfer import TransferConfig

    cfg = TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=8 * MIB, max_concurrency=4)
    s3.upload_file(str(p), "xfer", "ckpt.bin", Config=cfg)
    out = tmp_path / "back.bin"
    s3.download_file("xfer", "ckpt.bin", str(out), Config=cfg)
    assert out.read_bytes() == body


def test_tagging(s3):
    s3.create_bucket(Bucket="tags")
    body = data(3, 300 * KIB)
    s3.put_object(Bucket="tags", Key="k", Body=body, Tagging="a=1&b=two%20words")
    assert s3.get_object_tagging(Bucket="tags", Key="k")["TagSet"] == [{"Key": "a", "Value": "1"}, {"Key": "b", "Value": "two words"}]
    s3.put_object_tagging(Bucket="tags", Key="k", Tagging={"TagSet": [{"Key": "x", "Value": "y"}]})
    assert s3.get_object_tagging(Bucket="tags", Key="k")["TagSet"] == [{"Key": "x", "Value": "y"}]
    # Tagging must never overwrite the body.
    assert s3.get_object(Bucket="tags", Key="k")["Body"].read() == body
    assert s3.get_object(Bucket="tags", Key="k")["TagCount"] == 1
    s3.delete_object_tagging(Bucket="tags", Key="k")
    assert s3.get_object_tagging(Bucket="tags", Key="k")["TagSet"] == []
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object_tagging(Bucket="tags", Key="k", Tagging={"TagSet": [{"Key": f"k{i}", "Value": "v"} for i in range(11)]})
    assert code(e) == "InvalidTag"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object_tagging(Bucket="tags", Key="missing")
    assert code(e) == "NoSuchKey"


def test_versioning(s3):
    s3.create_bucket(Bucket="ver")
    assert "Status" not in s3.get_bucket_versioning(Bucket="ver")
    s3.put_object(Bucket="ver", Key="k", Body=b"null")
    s3.put_bucket_versioning(Bucket="ver", VersioningConfiguration={"Status": "Enabled"})
    assert s3.get_bucket_versioning(Bucket="ver")["Status"] == "Enabled"
    v1 = s3.put_object(Bucket="ver", Key="k", Body=b"one")["VersionId"]
    v2 = s3.put_object(Bucket="ver", Key="k", Body=b"two")["VersionId"]
    assert v1 != v2
    assert s3.get_object(Bucket="ver", Key="k")["Body"].read() == b"two"
    assert s3.get_object(Bucket="ver", Key="k", VersionId=v1)["Body"].read() == b"one"
    assert s3.get_object(Bucket="ver", Key="k", VersionId="null")["Body"].read() == b"null"
    d = s3.delete_object(Bucket="ver", Key="k")
    assert d["DeleteMarker"] is True
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="ver", Key="k")
    assert code(e) == "NoSuchKey"
    assert e.value.response["ResponseMetadata"]["HTTPHeaders"].get("x-amz-delete-marker") == "true"
    r = s3.list_object_versions(Bucket="ver")
    assert [v["VersionId"] for v in r["Versions"]] == [v2, v1, "null"]
    assert r["DeleteMarkers"][0]["IsLatest"] and r["DeleteMarkers"][0]["VersionId"] == d["VersionId"]
    assert s3.list_objects_v2(Bucket="ver")["KeyCount"] == 0
    s3.delete_object(Bucket="ver", Key="k", VersionId=d["VersionId"])
    assert s3.get_object(Bucket="ver", Key="k")["Body"].read() == b"two"
    s3.delete_object(Bucket="ver", Key="k", VersionId=v2)
    assert s3.get_object(Bucket="ver", Key="k")["Body"].read() == b"one"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="ver", Key="k", VersionId="1" * 32)
    assert code(e) == "NoSuchVersion"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket="ver", Key="k", VersionId="0" * 32)
    assert code(e) == "InvalidArgument"
    s3.put_bucket_versioning(Bucket="ver", VersioningConfiguration={"Status": "Suspended"})
    assert s3.get_bucket_versioning(Bucket="ver")["Status"] == "Suspended"
    assert s3.put_object(Bucket="ver", Key="k", Body=b"suspended").get("VersionId") in (None, "null")
    assert s3.get_object(Bucket="ver", Key="k")["Body"].read() == b"suspended"
    assert s3.get_object(Bucket="ver", Key="k", VersionId=v1)["Body"].read() == b"one"


@pytest.mark.parametrize("algorithm", ["CRC32", "CRC32C", "CRC64NVME", "SHA1", "SHA256"])
def test_checksums_verified_and_returned(s3, algorithm):
    s3.create_bucket(Bucket="sums")
    body = data(8, 200 * KIB)
    r = s3.put_object(Bucket="sums", Key="k", Body=body, ChecksumAlgorithm=algorithm)
    field = f"Checksum{algorithm}"
    assert r[field]
    h = s3.head_object(Bucket="sums", Key="k", ChecksumMode="ENABLED")
    assert h[field] == r[field]
    g = s3.get_object(Bucket="sums", Key="k", ChecksumMode="ENABLED")
    assert g["Body"].read() == body


def test_bad_digests_leave_data_untouched(s3):
    s3.create_bucket(Bucket="bad")
    s3.put_object(Bucket="bad", Key="k", Body=b"original")
    wrong_md5 = base64.b64encode(hashlib.md5(b"different").digest()).decode()
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="bad", Key="k", Body=b"replacement", ContentMD5=wrong_md5)
    assert code(e) == "BadDigest"
    wrong_sha = base64.b64encode(hashlib.sha256(b"different").digest()).decode()
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="bad", Key="k", Body=b"replacement", ChecksumSHA256=wrong_sha)
    assert code(e) == "BadDigest"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="bad", Key="k", Body=b"replacement", ContentMD5="not base64!")
    assert code(e) == "InvalidDigest"
    assert s3.get_object(Bucket="bad", Key="k")["Body"].read() == b"original"
    good = base64.b64encode(hashlib.md5(b"replacement").digest()).decode()
    s3.put_object(Bucket="bad", Key="k", Body=b"replacement", ContentMD5=good)
    assert s3.get_object(Bucket="bad", Key="k")["Body"].read() == b"replacement"


def test_list_multipart_uploads_with_delimiter_and_paging(s3):
    s3.create_bucket(Bucket="uploads")
    ids = {}
    for key in ["a/1", "a/2", "b/1", "c"]:
        ids[key] = s3.create_multipart_upload(Bucket="uploads", Key=key)["UploadId"]
    r = s3.list_multipart_uploads(Bucket="uploads", Delimiter="/")
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["a/", "b/"]
    assert [u["Key"] for u in r["Uploads"]] == ["c"]
    r = s3.list_multipart_uploads(Bucket="uploads", Prefix="a/")
    assert [u["Key"] for u in r["Uploads"]] == ["a/1", "a/2"]
    r = s3.list_multipart_uploads(Bucket="uploads", MaxUploads=2)
    assert r["IsTruncated"] and [u["Key"] for u in r["Uploads"]] == ["a/1", "a/2"]
    r = s3.list_multipart_uploads(Bucket="uploads", KeyMarker=r["NextKeyMarker"], UploadIdMarker=r["NextUploadIdMarker"])
    assert [u["Key"] for u in r["Uploads"]] == ["b/1", "c"]
    for key, up in ids.items():
        s3.abort_multipart_upload(Bucket="uploads", Key=key, UploadId=up)
    assert not s3.list_multipart_uploads(Bucket="uploads").get("Uploads")


def test_list_object_versions_paging(s3):
    s3.create_bucket(Bucket="verpage")
    s3.put_bucket_versioning(Bucket="verpage", VersioningConfiguration={"Status": "Enabled"})
    want = []
    for key in ["a", "b/x", "b/y", "c"]:
        ids = [s3.put_object(Bucket="verpage", Key=key, Body=f"{key}{i}".encode())["VersionId"] for i in range(3)]
        want += [(key, v) for v in reversed(ids)]
    s3.delete_object(Bucket="verpage", Key="c")
    got, markers = [], []
    for page in s3.get_paginator("list_object_versions").paginate(Bucket="verpage", PaginationConfig={"PageSize": 2}):
        got += [(v["Key"], v["VersionId"]) for v in page.get("Versions", [])]
        markers += [m["Key"] for m in page.get("DeleteMarkers", [])]
    assert got == want
    assert markers == ["c"]
    r = s3.list_object_versions(Bucket="verpage", Delimiter="/")
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["b/"]
    assert sorted({v["Key"] for v in r["Versions"]}) == ["a", "c"]


def test_complete_multipart_retry_after_success(s3):
    """A completion whose response was lost is retried by the client: the retry
    succeeds with the same ETag instead of a false NoSuchUpload."""
    s3.create_bucket(Bucket="retry")
    up = s3.create_multipart_upload(Bucket="retry", Key="ckpt")["UploadId"]
    parts = [data(1, 5 * MIB), data(2, 100)]
    etags = [s3.upload_part(Bucket="retry", Key="ckpt", UploadId=up, PartNumber=i + 1, Body=p)["ETag"] for i, p in enumerate(parts)]
    done = {"Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]}
    first = s3.complete_multipart_upload(Bucket="retry", Key="ckpt", UploadId=up, MultipartUpload=done)
    again = s3.complete_multipart_upload(Bucket="retry", Key="ckpt", UploadId=up, MultipartUpload=done)
    assert again["ETag"] == first["ETag"]
    # A different part list for the gone upload is still an error.
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.complete_multipart_upload(Bucket="retry", Key="ckpt", UploadId=up, MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etags[0]}]})
    assert code(e) == "NoSuchUpload"
    assert s3.get_object(Bucket="retry", Key="ckpt")["Body"].read() == b"".join(parts)
