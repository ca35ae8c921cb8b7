"""`tarn cosi`, the COSI driver (objectstorage.k8s.io v1alpha2), called over
its gRPC API on a Unix socket as the COSI sidecar calls it: real gRPC
(grpcio) with the messages compiled from crates/tarn/src/cosi/cosi.proto
by grpcio-tools. Buckets are made and deleted, access granted and revoked
as Tarn users with bucket-policy statements, every call idempotent, and
what Tarn cannot do refused with the status code the specification names."""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import data
from tarnproc import ACCESS_KEY, BIN, SECRET_KEY, admin

grpc = pytest.importorskip("grpc")
grpc_tools = pytest.importorskip("grpc_tools")

PROTO_DIR = os.path.join(os.path.dirname(__file__), "..", "crates", "tarn", "src", "cosi")
SVC = "sigs.k8s.io.cosi.v1alpha2"


@pytest.fixture(scope="module")
def pb(tmp_path_factory):
    """cosi.proto compiled to Python message classes."""
    from grpc_tools import protoc

    out = tmp_path_factory.mktemp("cosi-pb")
    rc = protoc.main(["protoc", f"-I{PROTO_DIR}", f"--python_out={out}", os.path.join(PROTO_DIR, "cosi.proto")])
    assert rc == 0
    sys.path.insert(0, str(out))
    try:
        import cosi_pb2
    finally:
        sys.path.remove(str(out))
    return cosi_pb2


class Driver:
    def __init__(self, tmp_path, server, pb, extra=()):
        self.sock = str(tmp_path / "cosi.sock")
        env = dict(os.environ, COSI_ENDPOINT=f"unix://{self.sock}", TARN_ACCESS_KEY=ACCESS_KEY,
                   TARN_SECRET_KEY=SECRET_KEY, TARN_LOG="info", NO_COLOR="1")
        self.log = open(tmp_path / "cosi.log", "w")
        self.proc = subprocess.Popen(
            [BIN, "cosi", "--s3-endpoint", server.endpoint, "--admin-endpoint", server.admin,
             "--public-endpoint", "http://tarn.store.svc:9000", *extra],
            stdout=self.log, stderr=self.log, env=env)
        deadline = time.time() + 20
        while not os.path.exists(self.sock):
            assert self.proc.poll() is None, open(tmp_path / "cosi.log").read()
            assert time.time() < deadline, "the driver did not make its socket"
            time.sleep(0.05)
        # As Go's gRPC (the COSI sidecar's) does for a Unix socket:
        # `:authority` localhost. gRPC C-core would send the socket's path,
        # percent-encoded, which HTTP/2 servers that check the authority
        # (hyper's h2) refuse.
        self.channel = grpc.insecure_channel(f"unix://{self.sock}", options=[("grpc.default_authority", "localhost")])
        self.pb = pb

    def call(self, service, method, request, response):
        fn = self.channel.unary_unary(f"/{SVC}.{service}/{method}", request_serializer=request.SerializeToString,
                                      response_deserializer=response.FromString)
        return fn(request, timeout=30)

    def stop(self):
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=20)
        self.log.close()

    # The RPCs, as the sidecar makes them.
    def info(self):
        return self.call("Identity", "DriverGetInfo", self.pb.DriverGetInfoRequest(), self.pb.DriverGetInfoResponse)

    def create(self, name, parameters=None, protocols=(1,)):
        req = self.pb.DriverCreateBucketRequest(name=name, parameters=parameters or {},
                                                protocols=[self.pb.ObjectProtocol(type=p) for p in protocols])
        return self.call("Provisioner", "DriverCreateBucket", req, self.pb.DriverCreateBucketResponse)

    def existing(self, bucket_id, parameters=None):
        req = self.pb.DriverGetExistingBucketRequest(existing_bucket_id=bucket_id, parameters=parameters or {},
                                                     protocols=[self.pb.ObjectProtocol(type=1)])
        return self.call("Provisioner", "DriverGetExistingBucket", req, self.pb.DriverGetExistingBucketResponse)

    def delete(self, bucket_id):
        req = self.pb.DriverDeleteBucketRequest(bucket_id=bucket_id)
        return self.call("Provisioner", "DriverDeleteBucket", req, self.pb.DriverDeleteBucketResponse)

    def grant(self, account, buckets, auth=1, protocol=1, parameters=None):
        R = self.pb.DriverGrantBucketAccessRequest
        req = R(account_name=account, protocol=self.pb.ObjectProtocol(type=protocol),
                authentication_type=self.pb.AuthenticationType(type=auth), parameters=parameters or {},
                buckets=[R.AccessedBucket(bucket_id=b, access_mode=self.pb.AccessMode(mode=m)) for b, m in buckets])
        return self.call("Provisioner", "DriverGrantBucketAccess", req, self.pb.DriverGrantBucketAccessResponse)

    def revoke(self, account_id, buckets):
        R = self.pb.DriverRevokeBucketAccessRequest
        req = R(account_id=account_id, protocol=self.pb.ObjectProtocol(type=1),
                authentication_type=self.pb.AuthenticationType(type=1),
                buckets=[R.AccessedBucket(bucket_id=b) for b in buckets])
        return self.call("Provisioner", "DriverRevokeBucketAccess", req, self.pb.DriverRevokeBucketAccessResponse)


