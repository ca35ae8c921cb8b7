"""The server as a whole: authentication, addressing, bad input, concurrency,
restarts, lost drives, admission control, shutdown, metrics, the aws CLI."""

import concurrent.futures
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.parse

import boto3
import botocore.auth
import botocore.awsrequest
import botocore.credentials
import botocore.exceptions
import pytest
import requests

from conftest import ACCESS_KEY, BIN, SECRET_KEY, data

MIB = 1024 * 1024


def signed(method, url, headers=None, body=b"", secret=SECRET_KEY, payload_hash=None):
    """A SigV4-signed request built with botocore's signer; the payload hash is
    the body's SHA-256 unless given (e.g. UNSIGNED-PAYLOAD)."""
    req = botocore.awsrequest.AWSRequest(method=method, url=url, data=body, headers=headers or {})
    req.headers["x-amz-content-sha256"] = payload_hash or hashlib.sha256(body).hexdigest()
    botocore.auth.SigV4Auth(botocore.credentials.Credentials(ACCESS_KEY, secret), "s3", "us-east-1").add_auth(req)
    return req


def send(req):
    return requests.request(req.method, req.url, headers=dict(req.headers), data=req.body)


def test_wrong_credentials_are_refused(server):
    good = server.client()
    good.create_bucket(Bucket="auth")
    good.put_object(Bucket="auth", Key="k", Body=b"secret data")
    bad = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key="wrong-secret", region_name="us-east-1")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        bad.get_object(Bucket="auth", Key="k")
    assert e.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    with pytest.raises(botocore.exceptions.ClientError) as e:
        bad.put_object(Bucket="auth", Key="k", Body=b"overwrite")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    unknown = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id="nobody", aws_secret_access_key="whatever-secret", region_name="us-east-1")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        unknown.list_buckets()
    assert e.value.response["Error"]["Code"] == "InvalidAccessKeyId"
    # Anonymous requests are denied.
    r = requests.get(f"{server.endpoint}/auth/k")
    assert r.status_code == 403
    assert good.get_object(Bucket="auth", Key="k")["Body"].read() == b"secret data"


def test_presigned_urls(server):
    s3 = server.client()
    s3.create_bucket(Bucket="pre")
    s3.put_object(Bucket="pre", Key="k", Body=b"presigned body")
    url = s3.generate_presigned_url("get_object", Params={"Bucket": "pre", "Key": "k"}, ExpiresIn=60)
    r = requests.get(url)
    assert r.status_code == 200 and r.content == b"presigned body"
    put_url = s3.generate_presigned_url("put_object", Params={"Bucket": "pre", "Key": "up"}, ExpiresIn=60)
    assert requests.put(put_url, data=b"uploaded").status_code == 200
    assert s3.get_object(Bucket="pre", Key="up")["Body"].read() == b"uploaded"
    expired = s3.generate_presigned_url("get_object", Params={"Bucket": "pre", "Key": "k"}, ExpiresIn=1)
    time.sleep(2.5)
    r = requests.get(expired)
    assert r.status_code == 403 and b"AccessDenied" in r.content
    # Tampering with a presigned URL breaks its signature.
    tampered = url.replace("/pre/k", "/pre/up")
    assert requests.get(tampered).status_code == 403


def test_malformed_requests(server):
    s3 = server.client()
    s3.create_bucket(Bucket="bad")
    s3.put_object(Bucket="bad", Key="k", Body=b"keep")
    ep = server.endpoint
    # Malformed XML in a signed DeleteObjects request.
    body = b"<Delete><Object><Key>k</Key></Obj"
    import base64, hashlib

    req = signed("POST", f"{ep}/bad?delete", headers={"Content-MD5": base64.b64encode(hashlib.md5(body).digest()).decode()}, body=body)
    r = send(req)
    assert r.status_code == 400 and b"MalformedXML" in r.content, r.content
    # Malformed XML for versioning.
    body = b"not xml at all"
    r = send(signed("PUT", f"{ep}/bad?versioning", body=body))
    assert r.status_code == 400
    # A signature over a different payload.
    req = signed("PUT", f"{ep}/bad/k", body=b"signed body")
    r = requests.put(req.url, headers=dict(req.headers), data=b"other body!")
    assert r.status_code in (400, 403), r.content
    # Oversized request head, oversized user metadata.
    r = requests.get(f"{ep}/bad/k", headers={"x-amz-meta-big": "a" * 100_000})
    assert r.status_code in (400, 431)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="bad", Key="k", Body=b"x", Metadata={"big": "m" * 3000})
    assert e.value.response["Error"]["Code"] == "MetadataTooLarge"
    # Garbage on the socket: the server answers or closes, and keeps serving.
    host, port = ep.replace("http://", "").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"\x00\x01\x02 NOT HTTP\r\n\r\n")
        sock.settimeout(5)
        try:
            sock.recv(1024)
        except OSError:
            pass
    assert s3.get_object(Bucket="bad", Key="k")["Body"].read() == b"keep"


