"""TLS on every listener (issue 43): S3 and admin with real clients (the
aws CLI, boto3 and `tarn admin` given a CA bundle, the console's cookie
`Secure`), `aws:SecureTransport` true over TLS, certificates read again
when their files change, plain HTTP beyond loopback only when asked for,
and a cluster whose nodes talk RPC over TLS."""

import functools
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys

import botocore.exceptions
import pytest
import requests

from pki import make_ca, make_cert
from tarnproc import ACCESS_KEY, BIN, SECRET_KEY, add_user, admin, metric, wait_for

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make test certificates")

SAN = "IP:127.0.0.1,IP:127.0.0.2,IP:127.0.0.3,IP:127.0.0.4,IP:127.0.0.5,DNS:localhost"
CREDS = {"TARN_ACCESS_KEY": "tls-admin", "TARN_SECRET_KEY": "tls-admin-secret-0123456789"}


@pytest.fixture
def pki(tmp_path):
    d = str(tmp_path / "pki")
    os.makedirs(d)
    make_ca(d, "tarn")
    make_ca(d, "other")
    make_cert(d, "tarn", "server", "tarn", san=SAN)
    make_cert(d, "tarn", "renewed", "tarn renewed", san=SAN)
    return lambda name: os.path.join(d, name)


def tls_args(pki, name="server"):
    return ["--tls-cert", pki(f"{name}.pem"), "--tls-key", pki(f"{name}.key")]


def host_port(url):
    hp = url.split("://", 1)[1]
    host, port = hp.rsplit(":", 1)
    return host, int(port)


def served_cert(url, ca):
    """The certificate (DER) a new TLS connection to `url` is given."""
    ctx = ssl.create_default_context(cafile=ca)
    host, port = host_port(url)
    with socket.create_connection((host, port), timeout=5) as s:
        with ctx.wrap_socket(s, server_hostname=host) as t:
            return t.getpeercert(binary_form=True)


def pem_der(path):
    with open(path) as f:
        return ssl.PEM_cert_to_DER_cert(f.read())