@pytest.fixture
def driver(tmp_path, server, pb):
    d = Driver(tmp_path, server, pb)
    yield d
    d.stop()


READ_WRITE, READ_ONLY, WRITE_ONLY = 1, 2, 3


def code_of(call):
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def user_client(server, creds):
    return server.client({"access_key": creds.s3.access_key_id, "secret_key": creds.s3.access_secret_key})


def test_identity(driver):
    info = driver.info()
    assert info.name == "cosi.tarn.dev"
    assert [p.type for p in info.supported_protocols] == [driver.pb.ObjectProtocol.S3]


def test_buckets_are_created_idempotently_checked_and_deleted(server, driver):
    s3 = server.client()
    r = driver.create("bc-0b1d5e4c")
    assert r.bucket_id == "bc-0b1d5e4c"
    assert r.protocols.HasField("s3")
    assert (r.protocols.s3.endpoint, r.protocols.s3.region) == ("http://tarn.store.svc:9000", "us-east-1")
    assert r.protocols.s3.addressing_style.style == driver.pb.S3AddressingStyle.PATH
    s3.head_bucket(Bucket="bc-0b1d5e4c")
    # The sidecar calls again (a retry, or its periodic check): the same bucket.
    assert driver.create("bc-0b1d5e4c").bucket_id == "bc-0b1d5e4c"

    # COSI names may be longer than S3's 63 characters: a stable bucket name of them.
    long = "bucketclaim-" + "0123456789abcdef-" * 8 + "end"
    b = driver.create(long).bucket_id
    assert len(b) <= 63 and b == driver.create(long).bucket_id
    s3.head_bucket(Bucket=b)

    # A BucketClass parameter: versioning.
    driver.create("versioned-one", {"versioning": "enabled"})
    assert s3.get_bucket_versioning(Bucket="versioned-one")["Status"] == "Enabled"
    assert driver.create("versioned-one", {"versioning": "enabled"}).bucket_id == "versioned-one"
    # The same name with other settings: ALREADY_EXISTS, the bucket untouched
    # (an empty bucket never versioned is taken as a create that stopped
    # before its versioning step, and completed).
    assert code_of(lambda: driver.create("versioned-one", {"versioning": "disabled"}))[0] == grpc.StatusCode.ALREADY_EXISTS
    body = data("cosi", 10_000)
    s3.put_object(Bucket="bc-0b1d5e4c", Key="kept", Body=body)
    assert code_of(lambda: driver.create("bc-0b1d5e4c", {"versioning": "enabled"}))[0] == grpc.StatusCode.ALREADY_EXISTS
    assert "Status" not in s3.get_bucket_versioning(Bucket="bc-0b1d5e4c")
    s3.create_bucket(Bucket="made-then-stopped")
    assert driver.create("made-then-stopped", {"versioning": "enabled"}).bucket_id == "made-then-stopped"
    assert s3.get_bucket_versioning(Bucket="made-then-stopped")["Status"] == "Enabled"
    # What Tarn does not do is refused, never ignored.
    code, why = code_of(lambda: driver.create("azure-one", protocols=(2,)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "S3 only" in why
    code, why = code_of(lambda: driver.create("replicated", {"replication": "3"}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "replication" in why
    assert code_of(lambda: driver.create(""))[0] == grpc.StatusCode.INVALID_ARGUMENT
    for name in ["azure-one", "replicated"]:
        with pytest.raises(s3.exceptions.ClientError):
            s3.head_bucket(Bucket=name)

    # Statically provisioned buckets: found, or NOT_FOUND.
    s3.create_bucket(Bucket="made-by-hand")
    assert driver.existing("made-by-hand").bucket_id == "made-by-hand"
    assert code_of(lambda: driver.existing("no-such-bucket"))[0] == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: driver.existing("made-by-hand", {"versioning": "enabled"}))[0] == grpc.StatusCode.ALREADY_EXISTS

    # Deletion: a bucket with data is kept (FAILED_PRECONDITION) and its data
    # with it; an empty one goes; deleting it again is OK.
    code, why = code_of(lambda: driver.delete("bc-0b1d5e4c"))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not empty" in why
    assert s3.get_object(Bucket="bc-0b1d5e4c", Key="kept")["Body"].read() == body
    s3.delete_object(Bucket="bc-0b1d5e4c", Key="kept")
    driver.delete("bc-0b1d5e4c")
    with pytest.raises(s3.exceptions.ClientError):
        s3.head_bucket(Bucket="bc-0b1d5e4c")
    driver.delete("bc-0b1d5e4c")


def test_access_is_granted_as_a_user_with_policy_statements_and_revoked(server, driver):
    s3 = server.client()
    for b in ["rw-bucket", "ro-bucket", "wo-bucket", "other-bucket"]:
        driver.create(b)
    s3.put_object(Bucket="ro-bucket", Key="model.bin", Body=b"weights")
    s3.put_object(Bucket="other-bucket", Key="secret", Body=b"not yours")
    # A statement an administrator wrote stays through grants and revokes.
    import json
    mine = {"Sid": "ByHand", "Effect": "Deny", "Principal": "*", "Action": "s3:DeleteBucket",
            "Resource": "arn:aws:s3:::rw-bucket"}
    s3.put_bucket_policy(Bucket="rw-bucket", Policy=json.dumps({"Version": "2012-10-17", "Statement": [mine]}))

    g = driver.grant("ba-7f3e2c1d", [("rw-bucket", READ_WRITE), ("ro-bucket", READ_ONLY), ("wo-bucket", WRITE_ONLY)])
    assert g.account_id == "ba-7f3e2c1d"
    assert sorted(b.bucket_id for b in g.buckets) == ["ro-bucket", "rw-bucket", "wo-bucket"]
    for b in g.buckets:
        assert b.bucket_info.s3.bucket_id == b.bucket_id
        assert b.bucket_info.s3.endpoint == "http://tarn.store.svc:9000"
    creds = g.credentials
    assert creds.s3.access_key_id and len(creds.s3.access_secret_key) >= 30
    assert "ba-7f3e2c1d" in admin(server, "user", "list").stdout
    # Called again: OK, the same credentials (the workload's Secret stays right).
    again = driver.grant("ba-7f3e2c1d", [("rw-bucket", READ_WRITE), ("ro-bucket", READ_ONLY), ("wo-bucket", WRITE_ONLY)])
    assert (again.credentials.s3.access_key_id, again.credentials.s3.access_secret_key) == \
        (creds.s3.access_key_id, creds.s3.access_secret_key)

    u = user_client(server, creds)
    denied = u.exceptions.ClientError
    u.put_object(Bucket="rw-bucket", Key="ckpt/0", Body=b"step 0")
    assert u.get_object(Bucket="rw-bucket", Key="ckpt/0")["Body"].read() == b"step 0"
    assert [o["Key"] for o in u.list_objects_v2(Bucket="rw-bucket")["Contents"]] == ["ckpt/0"]
    u.delete_object(Bucket="rw-bucket", Key="ckpt/0")
    assert u.get_object(Bucket="ro-bucket", Key="model.bin")["Body"].read() == b"weights"
    with pytest.raises(denied):
        u.put_object(Bucket="ro-bucket", Key="model.bin", Body=b"overwritten")
    assert s3.get_object(Bucket="ro-bucket", Key="model.bin")["Body"].read() == b"weights"
    u.put_object(Bucket="wo-bucket", Key="upload", Body=b"in")
    with pytest.raises(denied):
        u.get_object(Bucket="wo-bucket", Key="upload")
    with pytest.raises(denied):
        u.get_object(Bucket="other-bucket", Key="secret")
    with pytest.raises(denied):
        u.delete_bucket(Bucket="rw-bucket")

    # Another access mode for the same account and bucket: ALREADY_EXISTS.
    code, _ = code_of(lambda: driver.grant("ba-7f3e2c1d", [("rw-bucket", READ_ONLY)]))
    assert code == grpc.StatusCode.ALREADY_EXISTS
    # A user of that name the driver did not make is not taken over.
    admin(server, "user", "add", "ba-someone-else")
    assert code_of(lambda: driver.grant("ba-someone-else", [("rw-bucket", READ_ONLY)]))[0] == grpc.StatusCode.ALREADY_EXISTS

    # Revoked: the key stops working, the driver's statements go, the
    # administrator's stays; revoking again is OK.
    driver.revoke("ba-7f3e2c1d", ["rw-bucket", "ro-bucket", "wo-bucket"])
    with pytest.raises(denied) as e:
        u.get_object(Bucket="ro-bucket", Key="model.bin")
    assert e.value.response["Error"]["Code"] == "InvalidAccessKeyId"
    policy = json.loads(s3.get_bucket_policy(Bucket="rw-bucket")["Policy"])
    assert [s["Sid"] for s in policy["Statement"]] == ["ByHand"]
    with pytest.raises(s3.exceptions.ClientError) as e:
        s3.get_bucket_policy(Bucket="ro-bucket")
    assert e.value.response["Error"]["Code"] == "NoSuchBucketPolicy"
    assert "ba-7f3e2c1d" not in admin(server, "user", "list").stdout
    driver.revoke("ba-7f3e2c1d", ["rw-bucket", "ro-bucket", "wo-bucket"])

    # Granted again after the revoke: it works again.
    g2 = driver.grant("ba-7f3e2c1d", [("ro-bucket", READ_ONLY)])
    assert user_client(server, g2.credentials).get_object(Bucket="ro-bucket", Key="model.bin")["Body"].read() == b"weights"


def test_what_tarn_does_not_do_is_refused(server, driver):
    driver.create("some-bucket")
    cases = [
        (lambda: driver.grant("ba-sa", [("some-bucket", READ_ONLY)], auth=2), grpc.StatusCode.INVALID_ARGUMENT, "service account"),
        (lambda: driver.grant("ba-gcs", [("some-bucket", READ_ONLY)], protocol=3), grpc.StatusCode.INVALID_ARGUMENT, "S3 only"),
        (lambda: driver.grant("ba-p", [("some-bucket", READ_ONLY)], parameters={"ttl": "1h"}), grpc.StatusCode.INVALID_ARGUMENT, "ttl"),
        (lambda: driver.grant("ba-none", []), grpc.StatusCode.INVALID_ARGUMENT, "no bucket"),
        (lambda: driver.grant("ba-mode", [("some-bucket", 0)]), grpc.StatusCode.INVALID_ARGUMENT, "access mode"),
        (lambda: driver.grant("ba-missing", [("no-such-bucket", READ_ONLY)]), grpc.StatusCode.NOT_FOUND, "no-such-bucket"),
    ]
    for call, want, words in cases:
        code, why = code_of(call)
        assert code == want and words in why, (code, why)
    # None of them left a user behind.
    listed = admin(server, "user", "list").stdout
    assert not any(n in listed for n in ["ba-sa", "ba-gcs", "ba-p\t", "ba-none", "ba-mode", "ba-missing"])
    # An unknown method is UNIMPLEMENTED.
    fn = driver.channel.unary_unary(f"/{SVC}.Provisioner/DriverMakeCoffee", request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as e:
        fn(b"", timeout=10)
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_server_that_is_down_is_unavailable_not_a_hang(tmp_path, server, pb):
    d = Driver(tmp_path, server, pb)
    try:
        server.stop()
        code, why = code_of(lambda: d.create("while-down"))
        assert code == grpc.StatusCode.UNAVAILABLE and "S3 endpoint" in why
        assert d.info().name == "cosi.tarn.dev"  # the Identity service still answers
    finally:
        d.stop()


def test_the_endpoint_must_be_a_unix_socket(tmp_path, server):
    env = dict(os.environ, COSI_ENDPOINT="tcp://127.0.0.1:9", TARN_ACCESS_KEY=ACCESS_KEY, TARN_SECRET_KEY=SECRET_KEY)
    r = subprocess.run([BIN, "cosi"], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "unix:///" in r.stderr


def test_the_admin_api_imports_a_given_key(server):
    """What the driver's grants rest on, usable by scripts moving keys from
    another store: POST /admin/users/NAME with the key in the body."""
    import requests

    h = {"Authorization": f"Bearer {SECRET_KEY}"}
    key = {"access_key": "IMPORTED0123456789AB", "secret_key": "an-imported-secret-of-enough-length-0123"}
    r = requests.post(f"{server.admin}/admin/users/mover", headers=h, json=key)
    assert r.status_code == 200 and r.json()["access_key"] == key["access_key"], r.text
    c = server.client(key)
    server.client().create_bucket(Bucket="moved")
    with pytest.raises(c.exceptions.ClientError) as e:
        c.list_objects_v2(Bucket="moved")  # authenticated, not authorized
    assert e.value.response["Error"]["Code"] == "AccessDenied"
    # The same access key for anyone else: 409, nothing made.
    r = requests.post(f"{server.admin}/admin/users/other", headers=h, json=key)
    assert r.status_code == 409 and "taken" in r.json()["error"], r.text
    assert "other" not in admin(server, "user", "list").stdout
    r = requests.post(f"{server.admin}/admin/users/mover/keys", headers=h, json=key)
    assert r.status_code == 409 and "taken" in r.json()["error"]
    # Malformed keys and bodies: 400 with the rule.
    for body, words in [({"access_key": "short", "secret_key": key["secret_key"]}, "16 to 128"),
                        ({"access_key": "lowercase0123456789", "secret_key": key["secret_key"]}, "A-Z and 0-9"),
                        ({"access_key": "ANOTHER0123456789ABC", "secret_key": "too short"}, "30 to 128"),
                        ({"access_key": "ANOTHER0123456789ABC"}, "secret_key"),
                        ({"access_key": "ANOTHER0123456789ABC", "secret_key": key["secret_key"], "x": 1}, "unknown field")]:
        r = requests.post(f"{server.admin}/admin/users/third", headers=h, json=body)
        assert r.status_code == 400 and words in r.json()["error"], (body, r.text)
    assert "third" not in admin(server, "user", "list").stdout
    # Without a body: a random key, as before.
    r = requests.post(f"{server.admin}/admin/users/fourth", headers=h)
    assert r.status_code == 200 and r.json()["access_key"].startswith("TK")
