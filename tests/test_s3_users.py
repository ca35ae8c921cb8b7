"""Several users (issue 13): `tarn admin user …` and the admin API make users
and access keys that S3 clients sign with; a revoked key stops at once; users
survive a restart; secrets are never stored or logged in the clear."""

import json
import os
import subprocess

import botocore.exceptions
import pytest
import requests

from tarnproc import BIN, SECRET_KEY, add_user, admin


def client(server, key):
    return server.client(key)


def code(e):
    return e.value.response["Error"]["Code"]


def test_users_sign_with_their_own_keys_and_revoked_keys_stop(server, s3):
    """Bug: one access key for everyone; no way to give a service its own
    key or take one back."""
    alice = add_user(server, "alice")
    assert alice["user"] == "alice"
    assert alice["access_key"].startswith("TK") and len(alice["access_key"]) == 20
    assert len(alice["secret_key"]) == 40
    a = client(server, alice)
    a.create_bucket(Bucket="alice-data")
    a.put_object(Bucket="alice-data", Key="k", Body=b"from alice")
    assert a.get_object(Bucket="alice-data", Key="k")["Body"].read() == b"from alice"
    # A second key works alongside the first.
    second = json.loads(admin(server, "user", "key", "add", "alice", "--json").stdout)
    assert second["user"] == "alice" and second["access_key"] != alice["access_key"]
    a2 = client(server, second)
    assert a2.get_object(Bucket="alice-data", Key="k")["Body"].read() == b"from alice"
    listed = json.loads(admin(server, "user", "list", "--json").stdout)["users"]
    assert [(u["name"], sorted(u["access_keys"])) for u in listed] == [
        ("alice", sorted([alice["access_key"], second["access_key"]]))
    ]
    assert "secret" not in json.dumps(listed)
    # A wrong secret for a real key is a signature error.
    forged = dict(alice, secret_key="x" * 40)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        client(server, forged).list_buckets()
    assert code(e) == "SignatureDoesNotMatch"
    # Revoked: the very next request fails; the other key still works.
    admin(server, "user", "key", "remove", "alice", alice["access_key"])
    with pytest.raises(botocore.exceptions.ClientError) as e:
        a.list_buckets()
    assert code(e) == "InvalidAccessKeyId"
    assert a2.get_object(Bucket="alice-data", Key="k")["Body"].read() == b"from alice"
    # Removing the user revokes every key it has.
    admin(server, "user", "remove", "alice")
    with pytest.raises(botocore.exceptions.ClientError) as e:
        a2.list_buckets()
    assert code(e) == "InvalidAccessKeyId"
    # The bootstrap credentials are untouched.
    assert s3.get_object(Bucket="alice-data", Key="k")["Body"].read() == b"from alice"


def test_admin_refusals(server):
    """Bad input gets a clear error and changes nothing."""
    add_user(server, "bob")
    r = admin(server, "user", "add", "bob", check=False)
    assert r.returncode != 0 and "already exists" in r.stderr
    for bad in ["root", "a/b", "x" * 65]:
        r = admin(server, "user", "add", bad, check=False)
        assert r.returncode != 0, bad
    r = admin(server, "user", "remove", "nobody", check=False)
    assert r.returncode != 0 and "no such user" in r.stderr
    r = admin(server, "user", "key", "remove", "bob", "TKNOTAKEY", check=False)
    assert r.returncode != 0 and "no access key" in r.stderr
    # The admin API wants the bearer token.
    r = requests.post(f"{server.admin}/admin/users/eve")
    assert r.status_code == 401
    r = requests.post(f"{server.admin}/admin/users/eve", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401
    r = subprocess.run(
        [BIN, "admin", "--endpoint", server.admin, "--token", "wrong", "user", "list"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0 and "401" in r.stderr
    names = [u["name"] for u in json.loads(admin(server, "user", "list", "--json").stdout)["users"]]
    assert names == ["bob"]


def test_users_survive_a_restart_and_secrets_are_encrypted(server):
    """Users are kept on the drives, and their secrets never in the clear:
    not in the stored records and not in the server's log."""
    carol = add_user(server, "carol")
    c = client(server, carol)
    c.create_bucket(Bucket="carol-b")
    server.stop()
    secret = carol["secret_key"].encode()
    for d in server.drives:
        for root, _, files in os.walk(d):
            for f in files:
                with open(os.path.join(root, f), "rb") as fh:
                    assert secret not in fh.read(), f"secret in clear in {os.path.join(root, f)}"
    for log in server.logs:
        assert carol["secret_key"] not in open(log).read()
    server.start()
    c = client(server, carol)
    assert "carol-b" in [b["Name"] for b in c.list_buckets()["Buckets"]]
    # The system bucket holding users is not an S3 bucket.
    assert all(not b["Name"].startswith(".") for b in c.list_buckets()["Buckets"])


def ROOT_ENV(secret):
    return {"TARN_ACCESS_KEY": "root-ak", "TARN_SECRET_KEY": secret}


def test_users_with_a_changed_root_secret_fail_clearly(make_server):
    """The secrets are encrypted under the root secret key: a server started
    with another one cannot read them and says so, instead of serving with
    users silently missing."""
    srv = make_server(env=ROOT_ENV("first-root-secret-key"))
    r = subprocess.run(
        [BIN, "admin", "--endpoint", srv.admin, "--token", "first-root-secret-key", "user", "add", "dave", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    srv.stop()
    srv.env = ROOT_ENV("another-root-secret-key")
    with pytest.raises(RuntimeError) as e:
        srv.start()
    assert "does not decrypt" in str(e.value)
    srv.env = ROOT_ENV("first-root-secret-key")
    srv.start()