def test_s3_admin_and_console_over_tls_with_real_clients(make_server, pki, tmp_path):
    ca = pki("tarn-ca.pem")
    s = make_server(drives=1, extra_args=tls_args(pki), ca=ca)
    assert s.endpoint.startswith("https://") and s.admin.startswith("https://")

    # boto3 with the CA bundle: its default aws-chunked uploads with CRC
    # trailers, a multipart upload, reads back whole.
    c = s.client()
    c.create_bucket(Bucket="models")
    body = os.urandom(3 << 20) + b"end"
    c.put_object(Bucket="models", Key="w.bin", Body=body)
    assert c.get_object(Bucket="models", Key="w.bin")["Body"].read() == body
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(20 << 20))
    c.upload_file(str(big), "models", "big.bin")
    assert c.get_object(Bucket="models", Key="big.bin")["Body"].read() == big.read_bytes()
    # TLS records are rustls's own buffers: nothing goes from the shard files.
    assert metric(s, "tarn_get_sendfile_bytes_total") == 0
    assert metric(s, "tarn_get_file_view_bytes_total") == 0

    # A client that does not trust the CA is refused by its own checks; one
    # speaking plain HTTP to the TLS port gets no HTTP answer.
    import boto3

    stranger = boto3.client("s3", endpoint_url=s.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            verify=pki("other-ca.pem"))  # fmt: skip
    with pytest.raises(botocore.exceptions.SSLError):
        stranger.list_buckets()
    with pytest.raises(requests.exceptions.ConnectionError):
        requests.get(s.endpoint.replace("https://", "http://"), timeout=5)

    # The aws CLI with AWS_CA_BUNDLE, as docs/operations.md says.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(HOME=str(tmp_path), AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=s.endpoint, AWS_CA_BUNDLE=ca)  # fmt: skip
    aws = os.path.join(os.path.dirname(sys.executable), "aws")

    def cli(*args, ok=True):
        r = subprocess.run([aws, *args], capture_output=True, text=True, timeout=120, env=env)
        assert (r.returncode == 0) == ok, f"aws {args}: {r.stdout}\n{r.stderr}"
        return r

    cli("s3", "cp", str(big), "s3://models/cli.bin")
    assert "cli.bin" in cli("s3", "ls", "s3://models/").stdout
    cli("s3", "cp", "s3://models/cli.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == big.read_bytes()
    env["AWS_CA_BUNDLE"] = pki("other-ca.pem")
    assert "SSL" in cli("s3", "ls", "s3://models/", ok=False).stderr

    # tarn admin with --ca-bundle, human and JSON; without it the system's
    # roots do not know the test CA.
    st = json.loads(admin(s, "status", "--json").stdout)
    assert st["drives"]["online"] == 1, st
    assert "online" in admin(s, "drives").stdout
    r = subprocess.run([BIN, "admin", "--endpoint", s.admin, "--token", SECRET_KEY, "status"],
                       capture_output=True, text=True, timeout=30)  # fmt: skip
    assert r.returncode != 0 and "certificate" in r.stderr.lower(), r.stderr
    assert metric(s, "tarn_uptime_seconds") >= 0

    # The console: its session cookie is Secure over TLS, and its S3 calls
    # reach the node's own TLS listener.
    web = requests.Session()
    # Per request: requests lets REQUESTS_CA_BUNDLE override a session's.
    web.request = functools.partial(web.request, verify=ca)
    r = web.post(s.admin + "/console/login", json={"access_key": ACCESS_KEY, "secret_key": SECRET_KEY}, timeout=10)
    assert r.status_code == 200, r.text
    cookie = r.headers["Set-Cookie"]
    assert "; Secure" in cookie and "HttpOnly" in cookie, cookie
    r = web.get(s.admin + "/console/api/s3/models?list-type=2", timeout=10)
    assert r.status_code == 200 and "<Key>cli.bin</Key>" in r.text, r.text
    # A change with another scheme's Origin is refused (CSRF).
    csrf = web.get(s.admin + "/console/session", timeout=10).json()["csrf"]
    r = web.put(s.admin + "/console/api/s3/from-http-origin", timeout=10,
                headers={"X-Tarn-CSRF": csrf, "Origin": s.admin.replace("https://", "http://")})  # fmt: skip
    assert r.status_code == 403, r.text
    r = web.put(s.admin + "/console/api/s3/from-own-origin", timeout=10,
                headers={"X-Tarn-CSRF": csrf, "Origin": s.admin})  # fmt: skip
    assert r.status_code == 200, r.text


def test_secure_transport_is_true_over_tls(make_server, pki):
    s = make_server(drives=1, extra_args=tls_args(pki), ca=pki("tarn-ca.pem"))
    root = s.client()
    root.create_bucket(Bucket="sec")
    root.put_object(Bucket="sec", Key="doc", Body=b"secret")
    alice = add_user(s, "alice")

    def allow_if(value):
        root.put_bucket_policy(Bucket="sec", Policy=json.dumps({"Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Principal": {"AWS": "alice"}, "Action": "s3:GetObject",
            "Resource": "arn:aws:s3:::sec/*", "Condition": {"Bool": {"aws:SecureTransport": value}}}]}))  # fmt: skip

    allow_if("true")
    assert s.client(alice).get_object(Bucket="sec", Key="doc")["Body"].read() == b"secret"
    allow_if("false")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s.client(alice).get_object(Bucket="sec", Key="doc")
    assert e.value.response["Error"]["Code"] == "AccessDenied"

    # s3:TlsVersion: the version negotiated (1.3 with a current client);
    # AWS's "deny TLS older than 1.2" recipe lets it through, a rule asking
    # for more than the connection has does not.
    def allow_tls_at_least(version):
        root.put_bucket_policy(Bucket="sec", Policy=json.dumps({"Version": "2012-10-17", "Statement": [{
            "Effect": "Allow", "Principal": {"AWS": "alice"}, "Action": "s3:GetObject",
            "Resource": "arn:aws:s3:::sec/*",
            "Condition": {"NumericGreaterThanEquals": {"s3:TlsVersion": version}}}]}))  # fmt: skip

    allow_tls_at_least("1.2")
    assert s.client(alice).get_object(Bucket="sec", Key="doc")["Body"].read() == b"secret"
    allow_tls_at_least("1.4")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s.client(alice).get_object(Bucket="sec", Key="doc")
    assert e.value.response["Error"]["Code"] == "AccessDenied"