def test_virtual_host_addressing(server):
    s3 = server.client()
    s3.create_bucket(Bucket="vhost")
    s3.put_object(Bucket="vhost", Key="dir/k", Body=b"virtual")
    port = server.endpoint.rsplit(":", 1)[1]
    req = signed("GET", f"http://127.0.0.1:{port}/dir/k", headers={"Host": f"vhost.localhost:{port}"})
    r = send(req)
    assert r.status_code == 200 and r.content == b"virtual", r.content
    req = signed("GET", f"http://127.0.0.1:{port}/?list-type=2", headers={"Host": f"vhost.localhost:{port}"})
    r = send(req)
    assert r.status_code == 200 and b"<Key>dir/k</Key>" in r.content


def test_concurrent_clients_mixed_workload(server):
    s3 = server.client(max_pool_connections=64)
    s3.create_bucket(Bucket="conc")
    errors = []

    def worker(w):
        c = server.client()
        mine = {}
        for i in range(12):
            key = f"w{w}/k{i % 4}"
            body = data(w * 1000 + i, (w * 7919 + i * 104729) % (300 * 1024) + (MIB if i % 5 == 0 else 0))
            c.put_object(Bucket="conc", Key=key, Body=body)
            mine[key] = body
            got = c.get_object(Bucket="conc", Key=key)["Body"].read()
            if got != body:
                errors.append(f"{key}: read back {len(got)} bytes, wrote {len(body)}")
            if i % 3 == 0:
                listed = {o["Key"] for o in c.list_objects_v2(Bucket="conc", Prefix=f"w{w}/").get("Contents", [])}
                if listed != set(mine):
                    errors.append(f"w{w}: listing {sorted(listed)} != {sorted(mine)}")
        return mine

    with concurrent.futures.ThreadPoolExecutor(32) as ex:
        results = list(ex.map(worker, range(32)))
    assert not errors, errors[:5]
    for mine in results:
        for key, body in mine.items():
            assert s3.get_object(Bucket="conc", Key=key)["Body"].read() == body


def test_restart_keeps_everything(server):
    s3 = server.client()
    s3.create_bucket(Bucket="persist")
    bodies = {f"k{i}": data(i, i * 97_000) for i in range(12)}
    for k, b in bodies.items():
        s3.put_object(Bucket="persist", Key=k, Body=b)
    assert server.stop() == 0
    server.start()
    s3 = server.client()
    for k, b in bodies.items():
        assert s3.get_object(Bucket="persist", Key=k)["Body"].read() == b


