"""etcd is not a root of trust (issue 40, items 8 and 9).

Before: a process that could reach etcd rewrote a bucket's policy record and
read a private object anonymously, and a node started with the wrong cluster
secret registered itself and stayed listed forever. Now every value a node
writes to etcd is sealed (an HMAC under the cluster secret, over the key and
the value: docs/format.md, "etcd"), every value read must open, and one that
does not is refused and logged, never applied; a node whose secret does not
open the cluster's records stops before writing anything.
"""

import base64
import json
import os
import shutil
import time
import urllib.request

import pytest
import requests

from clusterproc import Node, form, stop_all
from pki import make_ca, make_cert


def etcd_call(etcd, path, body):
    req = urllib.request.Request(etcd.url + path, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.load(r)


def b64(b):
    return base64.b64encode(b if isinstance(b, bytes) else b.encode()).decode()


def etcd_prefix(etcd, prefix):
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    got = etcd_call(etcd, "/v3/kv/range", {"key": b64(prefix), "range_end": b64(end)})
    return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")) for kv in got.get("kvs", [])}


def etcd_put(etcd, key, value):
    etcd_call(etcd, "/v3/kv/put", {"key": b64(key), "value": b64(value)})


@pytest.fixture
def cluster(tmp_path):
    etcd, nodes = form(str(tmp_path), count=2)
    try:
        yield etcd, nodes
    finally:
        stop_all(etcd, nodes)


def anonymous_get(node, path):
    return requests.get(f"{node.endpoint}{path}", timeout=10)


def test_records_written_without_the_secret_are_refused(cluster):
    etcd, nodes = cluster
    s3 = nodes[0].client()
    s3.create_bucket(Bucket="priv")
    s3.put_object(Bucket="priv", Key="secret", Body=b"private bytes")
    s3.create_bucket(Bucket="pub")
    s3.put_object(Bucket="pub", Key="open", Body=b"public bytes")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
                                                      "Resource": "arn:aws:s3:::pub/*"}]}  # fmt: skip
    s3.delete_public_access_block(Bucket="pub")
    s3.put_bucket_policy(Bucket="pub", Policy=json.dumps(policy))
    time.sleep(1)
    for n in nodes:
        assert anonymous_get(n, "/pub/open").content == b"public bytes"
        assert anonymous_get(n, "/priv/secret").status_code == 403
    docs = etcd_prefix(etcd, "/tarn/test/sys/")
    pub_key = next(k for k in docs if k.endswith("/pub.json"))
    priv_key = next(k for k in docs if k.endswith("/priv.json"))
    stored = docs[pub_key]
    assert stored[:4] == b"TSL1", stored[:40]
    plain = stored[36:]
    assert b"pub/*" in plain
    # Every value under the cluster's root is sealed.
    everything = etcd_prefix(etcd, "/tarn/test/")
    assert everything and all(v[:4] == b"TSL1" for v in everything.values()), \
        [k for k, v in everything.items() if v[:4] != b"TSL1"]  # fmt: skip
    attacks = {
        # What the outside attack did: a record of its own, unsealed.
        "unsealed": plain.replace(b"pub/*", b"priv/*"),
        # Another key's sealed record moved here.
        "moved": stored,
        # A sealed record with its value changed.
        "changed": stored[:36] + plain.replace(b"pub/*", b"priv/*"),
    }
    for name, forged in attacks.items():
        etcd_put(etcd, priv_key, forged)
        time.sleep(1.5)
        for n in nodes:
            r = anonymous_get(n, "/priv/secret")
            assert r.status_code == 403 and b"private" not in r.content, (name, n.i, r.status_code)
    # Each node said so.
    for n in nodes:
        logs = "".join(open(p).read() for p in n.logs)
        assert "etcd record refused" in logs, n.i
    # The owner still works, and a real policy change is applied.
    assert s3.get_object(Bucket="priv", Key="secret")["Body"].read() == b"private bytes"
    s3.delete_public_access_block(Bucket="priv")
    s3.put_bucket_policy(Bucket="priv", Policy=json.dumps({**policy, "Statement": [
        {**policy["Statement"][0], "Resource": "arn:aws:s3:::priv/*"}]}))  # fmt: skip
    time.sleep(1)
    assert anonymous_get(nodes[1], "/priv/secret").content == b"private bytes"


def test_a_node_with_the_wrong_secret_does_not_register(cluster, tmp_path):
    etcd, nodes = cluster
    before = set(etcd_prefix(etcd, "/tarn/test/"))
    with pytest.raises(RuntimeError) as e:
        nodes.append(Node(str(tmp_path), 3, etcd.url, secret="not-the-cluster-secret-at-all"))
    assert "secret" in str(e.value), e.value
    time.sleep(1)
    after = set(etcd_prefix(etcd, "/tarn/test/"))
    assert not any("n3" in k for k in after), sorted(after - before)
    out = nodes[0].admin_cmd("cluster", "status").stdout
    assert "n3" not in out, out