def test_certificate_files_are_read_again_and_a_broken_pair_is_not_taken(make_server, pki):
    ca = pki("tarn-ca.pem")
    live = os.path.dirname(pki("x"))
    cert, key = os.path.join(live, "live.pem"), os.path.join(live, "live.key")
    shutil.copy(pki("server.pem"), cert)
    shutil.copy(pki("server.key"), key)
    s = make_server(drives=1, extra_args=["--tls-cert", cert, "--tls-key", key], ca=ca,
                    expected_errors=[r"TLS certificate or key changed into something that cannot be served"])  # fmt: skip
    assert served_cert(s.endpoint, ca) == pem_der(pki("server.pem"))
    assert served_cert(s.admin, ca) == pem_der(pki("server.pem"))
    c = s.client()
    c.create_bucket(Bucket="bkt")
    c.put_object(Bucket="bkt", Key="k", Body=b"before")

    # A renewal (cert-manager, certbot): the new pair is served without a
    # restart, on S3 and admin alike; the server's process is the same.
    pid = s.proc.pid
    shutil.copy(pki("renewed.key"), key + ".tmp")
    shutil.copy(pki("renewed.pem"), cert + ".tmp")
    os.replace(key + ".tmp", key)
    os.replace(cert + ".tmp", cert)
    renewed = pem_der(pki("renewed.pem"))
    wait_for("the renewed certificate served", lambda: served_cert(s.endpoint, ca) == renewed, timeout=15)
    assert served_cert(s.admin, ca) == renewed
    assert s.proc.pid == pid and s.proc.poll() is None
    assert c.get_object(Bucket="bkt", Key="k")["Body"].read() == b"before"

    # A file that changes into garbage (or a key that is not the
    # certificate's) is logged and the renewed pair stays.
    with open(cert, "w") as f:
        f.write("-----BEGIN CERTIFICATE-----\nnot base64\n-----END CERTIFICATE-----\n")
    wait_for("the refusal logged", lambda: any("cannot be served" in open(p).read() for p in s.logs), timeout=15)
    assert served_cert(s.endpoint, ca) == renewed
    shutil.copy(pki("server.pem"), cert)  # server.pem with renewed.key: not a pair
    wait_for("the mismatch logged", lambda: sum(open(p).read().count("cannot be served") for p in s.logs) >= 2,
             timeout=15)  # fmt: skip
    assert served_cert(s.endpoint, ca) == renewed
    assert c.get_object(Bucket="bkt", Key="k")["Body"].read() == b"before"


def run_server(args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TARN_")}
    env.update(env_extra or {})
    return subprocess.run([BIN, "server", *args], capture_output=True, text=True, timeout=30, env=env)


def test_plain_http_beyond_loopback_only_when_asked(make_server, pki, tmp_path):
    base = ["--listen", "127.0.0.1:0", "--drive", str(tmp_path / "d")]
    for open_arg in (["--admin-listen", "0.0.0.0:0"], ["--kv", "--kv-memory", "16MiB", "--kv-listen", "0.0.0.0:0"]):
        r = run_server([*base, *open_arg], CREDS)
        assert r.returncode != 0 and "refusing to serve without TLS" in r.stderr, r.stderr
        assert "--allow-plain-http" in r.stderr
    # Half a TLS configuration, a key that is not the certificate's, and a
    # CA file that holds no certificate are refused at start.
    r = run_server([*base, "--tls-cert", pki("server.pem")], CREDS)
    assert r.returncode != 0 and "go together" in r.stderr, r.stderr
    r = run_server([*base, "--tls-cert", pki("server.pem"), "--tls-key", pki("renewed.key")], CREDS)
    assert r.returncode != 0 and "the certificate's" in r.stderr, r.stderr
    r = run_server([*base, *tls_args(pki), "--tls-ca", pki("server.key")], CREDS)
    assert r.returncode != 0 and "--tls-ca" in r.stderr, r.stderr
    # Asked for: plain beyond loopback; with TLS no flag is needed.
    kv_open = ["--kv", "--kv-memory", "16MiB", "--kv-listen", "0.0.0.0:0"]
    s = make_server(drives=1, extra_args=[*kv_open, "--allow-plain-http"], env=CREDS)
    assert s.kv_endpoint.startswith("0.0.0.0:")
    s = make_server(drives=1, extra_args=[*kv_open, *tls_args(pki)], env=CREDS, ca=pki("tarn-ca.pem"))
    assert s.kv_endpoint.startswith("0.0.0.0:") and s.endpoint.startswith("https://")
    port = int(s.kv_endpoint.rsplit(":", 1)[1])
    ctx = ssl.create_default_context(cafile=pki("tarn-ca.pem"))
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw, server_hostname="127.0.0.1") as t:
            assert t.getpeercert(binary_form=True) == pem_der(pki("server.pem"))