def test_lost_drives_between_restarts_and_heal(make_server):
    server = make_server(expected_errors=[r"drive offline", r"erasure set is degraded", r"metadata write failed", r"lost write quorum", r"shard write"])
    s3 = server.client()
    s3.create_bucket(Bucket="heal")
    bodies = {f"k{i}": data(100 + i, [0, 10, 200_000, 3 * MIB + 1][i % 4]) for i in range(8)}
    for k, b in bodies.items():
        s3.put_object(Bucket="heal", Key=k, Body=b)
    server.stop()
    # Two of four drives fail; one comes back as an empty replacement.
    shutil.rmtree(server.drives[1])
    shutil.rmtree(server.drives[2])
    os.mkdir(server.drives[2])
    server.start()
    assert not os.path.exists(server.drives[1]), "a missing drive is never re-created"
    s3 = server.client()
    for k, b in bodies.items():
        assert s3.get_object(Bucket="heal", Key=k)["Body"].read() == b
    # The empty replacement rebuilds its index from the other two (at once).
    deadline = time.time() + 20
    while time.time() < deadline and "rebuilding" in requests.get(f"{server.admin}/health/ready").text:
        time.sleep(0.1)
    ready = requests.get(f"{server.admin}/health/ready")
    assert ready.status_code == 200 and ready.text.startswith("degraded: 1 of 4 drives offline, full or rebuilding"), ready.text
    assert server.drives[1] in ready.text
    drives = requests.get(f"{server.admin}/admin/drives", headers={"Authorization": f"Bearer {SECRET_KEY}"}).json()
    assert [d["online"] for d in drives] == [True, False, True, True]
    assert "missing" in drives[1]["reason"]
    assert requests.post(f"{server.admin}/admin/heal").status_code == 401
    report = requests.post(f"{server.admin}/admin/heal", headers={"Authorization": f"Bearer {SECRET_KEY}"}).json()
    assert report["failures"] == 0, report
    # The empty replacement drive was healed (at start, or by this call).
    m = requests.get(f"{server.admin}/metrics").text
    rebuilt = [l for l in m.splitlines() if l.startswith("tarn_shards_rebuilt_total")][0]
    assert int(rebuilt.split()[1]) + report["shards_rebuilt"] > 0, rebuilt
    server.stop()
    # The replaced drive now carries its share: lose another one and read again.
    shutil.rmtree(server.drives[3])
    server.start()
    s3 = server.client()
    for k, b in bodies.items():
        assert s3.get_object(Bucket="heal", Key=k)["Body"].read() == b
    assert requests.get(f"{server.admin}/health/ready").status_code == 503
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.put_object(Bucket="heal", Key="new", Body=b"x" * 300_000)
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503


def test_metrics_and_health(server):
    s3 = server.client()
    s3.create_bucket(Bucket="met")
    s3.put_object(Bucket="met", Key="k", Body=b"x")
    s3.get_object(Bucket="met", Key="k")["Body"].read()
    with pytest.raises(botocore.exceptions.ClientError):
        s3.get_object(Bucket="met", Key="missing")
    assert requests.get(f"{server.admin}/health/live").status_code == 200
    ready = requests.get(f"{server.admin}/health/ready")
    assert (ready.status_code, ready.text) == (200, "ready\n")
    m = requests.get(f"{server.admin}/metrics").text
    assert 'tarn_requests_total{op="PutObject",status="200"} 1' in m
    assert 'tarn_requests_total{op="GetObject",status="404"} 1' in m
    assert 'tarn_request_duration_seconds_count{op="GetObject"} 2' in m
    assert "tarn_drive_online" in m
    # Nothing of the admin surface answers on the data port.
    r = requests.get(f"{server.endpoint}/metrics")
    assert r.status_code == 403


def test_overload_answers_slow_down(make_server):
    server = make_server(extra_args=["--inflight-requests-max", "1"])
    s3 = server.client()
    s3.create_bucket(Bucket="load")
    # Hold the only slot with a PUT whose body trickles in.
    port = int(server.endpoint.rsplit(":", 1)[1])
    total = 1000
    req = signed("PUT", f"{server.endpoint}/load/slow", headers={"Content-Length": str(total)}, payload_hash="UNSIGNED-PAYLOAD")
    head = f"PUT /load/slow HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in req.headers.items()) + f"Host: 127.0.0.1:{port}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head.encode() + b"a" * 10)
    time.sleep(0.5)
    t0 = time.time()
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_bucket(Bucket="load")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 503
    assert time.time() - t0 < 2, "overload must be answered quickly"
    sock.sendall(b"a" * (total - 10))
    resp = sock.recv(4096)
    sock.close()
    assert resp.startswith(b"HTTP/1.1 200"), resp[:200]
    assert s3.get_object(Bucket="load", Key="slow")["Body"].read() == b"a" * total
    m = requests.get(f"{server.admin}/metrics").text
    rejected = [l for l in m.splitlines() if l.startswith("tarn_requests_rejected_overload_total")][0]
    assert int(rejected.split()[1]) >= 1, rejected


