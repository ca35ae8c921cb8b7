"""The S3 semantics that object-store KV tiers rely on (issue 18), driven
the way each drives an endpoint:

- NIXL's OBJ plugin and Dynamo KVBM's object tier: an AWS SDK client
  (aws-sdk-cpp / aws-sdk-rust; here boto3, which shares their defaults:
  flexible checksums sent as aws-chunked trailers, response checksums
  validated when offered), path or virtual-host addressing, HeadObject for
  existence (404 / 200), whole-object PUTs, reads of a block's byte range
  (206 with Content-Range), `If-None-Match: *` so two writers of one block
  store it once (412 for the second).
- LMCache's S3 connector: awscrt's S3 client with TLS off, HEAD for
  existence and size (a DEFAULT request named HeadObject), GET_OBJECT meta
  requests (auto-ranged part GETs, bodies delivered at their offsets) and
  PUT_OBJECT with a Content-Length (split into a multipart upload past the
  part size).

Each check is one a tier would otherwise get wrong silently: a HEAD that
answered 200 for a missing block, a range answered whole, a second writer
that overwrote the first, a checksum the SDK refuses on a range."""

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import botocore.exceptions
import pytest

from conftest import data
from tarnproc import ACCESS_KEY, SECRET_KEY


def status(e):
    return e.value.response["ResponseMetadata"]["HTTPStatusCode"]


@pytest.fixture
def localhost_buckets(monkeypatch):
    """Resolves `<bucket>.localhost` to loopback, as a DNS wildcard does for
    a real virtual-host deployment (this machine's resolver has none)."""
    real = socket.getaddrinfo

    def resolve(host, *args, **kwargs):
        if isinstance(host, str) and host.endswith(".localhost"):
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


def sdk_client(server, addressing, checksums):
    """A client configured as the SDK-based tiers configure theirs."""
    import boto3
    import botocore.config

    port = server.endpoint.rsplit(":", 1)[1]
    cfg = botocore.config.Config(
        retries={"max_attempts": 1, "mode": "standard"},
        s3={"addressing_style": addressing},
        request_checksum_calculation=checksums,
        response_checksum_validation=checksums,
        max_pool_connections=16,
    )
    # Virtual-host addressing names the bucket in the host: the endpoint
    # must be a name (`localhost`, Tarn's default domain), not an address.
    endpoint = f"http://localhost:{port}" if addressing == "virtual" else server.endpoint
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name="us-east-1",
        config=cfg,
    )


@pytest.mark.parametrize("addressing", ["path", "virtual"])
@pytest.mark.parametrize("checksums", ["when_supported", "when_required"])
def test_block_tier_semantics_through_an_sdk(server, localhost_buckets, addressing, checksums):
    bucket = f"kv-{addressing}-{checksums.replace('_', '-')}"
    server.client().create_bucket(Bucket=bucket)
    s3 = sdk_client(server, addressing, checksums)
    hosts = []
    s3.meta.events.register("before-send.s3", lambda request, **kw: hosts.append(request.url.split("/")[2]))
    key = "model-x/bf16/layer-all/0123456789abcdef0123456789abcdef"
    block = data(key, (256 << 10) + 17)

    # Existence of a block never stored: 404, not 200 and not 403.
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_object(Bucket=bucket, Key=key)
    assert status(e) == 404
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket=bucket, Key=key, Range="bytes=0-99")
    assert status(e) == 404 and e.value.response["Error"]["Code"] == "NoSuchKey"

    # Stored once: the second writer of the same block is refused, and
    # what the first wrote stays.
    s3.put_object(Bucket=bucket, Key=key, Body=block, IfNoneMatch="*")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket=bucket, Key=key, Body=data("other", len(block)), IfNoneMatch="*")
    assert status(e) == 412 and e.value.response["Error"]["Code"] == "PreconditionFailed"
    head = s3.head_object(Bucket=bucket, Key=key)
    assert head["ContentLength"] == len(block)

    # A block's byte ranges (a rank's slice, a layer's), with the SDK's
    # response validation on: 206, the range's bytes, its Content-Range.
    n = len(block)
    for first, last in [(0, 0), (0, 4095), (4096, 8191), (n - 17, n - 1), (12345, 200_000)]:
        r = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={first}-{last}", ChecksumMode="ENABLED")
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert r["ContentRange"] == f"bytes {first}-{last}/{n}"
        assert r["Body"].read() == block[first:last + 1], (first, last)
    r = s3.get_object(Bucket=bucket, Key=key, Range="bytes=-100")
    assert r["ContentRange"] == f"bytes {n - 100}-{n - 1}/{n}" and r["Body"].read() == block[-100:]
    r = s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={n - 10}-")
    assert r["Body"].read() == block[-10:]
    # A range past the end would be a short read taken for a block: 416.
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={n}-{n + 10}")
    assert status(e) == 416
    # The whole object, validated against its checksum when one was sent.
    r = s3.get_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 200 and r["Body"].read() == block

    # Many blocks written and read at once from a thread pool (the
    # plugins' executors): every ranged read sees its own block.
    keys = [f"model-x/bf16/{i:04}" for i in range(24)]

    def put(k):
        s3.put_object(Bucket=bucket, Key=k, Body=data(k, 65_536 + len(k)), IfNoneMatch="*")

    def read(k):
        r = s3.get_object(Bucket=bucket, Key=k, Range="bytes=1000-50999")
        return r["Body"].read() == data(k, 65_536 + len(k))[1000:51000]

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(put, keys))
        assert all(pool.map(read, keys))
    # The addressing asked for is the one used.
    want = f"{bucket}.localhost:" if addressing == "virtual" else "127.0.0.1:"
    assert hosts and all(h.startswith(want) for h in hosts), set(hosts)
    # A missing bucket is a 404 too (a tier pointed at the wrong one).
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_object(Bucket="kv-no-such-bucket", Key=key)
    assert status(e) == 404


