"""The KV trust boundary from Python and the binary (issue 12, item 1).

Before: any process could use any namespace with no credentials, the KV
listener started on a non-loopback address with the built-in credentials
(also when they were written out explicitly), and connections stayed open
forever. The Rust tests (crates/tarn-client/tests/kv.rs) attack the shared
memory itself; these check what users see: credentials from arguments and
the environment, tenants from the configuration file, permission errors,
the loopback rule and idle timeouts.
"""

import os
import subprocess
import time

import pytest

import tarn
import tarn.kv as kv
from tarnproc import BIN

CONFIG = """
[kv]
enabled = true
listen = "127.0.0.1:0"
memory = "64MiB"
value_max = "1MiB"
idle_timeout_secs = 1

[[kv.tenants]]
name = "alice"
access_key = "alice-key"
secret_key = "alice-secret-0123"
namespaces = ["alice/"]
memory = "32MiB"

[[kv.tenants]]
name = "bob"
access_key = "bob-key"
secret_key = "bob-secret-0123"
namespaces = ["bob/", "shared/"]
memory = "32MiB"
"""


@pytest.fixture
def tenants_server(make_server, tmp_path):
    cfg = tmp_path / "tarn.toml"
    cfg.write_text(CONFIG)
    return make_server(drives=1, extra_args=["--config", str(cfg), "--kv-listen", "127.0.0.1:0"], name="kvsec")


def alice(server, namespace="alice/m", transport="shm", **kw):
    return kv.Client(server.kv_endpoint, namespace, transport=transport, access_key="alice-key",
                     secret_key="alice-secret-0123", **kw)  # fmt: skip


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_tenants_from_the_configuration_are_kept_apart(tenants_server, transport):
    a = alice(tenants_server, transport=transport)
    assert a.transport == transport
    ks = [kv.key("block", i) for i in range(3)]
    assert a.put_from(ks, [b"alice" * 100] * 3) == [kv.Status.OK] * 3
    # Bob, same key, his own namespace: nothing of alice's.
    b = kv.Client(tenants_server.kv_endpoint, "bob/m", transport=transport, access_key="bob-key",
                  secret_key="bob-secret-0123")  # fmt: skip
    assert b.exists(ks) == [False] * 3
    # Bob in alice's namespace: a permission error, per call.
    b_in_alice = kv.Client(tenants_server.kv_endpoint, "alice/m", transport=transport, access_key="bob-key",
                           secret_key="bob-secret-0123")  # fmt: skip
    for call in (
        lambda: b_in_alice.exists(ks),
        lambda: b_in_alice.get_into(ks[:1], [bytearray(500)]),
        lambda: b_in_alice.put_from(ks[:1], [b"forged" * 10]),
        lambda: b_in_alice.delete(ks[:1]),
    ):
        with pytest.raises(kv.KvPermissionError) as e:
            call()
        assert isinstance(e.value, PermissionError)
        assert isinstance(e.value, tarn.KvPermissionError)
        assert "not granted" in str(e.value) or "denied" in str(e.value).lower()
    # Alice's blocks are intact.
    bufs = [bytearray(500) for _ in ks]
    assert a.get_into(ks, bufs) == [500] * 3
    assert all(bytes(x) == b"alice" * 100 for x in bufs)
    # The default tenant (the server's own credentials) is granted everything
    # but has blocks of its own.
    d = kv.Client(tenants_server.kv_endpoint, "alice/m", transport=transport)
    assert d.exists(ks) == [False] * 3


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_wrong_credentials_are_a_permission_error(tenants_server, transport):
    for access, secret in [("alice-key", "not-the-secret"), ("nobody", "whatever-secret")]:
        with pytest.raises(kv.KvPermissionError):
            c = kv.Client(tenants_server.kv_endpoint, "alice/m", transport=transport, access_key=access,
                          secret_key=secret)  # fmt: skip
            c.exists([kv.key("x", 0)])
    # Half a credential is a usage error, not a silent fallback.
    with pytest.raises(ValueError):
        kv.Client(tenants_server.kv_endpoint, "alice/m", access_key="alice-key")


def test_credentials_from_the_environment(tenants_server, monkeypatch):
    monkeypatch.setenv("TARN_ACCESS_KEY", "bob-key")
    monkeypatch.setenv("TARN_SECRET_KEY", "bob-secret-0123")
    c = kv.Client(tenants_server.kv_endpoint, "shared/x")
    c.put_from([kv.key("env", 1)], [b"from the environment"])
    with pytest.raises(kv.KvPermissionError):
        kv.Client(tenants_server.kv_endpoint, "alice/x").exists([kv.key("env", 1)])
    # Arguments win over the environment.
    assert alice(tenants_server).exists([kv.key("env", 1)]) == [False]


def test_idle_connections_are_closed_and_clients_reconnect(tenants_server):
    # idle_timeout_secs = 1 in the configuration.
    for transport in ("shm", "tcp"):
        c = alice(tenants_server, transport=transport)
        k = [kv.key("idle", 0)]
        c.put_from(k, [b"v" * 100])
        time.sleep(2.5)
        # The server closed the pooled connection meanwhile; the client finds
        # out and, at the latest on the next call, works again.
        try:
            ok = c.exists(k)
        except kv.KvConnectionError:
            ok = c.exists(k)
        assert ok == [True]


def run_server(args, env_extra=None, cwd=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TARN_")}
    env.update(env_extra or {})
    return subprocess.run([BIN, "server", *args], capture_output=True, text=True, timeout=30, env=env, cwd=cwd)


def test_kv_off_loopback_needs_explicit_credentials(tmp_path):
    base = ["--listen", "127.0.0.1:0", "--admin-listen", "127.0.0.1:0", "--drive", str(tmp_path / "d"),
            "--kv", "--kv-listen", "0.0.0.0:0", "--kv-memory", "16MiB", "--allow-plain-http"]  # fmt: skip
    # Before: it started, serving every namespace to anyone on the network
    # with credentials printed in the README.
    r = run_server(base)
    assert r.returncode != 0 and "default credentials" in r.stderr, r.stderr
    # The same credentials written out explicitly are refused too.
    r = run_server(base, {"TARN_ACCESS_KEY": "tarnadmin", "TARN_SECRET_KEY": "tarnadmin-secret"})
    assert r.returncode != 0 and "default credentials" in r.stderr, r.stderr
    # The same with tenants configured: the server's own credentials are
    # still the built-in ones.
    cfg = tmp_path / "t.toml"
    cfg.write_text(CONFIG)
    r = run_server(["--config", str(cfg), *base])
    assert r.returncode != 0 and "default credentials" in r.stderr, r.stderr


def test_kv_off_loopback_with_credentials_of_its_own(make_server):
    creds = {"TARN_ACCESS_KEY": "site-key", "TARN_SECRET_KEY": "site-secret-0123456789"}
    s = make_server(drives=1, extra_args=["--kv", "--kv-listen", "0.0.0.0:0", "--kv-memory", "16MiB", "--allow-plain-http"], env=creds,
                    name="open")  # fmt: skip
    port = s.kv_endpoint.rsplit(":", 1)[1]
    c = kv.Client(f"127.0.0.1:{port}", "ns", transport="tcp", access_key="site-key",
                  secret_key="site-secret-0123456789")  # fmt: skip
    c.put_from([kv.key("o", 1)], [b"open"])
    assert c.exists([kv.key("o", 1)]) == [True]
    with pytest.raises(kv.KvPermissionError):
        kv.Client(f"127.0.0.1:{port}", "ns", transport="tcp").exists([kv.key("o", 1)])