def test_sigterm_finishes_inflight_request(server):
    s3 = server.client()
    s3.create_bucket(Bucket="term")
    port = int(server.endpoint.rsplit(":", 1)[1])
    total = 200_000
    req = signed("PUT", f"{server.endpoint}/term/k", headers={"Content-Length": str(total)}, payload_hash="UNSIGNED-PAYLOAD")
    head = f"PUT /term/k HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in req.headers.items()) + f"Host: 127.0.0.1:{port}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head.encode() + b"b" * 1000)
    time.sleep(0.3)
    server.proc.send_signal(15)
    time.sleep(0.3)
    sock.sendall(b"b" * (total - 1000))
    resp = sock.recv(4096)
    sock.close()
    assert resp.startswith(b"HTTP/1.1 200"), resp[:200]
    assert server.proc.wait(timeout=40) == 0
    server.start()
    assert server.client().get_object(Bucket="term", Key="k")["Body"].read() == b"b" * total


def test_kill_mid_upload_leaves_old_or_new(server):
    """SIGKILL while a large PUT is streaming: after restart the key holds the
    old object, never a torn one."""
    s3 = server.client()
    s3.create_bucket(Bucket="kill")
    old = data(1, 2 * MIB)
    s3.put_object(Bucket="kill", Key="k", Body=old)
    port = int(server.endpoint.rsplit(":", 1)[1])
    total = 8 * MIB
    req = signed("PUT", f"{server.endpoint}/kill/k", headers={"Content-Length": str(total)}, payload_hash="UNSIGNED-PAYLOAD")
    head = f"PUT /kill/k HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in req.headers.items()) + f"Host: 127.0.0.1:{port}\r\n\r\n"
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(head.encode() + b"n" * (5 * MIB))
    time.sleep(0.3)
    server.kill()
    sock.close()
    server.start()
    s3 = server.client()
    assert s3.get_object(Bucket="kill", Key="k")["Body"].read() == old
    assert [o["Key"] for o in s3.list_objects_v2(Bucket="kill")["Contents"]] == ["k"]


def test_default_credentials_only_on_loopback(tmp_path):
    r = subprocess.run([BIN, "server", "--listen", "0.0.0.0:0", "--drive", str(tmp_path / "d")], capture_output=True, text=True, timeout=30, env={k: v for k, v in os.environ.items() if not k.startswith("TARN_")})
    assert r.returncode != 0
    assert "default credentials" in r.stderr
    assert not (tmp_path / "d").exists() or True