def crt_client(part_size):
    from awscrt import auth, io, s3

    elg = io.EventLoopGroup(2)
    bootstrap = io.ClientBootstrap(elg, io.DefaultHostResolver(elg))
    creds = auth.AwsCredentialsProvider.new_static(ACCESS_KEY, SECRET_KEY)
    client = s3.S3Client(
        bootstrap=bootstrap,
        region="us-east-1",
        tls_mode=s3.S3RequestTlsMode.DISABLED,
        credential_provider=creds,
        part_size=part_size,
        multipart_upload_threshold=part_size,
    )
    return client, creds


def crt_request(client, creds, method, host, path, body=None, kind=None, op=None):
    """One request as LMCache's connector makes it: (status, headers, body)."""
    import io as pyio

    from awscrt import http, s3

    headers = http.HttpHeaders()
    headers.add("Host", host)
    if body is not None:
        headers.add("Content-Length", str(len(body)))
        headers.add("Content-Type", "application/octet-stream")
    req = http.HttpRequest(method, path, headers, body_stream=pyio.BytesIO(body) if body is not None else None)
    got = {"status": None, "headers": {}, "body": bytearray(), "lock": threading.Lock()}

    def on_headers(status_code, headers, **kwargs):
        got["status"] = status_code
        got["headers"] = {k.lower(): v for k, v in headers}

    def on_body(chunk, offset, **kwargs):
        with got["lock"]:
            buf = got["body"]
            if len(buf) < offset + len(chunk):
                buf.extend(b"\0" * (offset + len(chunk) - len(buf)))
            buf[offset:offset + len(chunk)] = chunk

    def on_done(error=None, status_code=None, **kwargs):
        if status_code is not None:
            got["status"] = status_code

    r = s3.S3Request(
        client=client,
        type=kind if kind is not None else s3.S3RequestType.DEFAULT,
        request=req,
        operation_name=op,
        on_headers=on_headers,
        on_body=on_body,
        on_done=on_done,
        credential_provider=creds,
        region="us-east-1",
    )
    try:
        r.finished_future.result(timeout=60)
    except Exception:  # noqa: BLE001 - an error status is the answer
        pass
    return got["status"], got["headers"], bytes(got["body"])


def test_lmcache_s3_connector_requests_through_awscrt(server, s3):
    """LMCache's S3 connector: awscrt with TLS off, a HEAD for existence and
    size, GET_OBJECT (ranged part GETs, assembled at their offsets) and
    PUT_OBJECT (a multipart upload past the part size)."""
    from awscrt import s3 as crt_s3

    s3.create_bucket(Bucket="lmcache")
    host = server.endpoint.removeprefix("http://")
    part = 5 << 20
    client, creds = crt_client(part)
    chunk = data("chunk", 2 * part + 12_345)  # three parts up and down
    key = "/lmcache/vllm%40model_1_0_abcdef0123456789"

    st, h, _ = crt_request(client, creds, "HEAD", host, key, op="HeadObject")
    assert st == 404, (st, h)
    st, h, _ = crt_request(client, creds, "PUT", host, key, body=chunk, kind=crt_s3.S3RequestType.PUT_OBJECT)
    assert st == 200, (st, h)
    # Stored as the multipart upload the client made of it.
    etag = s3.head_object(Bucket="lmcache", Key="vllm@model_1_0_abcdef0123456789")["ETag"]
    assert etag.strip('"').endswith("-3"), etag
    st, h, _ = crt_request(client, creds, "HEAD", host, key, op="HeadObject")
    assert st == 200 and int(h["content-length"]) == len(chunk), (st, h)
    st, h, body = crt_request(client, creds, "GET", host, key, kind=crt_s3.S3RequestType.GET_OBJECT)
    assert st in (200, 206) and body == chunk, (st, len(body))
    # A small one (one part, one GET) and a missing one.
    small = data("small", 70_000)
    st, _, _ = crt_request(client, creds, "PUT", host, "/lmcache/small", body=small,
                           kind=crt_s3.S3RequestType.PUT_OBJECT)
    assert st == 200
    st, _, body = crt_request(client, creds, "GET", host, "/lmcache/small", kind=crt_s3.S3RequestType.GET_OBJECT)
    assert st in (200, 206) and body == small
    st, _, _ = crt_request(client, creds, "GET", host, "/lmcache/missing", kind=crt_s3.S3RequestType.GET_OBJECT)
    assert st == 404