def enable_etcd_auth(etcd):
    """etcd's users, as an operator sets them up: root, and a user `tarn`
    that may read and write only under /tarn/."""
    def call(path, body, token=None):
        req = urllib.request.Request(etcd.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": token} if token else {})  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)

    call("/v3/auth/user/add", {"name": "root", "password": "root-password"})
    call("/v3/auth/role/add", {"name": "root"})
    call("/v3/auth/user/grant", {"user": "root", "role": "root"})
    call("/v3/auth/user/add", {"name": "tarn", "password": "tarn-password"})
    call("/v3/auth/role/add", {"name": "tarn"})
    call("/v3/auth/role/grant", {"name": "tarn", "perm": {"permType": "READWRITE", "key": b64("/tarn/"),
                                                          "range_end": b64("/tarn0")}})  # fmt: skip
    call("/v3/auth/user/grant", {"user": "tarn", "role": "tarn"})
    call("/v3/auth/enable", {})


def test_nodes_authenticate_to_etcd_as_a_user(tmp_path, monkeypatch):
    from clusterproc import Etcd, init_and_serve

    etcd = Etcd(str(tmp_path))
    nodes = []
    try:
        enable_etcd_auth(etcd)
        # Anyone without a user is refused by etcd now.
        with pytest.raises(urllib.error.HTTPError):
            etcd_prefix(etcd, "/tarn/")
        # A node without the user, or with a wrong password, says why and stops.
        with pytest.raises(RuntimeError) as e:
            nodes.append(Node(str(tmp_path), 1, etcd.url))
        assert "etcd refused" in str(e.value), e.value
        monkeypatch.setenv("TARN_ETCD_PASSWORD", "wrong-password")
        with pytest.raises(RuntimeError) as e:
            nodes.append(Node(str(tmp_path), 1, etcd.url, extra=["--etcd-user", "tarn"]))
        assert "etcd refused user" in str(e.value), e.value
        monkeypatch.setenv("TARN_ETCD_PASSWORD", "tarn-password")
        nodes = [Node(str(tmp_path), i, etcd.url, extra=["--etcd-user", "tarn"]) for i in (1, 2)]
        init_and_serve(nodes, 2, 2)
        s3 = nodes[0].client()
        s3.create_bucket(Bucket="authed")
        s3.put_object(Bucket="authed", Key="k", Body=b"v")
        # The other node follows the catalog through its own (watched) view.
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                assert nodes[1].client().get_object(Bucket="authed", Key="k")["Body"].read() == b"v"
                break
            except Exception:
                time.sleep(0.2)
        else:
            raise AssertionError("node 2 never served the object")
        out = nodes[0].admin_cmd("cluster", "status").stdout
        assert "n1" in out and "n2" in out, out
    finally:
        stop_all(etcd, nodes)


def test_a_revoked_key_works_nowhere_once_the_revoke_returns(tmp_path):
    # Before: a revoked key worked once more on another node 11 ms after the
    # admin call returned (each node learned of it from its etcd watch).
    import signal

    import boto3
    import botocore.config
    import botocore.exceptions

    etcd, nodes = form(str(tmp_path), count=3, data_shards=2, parity_shards=1)
    try:
        nodes[0].client().create_bucket(Bucket="rev")

        def client(n, key):
            return boto3.client("s3", endpoint_url=n.endpoint, aws_access_key_id=key["access_key"],
                                aws_secret_access_key=key["secret_key"], region_name="us-east-1",
                                config=botocore.config.Config(retries={"max_attempts": 1}))  # fmt: skip

        def works(c):
            try:
                c.list_buckets()
                return True
            except botocore.exceptions.ClientError as e:
                assert e.response["Error"]["Code"] == "InvalidAccessKeyId", e.response
                return False

        for round in range(5):
            key = json.loads(nodes[0].admin_cmd("user", "add", f"u{round}", "--json").stdout)
            clients = [client(n, key) for n in nodes]
            # The new key works on every node once `user add` returns.
            assert all(works(c) for c in clients), round
            r = nodes[round % 3].admin_cmd("user", "key", "remove", f"u{round}", key["access_key"])
            assert "warning" not in r.stderr, r.stderr
            # ...and the revoked one on none, at once.
            assert not any(works(c) for c in clients), round
        # A node that cannot answer does not hold the call up for long, and
        # is named.
        key = json.loads(nodes[0].admin_cmd("user", "add", "late", "--json").stdout)
        nodes[2].signal(signal.SIGSTOP)
        try:
            t = time.time()
            r = nodes[0].admin_cmd("user", "key", "remove", "late", key["access_key"])
            assert time.time() - t < 10
            assert "not confirmed by node(s) n3" in r.stderr, r.stderr
            assert not works(client(nodes[1], key))
        finally:
            nodes[2].signal(signal.SIGCONT)
        # Once back, its watch applies it.
        deadline = time.time() + 10
        while works(client(nodes[2], key)):
            assert time.time() < deadline, "n3 never applied the revoke"
            time.sleep(0.1)
    finally:
        stop_all(etcd, nodes)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make test certificates")
def test_nodes_reach_etcd_over_tls_with_client_certificates(tmp_path):
    """etcd with TLS that checks clients' certificates (--client-cert-auth),
    as production runs it: nodes with the CA and a certificate of their own
    form a cluster and serve; a node without the CA, without a certificate,
    with one from another CA, or trusting another CA is refused at start
    with the reason, and nothing reaches etcd in the clear."""
    from clusterproc import Etcd, init_and_serve

    d = str(tmp_path / "pki")
    os.makedirs(d)
    make_ca(d, "etcd")
    make_ca(d, "other")
    make_cert(d, "etcd", "server", "etcd", san="IP:127.0.0.1,DNS:localhost")
    make_cert(d, "etcd", "node", "tarn-node")
    make_cert(d, "etcd", "node-rsa", "tarn-node", rsa=True)
    make_cert(d, "other", "stranger", "tarn-node")
    pki = lambda name: os.path.join(d, name)  # noqa: E731
    etcd = Etcd(str(tmp_path), tls={"cert": pki("server.pem"), "key": pki("server.key"),
                                     "ca": pki("etcd-ca.pem")})
    assert etcd.url.startswith("https://")
    nodes = []

    def refused(extra, *why):
        with pytest.raises(RuntimeError) as e:
            nodes.append(Node(str(tmp_path), 9, etcd.url, extra=extra))
        for w in why:
            assert w in str(e.value), e.value

    try:
        # Plain HTTP to etcd's TLS port gets nothing.
        with pytest.raises(Exception):
            urllib.request.urlopen(etcd.url.replace("https", "http") + "/version", timeout=5).read()
        refused([], "--etcd-ca")
        refused(["--etcd-ca", pki("etcd-ca.pem"), "--etcd-cert", pki("node.pem")], "--etcd-key")
        # etcd wants a client certificate: without one, or with one from a
        # CA it does not trust, it hangs up.
        refused(["--etcd-ca", pki("etcd-ca.pem")], "etcd unreachable", "BadCertificate")
        refused(["--etcd-ca", pki("etcd-ca.pem"), "--etcd-cert", pki("stranger.pem"),
                 "--etcd-key", pki("stranger.key")], "etcd unreachable", "BadCertificate")
        # A node that trusts another CA refuses etcd's certificate.
        refused(["--etcd-ca", pki("other-ca.pem"), "--etcd-cert", pki("node.pem"),
                 "--etcd-key", pki("node.key")], "invalid peer certificate")
        # A key that is not the certificate's is said at start.
        refused(["--etcd-ca", pki("etcd-ca.pem"), "--etcd-cert", pki("node.pem"),
                 "--etcd-key", pki("stranger.key")], "--etcd-key")

        good = lambda name: ["--etcd-ca", pki("etcd-ca.pem"), "--etcd-cert", pki(f"{name}.pem"),  # noqa: E731
                             "--etcd-key", pki(f"{name}.key")]
        nodes = [Node(str(tmp_path), 1, etcd.url, extra=good("node")),
                 Node(str(tmp_path), 2, etcd.url, extra=good("node-rsa"))]
        init_and_serve(nodes, 2, 2)
        s3 = nodes[0].client()
        s3.create_bucket(Bucket="tls")
        s3.put_object(Bucket="tls", Key="k", Body=b"over tls")
        # Node 2 learns of the bucket through its etcd watch (over TLS too).
        deadline = time.time() + 10
        while True:
            try:
                assert nodes[1].client().get_object(Bucket="tls", Key="k")["Body"].read() == b"over tls"
                break
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(0.2)
        out = nodes[0].admin_cmd("cluster", "status").stdout
        assert "n1" in out and "n2" in out, out
        # A restarted node comes back over TLS.
        nodes[1].stop()
        nodes[1].start()
        nodes[1].wait_serving()
        assert nodes[1].client().get_object(Bucket="tls", Key="k")["Body"].read() == b"over tls"
        for n in nodes:
            assert not n.errors(), n.errors()
    finally:
        stop_all(etcd, nodes)