def aws(server, *args, check=True):
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null")
    cmd = [os.path.join(os.path.dirname(sys.executable), "aws"), "--endpoint-url", server.endpoint, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    if check:
        assert r.returncode == 0, f"{' '.join(args)}: {r.stderr}"
    return r


def test_aws_cli(server, tmp_path):
    aws(server, "s3", "mb", "s3://cli")
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    files = {"a.txt": b"hello", "sub/b.bin": data(2, 3 * MIB), "big.bin": data(3, 20 * MIB + 7)}
    for name, body in files.items():
        (src / name).write_bytes(body)
    aws(server, "s3", "cp", str(src / "a.txt"), "s3://cli/a.txt", "--only-show-errors")
    aws(server, "s3", "sync", str(src), "s3://cli/synced", "--only-show-errors")
    ls = aws(server, "s3", "ls", "--recursive", "s3://cli/").stdout
    for name in ["a.txt", "synced/a.txt", "synced/sub/b.bin", "synced/big.bin"]:
        assert name in ls
    dst = tmp_path / "dst"
    aws(server, "s3", "sync", "s3://cli/synced", str(dst), "--only-show-errors")
    for name, body in files.items():
        assert (dst / name).read_bytes() == body
    aws(server, "s3", "rm", "s3://cli/synced/big.bin", "--only-show-errors")
    assert "big.bin" not in aws(server, "s3", "ls", "--recursive", "s3://cli/").stdout
    # s3api multipart by hand.
    up = json.loads(aws(server, "s3api", "create-multipart-upload", "--bucket", "cli", "--key", "mp").stdout)["UploadId"]
    part1 = tmp_path / "p1"
    part1.write_bytes(data(5, 5 * MIB))
    part2 = tmp_path / "p2"
    part2.write_bytes(b"tail")
    e1 = json.loads(aws(server, "s3api", "upload-part", "--bucket", "cli", "--key", "mp", "--upload-id", up, "--part-number", "1", "--body", str(part1)).stdout)["ETag"]
    e2 = json.loads(aws(server, "s3api", "upload-part", "--bucket", "cli", "--key", "mp", "--upload-id", up, "--part-number", "2", "--body", str(part2)).stdout)["ETag"]
    parts = json.loads(aws(server, "s3api", "list-parts", "--bucket", "cli", "--key", "mp", "--upload-id", up).stdout)["Parts"]
    assert [p["PartNumber"] for p in parts] == [1, 2]
    mpu = tmp_path / "mpu.json"
    mpu.write_text(json.dumps({"Parts": [{"PartNumber": 1, "ETag": e1}, {"PartNumber": 2, "ETag": e2}]}))
    aws(server, "s3api", "complete-multipart-upload", "--bucket", "cli", "--key", "mp", "--upload-id", up, "--multipart-upload", f"file://{mpu}")
    out = tmp_path / "mp.out"
    aws(server, "s3", "cp", "s3://cli/mp", str(out), "--only-show-errors")
    assert out.read_bytes() == part1.read_bytes() + b"tail"
    up = json.loads(aws(server, "s3api", "create-multipart-upload", "--bucket", "cli", "--key", "gone").stdout)["UploadId"]
    assert up in aws(server, "s3api", "list-multipart-uploads", "--bucket", "cli").stdout
    aws(server, "s3api", "abort-multipart-upload", "--bucket", "cli", "--key", "gone", "--upload-id", up)
    aws(server, "s3", "rm", "s3://cli", "--recursive", "--only-show-errors")
    aws(server, "s3", "rb", "s3://cli")
    r = aws(server, "s3", "ls", "s3://cli", check=False)
    assert r.returncode != 0 and "NoSuchBucket" in r.stderr


def test_config_file_and_environment_credentials(tmp_path):
    """A TOML config names drives and erasure layout; credentials come from the
    environment and the defaults stop working."""
    drives = [str(tmp_path / f"disk{i}") for i in range(3)]
    cfg = tmp_path / "tarn.toml"
    cfg.write_text(
        'listen = "127.0.0.1:0"\nadmin_listen = "127.0.0.1:0"\nregion = "eu-west-1"\n'
        f"drives = {json.dumps(drives)}\n[erasure]\ndata_shards = 2\nparity_shards = 1\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TARN_")}
    env.update(TARN_ACCESS_KEY="ENVKEY", TARN_SECRET_KEY="env-secret-123")
    proc = subprocess.Popen([BIN, "server", "--config", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        endpoint = None
        for _ in range(20):
            line = proc.stdout.readline()
            if "erasure 2+1" in line:
                assert "region eu-west-1" in line
            if line.startswith("S3 endpoint: "):
                endpoint = line.split(": ", 1)[1].strip()
                break
        assert endpoint
        c = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="ENVKEY", aws_secret_access_key="env-secret-123", region_name="eu-west-1")
        c.create_bucket(Bucket="cfg", CreateBucketConfiguration={"LocationConstraint": "eu-west-1"})
        c.put_object(Bucket="cfg", Key="k", Body=data(1, 2 * MIB))
        assert c.get_object(Bucket="cfg", Key="k")["Body"].read() == data(1, 2 * MIB)
        assert c.get_bucket_location(Bucket="cfg")["LocationConstraint"] == "eu-west-1"
        assert all(os.path.isdir(os.path.join(d, "data")) for d in drives)
        default = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY, region_name="eu-west-1")
        with pytest.raises(botocore.exceptions.ClientError) as e:
            default.list_buckets()
        assert e.value.response["Error"]["Code"] == "InvalidAccessKeyId"
    finally:
        proc.send_signal(15)
        assert proc.wait(timeout=40) == 0
    bad = tmp_path / "bad.toml"
    bad.write_text('listen = "127.0.0.1:0"\nunknown_key = 1\n')
    r = subprocess.run([BIN, "server", "--config", str(bad)], capture_output=True, text=True, env=env, timeout=30)
    assert r.returncode != 0 and "unknown" in r.stderr