def test_cluster_nodes_talk_over_tls(tmp_path, pki):
    from clusterproc import Etcd, Node, init_and_serve, stop_all

    tls = {"cert": pki("server.pem"), "key": pki("server.key"), "ca": pki("tarn-ca.pem")}
    etcd = Etcd(str(tmp_path))
    nodes = []
    try:
        nodes = [Node(str(tmp_path), i, etcd.url, tls=tls) for i in range(1, 5)]
        init_and_serve(nodes, 2, 2)
        assert all(n.endpoint.startswith("https://") for n in nodes)
        # Erasure-coded over the four nodes: every shard written and read
        # back over their RPC.
        body = os.urandom(5 << 20)
        nodes[0].client().create_bucket(Bucket="tls-cluster")
        nodes[0].client().put_object(Bucket="tls-cluster", Key="k", Body=body)
        assert nodes[2].client().get_object(Bucket="tls-cluster", Key="k")["Body"].read() == body
        # Every drive in sync in a node's view (a fresh cluster's drives show
        # `syncing` for a moment while their sets' logs are read).
        drives = wait_for("every drive online", lambda: (lambda d: all(x["state"] == "online" for x in d) and d)(
            json.loads(nodes[1].admin_cmd("drives", "--json").stdout)), timeout=15)  # fmt: skip
        assert len(drives) == 8, drives
        # The RPC listener speaks TLS with the node's certificate...
        ctx = ssl.create_default_context(cafile=tls["ca"])
        with socket.create_connection((nodes[3].ip, nodes[3].rpc_port), timeout=5) as raw:
            with ctx.wrap_socket(raw, server_hostname=nodes[3].ip) as t:
                assert t.getpeercert(binary_form=True) == pem_der(tls["cert"])
        # ...and a plain connection gets nothing from it.
        with socket.create_connection((nodes[3].ip, nodes[3].rpc_port), timeout=5) as raw:
            raw.settimeout(5)
            raw.sendall(b"TARN" + b"\0" * 60)
            try:
                got = raw.recv(64)
            except (ConnectionResetError, socket.timeout):
                got = b""
            assert not got.startswith(b"TARN"), got
        for n in nodes:
            assert not any(" ERROR " in open(p).read() for p in n.logs), n.i
    finally:
        stop_all(etcd, nodes)


def test_kv_over_tls_from_the_python_client(make_server, pki):
    from tarn import kv

    ca = pki("tarn-ca.pem")
    s = make_server(drives=1, extra_args=["--kv", "--kv-memory", "16MiB", *tls_args(pki)], ca=ca)
    c = kv.Client(s.kv_endpoint, "ns", transport="tcp", ca_bundle=ca)
    assert c.transport == "tcp"
    keys = [kv.key("tls", i) for i in range(4)]
    values = [os.urandom(100_000 + i) for i in range(4)]
    c.put_from(keys, values)
    bufs = [bytearray(200_000) for _ in keys]
    assert c.get_into(keys, bufs) == [len(v) for v in values]
    assert all(bytes(b[: len(v)]) == v for b, v in zip(bufs, values))
    # Same host, "auto": the HELLO goes over TLS, then shared memory.
    local = kv.Client(s.kv_endpoint, "ns", ca_bundle=ca)
    assert local.exists(keys) == [True] * 4
    # A tls:// endpoint trusts the system's roots (SSL_CERT_FILE here).
    old = os.environ.get("SSL_CERT_FILE")
    os.environ["SSL_CERT_FILE"] = ca
    try:
        assert kv.Client("tls://" + s.kv_endpoint, "ns", transport="tcp").exists(keys) == [True] * 4
    finally:
        if old is None:
            del os.environ["SSL_CERT_FILE"]
        else:
            os.environ["SSL_CERT_FILE"] = old
    # Plain TCP to the TLS port, or a CA that did not sign it: refused.
    with pytest.raises(kv.KvConnectionError):
        kv.Client(s.kv_endpoint, "ns", transport="tcp", connect_timeout=3)
    with pytest.raises(kv.KvConnectionError):
        kv.Client(s.kv_endpoint, "ns", transport="tcp", ca_bundle=pki("other-ca.pem"))


@pytest.mark.skipif(shutil.which("s3cmd") is None or shutil.which("rclone") is None,
                    reason="s3cmd and rclone not installed (scripts/test installs them)")
