"""aws-chunked uploads built by hand, byte for byte as the SigV4 streaming spec
defines them: signed chunks, unsigned chunks with a trailing checksum, and the
failures (wrong chunk signature, wrong trailer checksum) that must leave the
stored object untouched."""

import base64
import datetime
import hashlib
import hmac
import zlib

import botocore.exceptions
import pytest
import requests

from conftest import ACCESS_KEY, SECRET_KEY, data

EMPTY_SHA = hashlib.sha256(b"").hexdigest()


def _hmac(key, msg):
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def signing_key(day):
    k = _hmac(("AWS4" + SECRET_KEY).encode(), day)
    for part in ("us-east-1", "s3", "aws4_request"):
        k = _hmac(k, part)
    return k


def seed_request(method, host, path, headers, payload_hash, now, query=""):
    """Signs the request head; returns (authorization header, seed signature)."""
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    headers = dict(headers, host=host, **{"x-amz-date": amz_date, "x-amz-content-sha256": payload_hash})
    names = sorted(h.lower() for h in headers)
    canonical_headers = "".join(f"{n}:{str(headers[[h for h in headers if h.lower() == n][0]]).strip()}\n" for n in names)
    signed_headers = ";".join(names)
    canonical = f"{method}\n{path}\n{query}\n{canonical_headers}\n{signed_headers}\n{payload_hash}"
    scope = f"{day}/us-east-1/s3/aws4_request"
    sts = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    sig = hmac.new(signing_key(day), sts.encode(), hashlib.sha256).hexdigest()
    auth = f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY}/{scope}, SignedHeaders={signed_headers}, Signature={sig}"
    headers["Authorization"] = auth
    return headers, sig, amz_date, scope


def signed_chunks(body, chunk, seed_sig, amz_date, scope, corrupt=False):
    key = signing_key(amz_date[:8])
    out = b""
    prev = seed_sig
    pieces = [body[i : i + chunk] for i in range(0, len(body), chunk)] + [b""]
    for n, piece in enumerate(pieces):
        sts = f"AWS4-HMAC-SHA256-PAYLOAD\n{amz_date}\n{scope}\n{prev}\n{EMPTY_SHA}\n{hashlib.sha256(piece).hexdigest()}"
        sig = hmac.new(key, sts.encode(), hashlib.sha256).hexdigest()
        if corrupt and n == 1:
            sig = "0" * 64
        out += f"{len(piece):x};chunk-signature={sig}\r\n".encode() + piece + b"\r\n"
        prev = sig
    return out


def crc32_b64(b):
    return base64.b64encode(zlib.crc32(b).to_bytes(4, "big")).decode()


def put_raw(server, path, headers, body):
    host = server.endpoint.replace("http://", "")
    return requests.put(f"{server.endpoint}{path}", headers=headers, data=body)


def test_signed_aws_chunked_upload(server):
    s3 = server.client()
    s3.create_bucket(Bucket="chunks")
    body = data(1, 300_000)
    host = server.endpoint.replace("http://", "")
    now = datetime.datetime.now(datetime.timezone.utc)
    extra = {"content-encoding": "aws-chunked", "x-amz-decoded-content-length": str(len(body))}
    headers, seed, amz_date, scope = seed_request("PUT", host, "/chunks/signed", extra, "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", now)
    wire = signed_chunks(body, 64 * 1024, seed, amz_date, scope)
    r = put_raw(server, "/chunks/signed", dict(headers, **{"Content-Length": str(len(wire))}), wire)
    assert r.status_code == 200, r.content
    assert s3.get_object(Bucket="chunks", Key="signed")["Body"].read() == body

    # A chunk whose signature is wrong: rejected, the stored object unchanged.
    headers, seed, amz_date, scope = seed_request("PUT", host, "/chunks/signed", extra, "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", now)
    wire = signed_chunks(data(2, 300_000), 64 * 1024, seed, amz_date, scope, corrupt=True)
    r = put_raw(server, "/chunks/signed", dict(headers, **{"Content-Length": str(len(wire))}), wire)
    assert r.status_code == 403 and b"<Code>SignatureDoesNotMatch</Code>" in r.content, r.content
    assert s3.get_object(Bucket="chunks", Key="signed")["Body"].read() == body


@pytest.mark.parametrize("size", [0, 100, 200_000, 3 * 1024 * 1024])
def test_unsigned_chunked_with_trailing_checksum(server, size):
    s3 = server.client()
    s3.create_bucket(Bucket="trail")
    body = data(size, size)
    host = server.endpoint.replace("http://", "")

    def upload(key, trailer_value):
        now = datetime.datetime.now(datetime.timezone.utc)
        extra = {
            "content-encoding": "aws-chunked",
            "x-amz-decoded-content-length": str(len(body)),
            "x-amz-trailer": "x-amz-checksum-crc32",
        }
        headers, _, _, _ = seed_request("PUT", host, f"/trail/{key}", extra, "STREAMING-UNSIGNED-PAYLOAD-TRAILER", now)
        wire = b""
        for i in range(0, len(body), 65536):
            piece = body[i : i + 65536]
            wire += f"{len(piece):x}\r\n".encode() + piece + b"\r\n"
        wire += b"0\r\n" + f"x-amz-checksum-crc32:{trailer_value}\r\n\r\n".encode()
        return put_raw(server, f"/trail/{key}", dict(headers, **{"Content-Length": str(len(wire))}), wire)

    r = upload("k", crc32_b64(body))
    assert r.status_code == 200, r.content
    assert s3.get_object(Bucket="trail", Key="k")["Body"].read() == body
    h = s3.head_object(Bucket="trail", Key="k", ChecksumMode="ENABLED")
    assert h["ChecksumCRC32"] == crc32_b64(body)
    r = upload("k", crc32_b64(body + b"x"))
    assert r.status_code == 400 and b"BadDigest" in r.content, r.content
    assert s3.get_object(Bucket="trail", Key="k")["Body"].read() == body


def test_not_implemented_operations(s3):
    s3.create_bucket(Bucket="noimpl")
    for call in (
        lambda: s3.get_bucket_replication(Bucket="noimpl"),
        lambda: s3.get_bucket_accelerate_configuration(Bucket="noimpl"),
        lambda: s3.get_bucket_website(Bucket="noimpl"),
    ):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            call()
        assert e.value.response["Error"]["Code"] == "NotImplemented"
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 501