def peak_rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def test_large_object_streams_in_bounded_memory(server, tmp_path):
    """A 1 GiB PUT and GET never hold the object in memory: the server's peak
    RSS stays far below the object size."""
    s3 = server.client()
    s3.create_bucket(Bucket="huge")
    size = 1 << 30
    path = tmp_path / "huge.bin"
    with open(path, "wb") as f:
        f.truncate(size)  # sparse: reads as zeros without using disk
    req = signed("PUT", f"{server.endpoint}/huge/k", headers={"Content-Length": str(size)}, payload_hash="UNSIGNED-PAYLOAD")
    with open(path, "rb") as f:
        r = requests.put(req.url, headers=dict(req.headers), data=f)
    assert r.status_code == 200, r.content
    url = s3.generate_presigned_url("get_object", Params={"Bucket": "huge", "Key": "k"}, ExpiresIn=300)
    got = 0
    with requests.get(url, stream=True) as r:
        assert r.status_code == 200
        for chunk in r.iter_content(1 << 20):
            assert not chunk.strip(b"\0"), "body must be all zeros"
            got += len(chunk)
    assert got == size
    peak = peak_rss_mib(server.proc.pid)
    print(f"server peak RSS after a 1 GiB PUT and GET: {peak:.0f} MiB")
    assert peak < 128, f"server peak RSS {peak:.0f} MiB for a 1 GiB object"


def test_damage_found_by_a_read_is_healed_in_the_background(server):
    s3 = server.client()
    s3.create_bucket(Bucket="selfheal")
    body = data(9, 3 * MIB)
    s3.put_object(Bucket="selfheal", Key="k", Body=body)
    shards = []
    for d in server.drives:
        for root, _, files in os.walk(os.path.join(d, "data")):
            shards += [os.path.join(root, f) for f in files]
    assert len(shards) == 4
    # Reads touch data shards only: damage data shard 0 (the footer, the last
    # 32 bytes, holds the shard index at byte 6; see docs/format.md).
    victim = [p for p in shards if open(p, "rb").read()[-32:][6] == 0][0]
    original = open(victim, "rb").read()
    damaged = bytearray(original)
    damaged[100] ^= 0xFF
    open(victim, "wb").write(damaged)
    assert s3.get_object(Bucket="selfheal", Key="k")["Body"].read() == body
    deadline = time.time() + 15
    while time.time() < deadline and open(victim, "rb").read() != original:
        time.sleep(0.2)
    assert open(victim, "rb").read() == original, "the shard was not rebuilt after the read found it corrupt"
    m = requests.get(f"{server.admin}/metrics").text
    assert "tarn_shards_reconstructed_total 0" not in m