def test_s3cmd_and_rclone_over_tls_with_a_ca(make_server, pki, tmp_path):
    ca = pki("tarn-ca.pem")
    s = make_server(drives=1, extra_args=tls_args(pki), ca=ca)
    host = s.endpoint.removeprefix("https://")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "RCLONE_", "SSL_", "REQUESTS_"))}
    env["HOME"] = str(tmp_path)
    src = tmp_path / "w.bin"
    src.write_bytes(os.urandom(6 << 20))

    def run(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0, f"{cmd}: {r.stdout}\n{r.stderr}"
        return r.stdout

    cfg = tmp_path / "s3cfg"
    cfg.write_text(f"[default]\naccess_key = {ACCESS_KEY}\nsecret_key = {SECRET_KEY}\n"
                   f"host_base = {host}\nhost_bucket = {host}\nuse_https = True\nca_certs_file = {ca}\n")  # fmt: skip
    run(["s3cmd", "-c", str(cfg), "mb", "s3://tools"])
    run(["s3cmd", "-c", str(cfg), "put", str(src), "s3://tools/s3cmd.bin"])
    assert "s3cmd.bin" in run(["s3cmd", "-c", str(cfg), "ls", "s3://tools/"])
    env.update(RCLONE_CONFIG_T_TYPE="s3", RCLONE_CONFIG_T_PROVIDER="Other", RCLONE_CONFIG_T_ENDPOINT=s.endpoint,
               RCLONE_CONFIG_T_ACCESS_KEY_ID=ACCESS_KEY, RCLONE_CONFIG_T_SECRET_ACCESS_KEY=SECRET_KEY,
               RCLONE_CONFIG_T_REGION="us-east-1")  # fmt: skip
    run(["rclone", "--ca-cert", ca, "copyto", str(src), "t:tools/rclone.bin"])
    run(["rclone", "--ca-cert", ca, "copyto", "t:tools/s3cmd.bin", str(tmp_path / "back.bin")])
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    assert s.client().head_object(Bucket="tools", Key="rclone.bin")["ContentLength"] == 6 << 20


def test_tarns_object_client_loader_and_bench_over_tls(make_server, pki, tmp_path, monkeypatch):
    """tarn.objects (and the loader on it) and `tarn bench s3` against an
    https:// endpoint: the certificate checked against the CA bundle (the
    argument or AWS_CA_BUNDLE), another CA refused, never a fallback to
    plain HTTP."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    import tarn.loader
    from tarn import objects
    from tarn.errors import ObjectError

    ca = pki("tarn-ca.pem")
    s = make_server(drives=1, extra_args=tls_args(pki), ca=ca)
    root = s.client()
    root.create_bucket(Bucket="models")
    c = objects.Client(s.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, ca_bundle=ca, chunk_size=1 << 20)
    # Sizes across the client's 1 MiB chunks (parallel ranged GETs).
    for n in [0, 1, (1 << 20) - 1, (3 << 20) + 17]:
        body = os.urandom(n)
        c.put("models", f"blob-{n}", body)
        assert root.get_object(Bucket="models", Key=f"blob-{n}")["Body"].read() == body
        assert c.get("models", f"blob-{n}") == body
    big = os.urandom(40 << 20)
    c.put("models", "big", big)  # a multipart upload
    buf = np.zeros(len(big), dtype=np.uint8)
    c.get_into("models", "big", buf)
    assert buf.tobytes() == big

    # The model loader on that client.
    tensors = {"w": torch.randn(256, 1024), "b": torch.arange(1000, dtype=torch.int64)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    root.upload_file(str(path), "models", "m.safetensors")
    got = tarn.loader.load("s3://models/m.safetensors", client=c)
    assert set(got) == set(tensors) and all(torch.equal(got[k], tensors[k]) for k in tensors)

    # AWS_CA_BUNDLE, as the AWS tools read it.
    monkeypatch.setenv("AWS_CA_BUNDLE", ca)
    assert objects.Client(s.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY).get("models", "blob-1") == \
        c.get("models", "blob-1")
    # A certificate the bundle does not trust: an error, nothing read.
    other = objects.Client(s.endpoint, access_key=ACCESS_KEY, secret_key=SECRET_KEY, ca_bundle=pki("other-ca.pem"),
                           retries=0)
    with pytest.raises(ObjectError) as e:
        other.get("models", "blob-1")
    assert "certificate" in str(e.value).lower() or "unknownissuer" in str(e.value).lower(), e.value
    # The same server asked in plain HTTP: no answer to speak of, an error.
    plain = objects.Client(s.endpoint.replace("https://", "http://"), access_key=ACCESS_KEY, secret_key=SECRET_KEY,
                           retries=0, io_timeout=5.0)
    with pytest.raises(ObjectError):
        plain.get("models", "blob-1")

    # `tarn bench s3` over TLS with --ca-bundle, every byte verified.
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    env.pop("AWS_CA_BUNDLE", None)
    r = subprocess.run([BIN, "bench", "s3", "--endpoint", s.endpoint, "--ca-bundle", ca, "--op", "mixed",
                        "--size", "256KiB", "--count", "40", "--concurrency", "4", "--objects", "8", "--verify",
                        "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert not out["errors"] and out["verify_failures"] == 0 and out["ops"] >= 40, out
    r = subprocess.run([BIN, "bench", "s3", "--endpoint", s.endpoint, "--ca-bundle", pki("other-ca.pem"),
                        "--count", "1"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode != 0