def test_tarn_bench_compares_endpoints_in_alternation(server):
    """`tarn bench s3 --compare` runs the same workload against each endpoint in
    alternating rounds, with per-endpoint credentials in the URL, and reports
    every figure as a ratio to the first endpoint."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    other = server.endpoint.replace("http://", f"http://{ACCESS_KEY}:{SECRET_KEY}@")
    args = [BIN, "bench", "s3", "--endpoint", server.endpoint, "--compare", other, "--rounds", "3",
            "--op", "get", "--size", "64KiB", "--concurrency", "2", "--count", "30", "--objects", "4",
            "--verify", "--bucket", "cmpbk"]
    r = subprocess.run(args + ["--json"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    result = json.loads(r.stdout)
    assert result["rounds"] == 3
    # Endpoints are named by their access key, never with the secret.
    shown = server.endpoint.replace("http://", f"http://{ACCESS_KEY}@")
    assert [e["endpoint"] for e in result["endpoints"]] == [server.endpoint, shown]
    for e in result["endpoints"]:
        assert e["ops"] == 30 and e["errors"] == {} and e["verify_failures"] == 0
    (ratios,) = result["ratios_to_first"]
    assert set(ratios) == {"ops_per_sec", "mb_per_sec", "p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms",
                           "client_cpu_s_per_gb", "server_cpu_s_per_gb"}
    # CPU figures are 0 where not measured (no --server-pid) or too small
    # for the clock's ticks in so short a run.
    assert all(v > 0 for k, v in ratios.items() if "cpu" not in k), ratios
    assert all(v >= 0 for v in ratios.values()), ratios
    # The text report and its progress lines never show the secret.
    r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr + r.stdout
    assert f"{shown} / {server.endpoint}: ops_per_sec" in r.stdout
    assert SECRET_KEY not in r.stdout + r.stderr


@pytest.mark.parametrize("op", ["put", "get", "mixed", "list", "multipart"])
def test_tarn_bench_sink_measures_the_bench_itself(op):
    """`--endpoint sink` runs every workload against an in-process responder
    that stores nothing (the bench's own ceiling), reads verified."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
    r = subprocess.run(
        [BIN, "bench", "s3", "--endpoint", "sink", "--op", op, "--size", "6MiB" if op == "multipart" else "256KiB",
         "--part-size", "5MiB", "--concurrency", "4", "--count", "50", "--objects", "8", "--verify", "--json"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    result = json.loads(r.stdout)
    assert result["ops"] == 50 and result["errors"] == {} and result["verify_failures"] == 0
    assert result["ops_per_sec"] > 0
    if op != "list":
        assert result["mb_per_sec"] > 0


def test_tarn_bench_multipart_uploads_whole_objects(server):
    """`tarn bench s3 --op multipart`: each operation is a whole multipart
    upload (create, parts, complete) that leaves a real multipart object."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    r = subprocess.run(
        [BIN, "bench", "s3", "--endpoint", server.endpoint, "--op", "multipart", "--size", "11MiB",
         "--part-size", "5MiB", "--concurrency", "2", "--count", "4", "--objects", "2", "--json",
         "--bucket", "mpbk", "--keep"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    result = json.loads(r.stdout)
    assert result["ops"] == 4 and result["errors"] == {}
    s3 = server.client()
    for key in ["obj-0", "obj-1"]:
        head = s3.head_object(Bucket="mpbk", Key=key)
        assert head["ContentLength"] == 11 << 20
        assert head["ETag"].endswith('-3"'), head["ETag"]
    assert s3.list_multipart_uploads(Bucket="mpbk").get("Uploads", []) == []
    # A part size under S3's minimum is refused before anything is sent.
    r = subprocess.run(
        [BIN, "bench", "s3", "--endpoint", server.endpoint, "--op", "multipart", "--size", "11MiB",
         "--part-size", "1MiB", "--count", "1"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert r.returncode != 0 and "--part-size" in r.stderr
    # So is one that does not parse, rather than silently replaced.
    r = subprocess.run(
        [BIN, "bench", "s3", "--endpoint", server.endpoint, "--op", "multipart", "--part-size", "5XiB", "--count", "1"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert r.returncode != 0 and "size unit" in r.stderr


@pytest.mark.parametrize("op,size", [("put", "64KiB"), ("get", "1MiB"), ("mixed", "300KiB"), ("list", "4KiB")])
def test_tarn_bench_against_a_live_server(server, op, size):
    """`tarn bench s3` runs against the server, signs every request correctly,
    verifies every byte it reads, and cleans up after itself."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    r = subprocess.run(
        [BIN, "bench", "s3", "--endpoint", server.endpoint, "--op", op, "--size", size, "--concurrency", "4", "--count", "60", "--objects", "8", "--verify", "--json", "--bucket", "benchbk"],
        capture_output=True, text=True, env=env, timeout=120,
    )
    assert r.returncode == 0, r.stderr + r.stdout
    result = json.loads(r.stdout)
    assert result["ops"] == 60 and result["errors"] == {} and result["verify_failures"] == 0
    assert result["latency_ms"]["p50"] > 0
    with pytest.raises(botocore.exceptions.ClientError):
        server.client().head_bucket(Bucket="benchbk")
