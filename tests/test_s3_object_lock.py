"""Object lock (issue 42): buckets made with object lock keep versioning on
for good; versions carry a retention (GOVERNANCE, COMPLIANCE) and a legal
hold; a locked version cannot be deleted or replaced by anyone, root
included, until its retention ends and its hold is lifted; GOVERNANCE
yields to `x-amz-bypass-governance-retention` with its permission; the
bucket's default retention applies to new versions; lifecycle, heal,
restarts and DeleteBucket respect locks. Before, every lock request got 501."""

import base64
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import botocore.exceptions
import pytest
import requests

from conftest import data
from sigv4 import signed_request
from tarnproc import ACCESS_KEY, SECRET_KEY, add_user, metric, wait_for


def err(call):
    with pytest.raises(botocore.exceptions.ClientError) as e:
        call()
    r = e.value.response
    return r["ResponseMetadata"]["HTTPStatusCode"], r["Error"]["Code"]


def later(**kw):
    return datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(**kw)


def bypass(s3, op):
    """Sends x-amz-bypass-governance-retention on every `op` call of `s3`
    (boto3's own parameter, as a header, for the operations it lacks)."""

    def add(request, **_):
        request.headers["x-amz-bypass-governance-retention"] = "true"

    s3.meta.events.register(f"before-sign.s3.{op}", add)


def versions(s3, bucket):
    r = s3.list_object_versions(Bucket=bucket)
    return [(v["Key"], v["VersionId"]) for v in r.get("Versions", [])] + [
        (m["Key"], m["VersionId"]) for m in r.get("DeleteMarkers", [])
    ]


def test_lock_bucket_compliance_and_legal_hold(s3):
    s3.create_bucket(Bucket="vault", ObjectLockEnabledForBucket=True)
    assert s3.get_bucket_versioning(Bucket="vault")["Status"] == "Enabled"
    conf = s3.get_object_lock_configuration(Bucket="vault")["ObjectLockConfiguration"]
    assert conf == {"ObjectLockEnabled": "Enabled"}, conf
    # Versioning cannot be suspended on a lock bucket.
    assert err(lambda: s3.put_bucket_versioning(Bucket="vault", VersioningConfiguration={"Status": "Suspended"})) == (
        409, "InvalidBucketState")
    until = later(days=1)
    body = data("ckpt", 300_000)
    vid = s3.put_object(Bucket="vault", Key="ckpt/step-100", Body=body, ObjectLockMode="COMPLIANCE",
                        ObjectLockRetainUntilDate=until)["VersionId"]
    h = s3.head_object(Bucket="vault", Key="ckpt/step-100")
    assert h["ObjectLockMode"] == "COMPLIANCE"
    assert abs((h["ObjectLockRetainUntilDate"] - until).total_seconds()) < 1
    g = s3.get_object(Bucket="vault", Key="ckpt/step-100")
    assert g["ObjectLockMode"] == "COMPLIANCE" and g["Body"].read() == body
    r = s3.get_object_retention(Bucket="vault", Key="ckpt/step-100")["Retention"]
    assert r["Mode"] == "COMPLIANCE" and abs((r["RetainUntilDate"] - until).total_seconds()) < 1
    # Root cannot delete it, shorten it, loosen it or remove it.
    assert err(lambda: s3.delete_object(Bucket="vault", Key="ckpt/step-100", VersionId=vid)) == (403, "AccessDenied")
    bypass(s3, "DeleteObject")
    assert err(lambda: s3.delete_object(Bucket="vault", Key="ckpt/step-100", VersionId=vid)) == (403, "AccessDenied")
    assert err(lambda: s3.put_object_retention(Bucket="vault", Key="ckpt/step-100", Retention={
        "Mode": "COMPLIANCE", "RetainUntilDate": later(hours=1)}, BypassGovernanceRetention=True)) == (403, "AccessDenied")
    assert err(lambda: s3.put_object_retention(Bucket="vault", Key="ckpt/step-100", Retention={
        "Mode": "GOVERNANCE", "RetainUntilDate": later(days=3)}, BypassGovernanceRetention=True)) == (403, "AccessDenied")
    assert err(lambda: s3.put_object_retention(Bucket="vault", Key="ckpt/step-100", Retention={},
                                               BypassGovernanceRetention=True)) == (403, "AccessDenied")
    # Extending is allowed.
    s3.put_object_retention(Bucket="vault", Key="ckpt/step-100", VersionId=vid,
                            Retention={"Mode": "COMPLIANCE", "RetainUntilDate": later(days=2)})
    assert s3.get_object_retention(Bucket="vault", Key="ckpt/step-100")["Retention"]["RetainUntilDate"] > until
    # DeleteObjects: refused for that version, per key.
    out = s3.delete_objects(Bucket="vault", Delete={"Objects": [{"Key": "ckpt/step-100", "VersionId": vid}]})
    assert [e["Code"] for e in out["Errors"]] == ["AccessDenied"], out
    # A delete without a version id makes a delete marker (allowed); the
    # locked version stays readable by its id.
    d = s3.delete_object(Bucket="vault", Key="ckpt/step-100")
    assert d["DeleteMarker"]
    assert s3.get_object(Bucket="vault", Key="ckpt/step-100", VersionId=vid)["Body"].read() == body
    # The bucket keeps it: DeleteBucket refuses.
    s3.delete_object(Bucket="vault", Key="ckpt/step-100", VersionId=d["VersionId"])
    assert err(lambda: s3.delete_bucket(Bucket="vault")) == (409, "BucketNotEmpty")

    # A legal hold, no retention: kept until lifted.
    hv = s3.put_object(Bucket="vault", Key="model", Body=b"weights", ObjectLockLegalHoldStatus="ON")["VersionId"]
    assert s3.get_object_legal_hold(Bucket="vault", Key="model")["LegalHold"] == {"Status": "ON"}
    assert s3.head_object(Bucket="vault", Key="model")["ObjectLockLegalHoldStatus"] == "ON"
    assert err(lambda: s3.delete_object(Bucket="vault", Key="model", VersionId=hv)) == (403, "AccessDenied")
    assert err(lambda: s3.get_object_retention(Bucket="vault", Key="model")) == (404, "NoSuchObjectLockConfiguration")
    s3.put_object_legal_hold(Bucket="vault", Key="model", VersionId=hv, LegalHold={"Status": "OFF"})
    assert s3.get_object_legal_hold(Bucket="vault", Key="model")["LegalHold"] == {"Status": "OFF"}
    s3.delete_object(Bucket="vault", Key="model", VersionId=hv)
    assert ("model", hv) not in versions(s3, "vault")
    # A version never locked has no lock to read.
    s3.put_object(Bucket="vault", Key="free", Body=b"x")
    assert err(lambda: s3.get_object_legal_hold(Bucket="vault", Key="free")) == (404, "NoSuchObjectLockConfiguration")


def test_short_retention_ends(s3):
    """A retention that ends frees its version: nothing else is needed."""
    s3.create_bucket(Bucket="brief", ObjectLockEnabledForBucket=True)
    until = later(seconds=3)
    vid = s3.put_object(Bucket="brief", Key="k", Body=b"x", ObjectLockMode="COMPLIANCE",
                        ObjectLockRetainUntilDate=until)["VersionId"]
    assert err(lambda: s3.delete_object(Bucket="brief", Key="k", VersionId=vid)) == (403, "AccessDenied")
    time.sleep(max(0.0, (until - later()).total_seconds()) + 0.5)
    s3.delete_object(Bucket="brief", Key="k", VersionId=vid)
    assert versions(s3, "brief") == []
    s3.delete_bucket(Bucket="brief")


def test_governance_and_its_bypass_permission(server, s3):
    s3.create_bucket(Bucket="gov", ObjectLockEnabledForBucket=True)
    alice = server.client(add_user(server, "alice"))
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"AWS": "alice"},
         "Action": ["s3:GetObject", "s3:GetObjectVersion", "s3:PutObject", "s3:DeleteObject", "s3:DeleteObjectVersion",
                    "s3:PutObjectRetention", "s3:GetObjectRetention", "s3:ListBucketVersions"],
         "Resource": ["arn:aws:s3:::gov", "arn:aws:s3:::gov/*"]}]}
    s3.put_bucket_policy(Bucket="gov", Policy=json.dumps(policy))
    until = later(days=1)
    vids = {k: alice.put_object(Bucket="gov", Key=k, Body=k.encode(), ObjectLockMode="GOVERNANCE",
                                ObjectLockRetainUntilDate=until)["VersionId"] for k in ("a", "b", "c", "d")}
    # Without the bypass, nobody deletes or shortens it.
    assert err(lambda: alice.delete_object(Bucket="gov", Key="a", VersionId=vids["a"])) == (403, "AccessDenied")
    assert err(lambda: s3.delete_object(Bucket="gov", Key="a", VersionId=vids["a"])) == (403, "AccessDenied")
    assert err(lambda: alice.put_object_retention(Bucket="gov", Key="a", Retention={
        "Mode": "GOVERNANCE", "RetainUntilDate": later(hours=1)})) == (403, "AccessDenied")
    # Asked for without s3:BypassGovernanceRetention: still refused.
    assert err(lambda: alice.delete_object(Bucket="gov", Key="a", VersionId=vids["a"],
                                           BypassGovernanceRetention=True)) == (403, "AccessDenied")
    out = alice.delete_objects(Bucket="gov", BypassGovernanceRetention=True,
                               Delete={"Objects": [{"Key": "a", "VersionId": vids["a"]}]})
    assert [e["Code"] for e in out["Errors"]] == ["AccessDenied"], out
    # Tightening needs no bypass: GOVERNANCE to COMPLIANCE, a later date.
    alice.put_object_retention(Bucket="gov", Key="d", Retention={"Mode": "COMPLIANCE", "RetainUntilDate": later(days=2)})
    # With the permission, the bypass works: delete, shorten, remove.
    policy["Statement"].append({"Effect": "Allow", "Principal": {"AWS": "alice"}, "Action": "s3:BypassGovernanceRetention",
                                "Resource": "arn:aws:s3:::gov/*"})
    s3.put_bucket_policy(Bucket="gov", Policy=json.dumps(policy))
    alice.delete_object(Bucket="gov", Key="a", VersionId=vids["a"], BypassGovernanceRetention=True)
    out = alice.delete_objects(Bucket="gov", BypassGovernanceRetention=True,
                               Delete={"Objects": [{"Key": "b", "VersionId": vids["b"]},
                                                   {"Key": "d", "VersionId": vids["d"]}]})
    assert [d["Key"] for d in out["Deleted"]] == ["b"] and [e["Key"] for e in out["Errors"]] == ["d"], out
    alice.put_object_retention(Bucket="gov", Key="c", Retention={}, BypassGovernanceRetention=True)
    assert err(lambda: alice.get_object_retention(Bucket="gov", Key="c")) == (404, "NoSuchObjectLockConfiguration")
    alice.delete_object(Bucket="gov", Key="c", VersionId=vids["c"])
    # Root bypasses GOVERNANCE, never COMPLIANCE.
    g = s3.put_object(Bucket="gov", Key="r", Body=b"r", ObjectLockMode="GOVERNANCE",
                      ObjectLockRetainUntilDate=until)["VersionId"]
    s3.delete_object(Bucket="gov", Key="r", VersionId=g, BypassGovernanceRetention=True)
    assert err(lambda: s3.delete_object(Bucket="gov", Key="d", VersionId=vids["d"],
                                        BypassGovernanceRetention=True)) == (403, "AccessDenied")


def test_lock_permissions_and_visibility(server, s3):
    """Setting a lock on a write needs s3:PutObjectRetention or
    s3:PutObjectLegalHold; the lock shows on GET/HEAD only to those who may
    read it."""
    s3.create_bucket(Bucket="perm", ObjectLockEnabledForBucket=True)
    bob = server.client(add_user(server, "bob"))
    s3.put_bucket_policy(Bucket="perm", Policy=json.dumps({"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"AWS": "bob"}, "Action": ["s3:PutObject", "s3:GetObject"],
         "Resource": "arn:aws:s3:::perm/*"}]}))
    assert err(lambda: bob.put_object(Bucket="perm", Key="k", Body=b"x", ObjectLockMode="GOVERNANCE",
                                      ObjectLockRetainUntilDate=later(days=1))) == (403, "AccessDenied")
    assert err(lambda: bob.put_object(Bucket="perm", Key="k", Body=b"x", ObjectLockLegalHoldStatus="ON")) == (
        403, "AccessDenied")
    assert err(lambda: bob.put_object_legal_hold(Bucket="perm", Key="k", LegalHold={"Status": "OFF"})) == (
        403, "AccessDenied")
    s3.put_object(Bucket="perm", Key="k", Body=b"x", ObjectLockMode="GOVERNANCE", ObjectLockRetainUntilDate=later(days=1),
                  ObjectLockLegalHoldStatus="ON")
    h = bob.head_object(Bucket="perm", Key="k")
    assert "ObjectLockMode" not in h and "ObjectLockLegalHoldStatus" not in h, h
    h = s3.head_object(Bucket="perm", Key="k")
    assert h["ObjectLockMode"] == "GOVERNANCE" and h["ObjectLockLegalHoldStatus"] == "ON", h


def test_default_retention_multipart_and_copies(s3):
    # Lock on an existing bucket needs versioning enabled first.
    s3.create_bucket(Bucket="later")
    conf = {"ObjectLockEnabled": "Enabled", "Rule": {"DefaultRetention": {"Mode": "GOVERNANCE", "Days": 1}}}
    assert err(lambda: s3.put_object_lock_configuration(Bucket="later", ObjectLockConfiguration=conf)) == (
        409, "InvalidBucketState")
    s3.put_bucket_versioning(Bucket="later", VersioningConfiguration={"Status": "Enabled"})
    s3.put_object(Bucket="later", Key="before", Body=b"b")
    s3.put_object_lock_configuration(Bucket="later", ObjectLockConfiguration=conf)
    assert s3.get_object_lock_configuration(Bucket="later")["ObjectLockConfiguration"] == conf
    # Malformed configurations.
    for bad in ({"ObjectLockEnabled": "Enabled", "Rule": {"DefaultRetention": {"Mode": "GOVERNANCE", "Days": 1, "Years": 1}}},
                {"ObjectLockEnabled": "Enabled", "Rule": {"DefaultRetention": {"Days": 1}}},
                {"Rule": {"DefaultRetention": {"Mode": "GOVERNANCE", "Days": 1}}}):
        assert err(lambda: s3.put_object_lock_configuration(Bucket="later", ObjectLockConfiguration=bad))[0] == 400, bad
    assert err(lambda: s3.put_object_lock_configuration(Bucket="later", ObjectLockConfiguration={
        "ObjectLockEnabled": "Enabled", "Rule": {"DefaultRetention": {"Mode": "GOVERNANCE", "Days": 0}}})) == (
        400, "InvalidArgument")
    # A version from before is not locked; new ones get the default.
    before = s3.head_object(Bucket="later", Key="before")
    assert "ObjectLockMode" not in before
    t0 = later()
    s3.put_object(Bucket="later", Key="plain", Body=b"p")
    h = s3.head_object(Bucket="later", Key="plain")
    assert h["ObjectLockMode"] == "GOVERNANCE"
    assert abs((h["ObjectLockRetainUntilDate"] - (t0 + datetime.timedelta(days=1))).total_seconds()) < 30
    # An explicit retention wins over the default.
    s3.put_object(Bucket="later", Key="mine", Body=b"m", ObjectLockMode="COMPLIANCE", ObjectLockRetainUntilDate=later(days=5))
    assert s3.head_object(Bucket="later", Key="mine")["ObjectLockMode"] == "COMPLIANCE"
    # Multipart: the lock asked at creation (or the default) is the object's.
    up = s3.create_multipart_upload(Bucket="later", Key="mp", ObjectLockLegalHoldStatus="ON")["UploadId"]
    parts = [data(("mp", i), 5 << 20) for i in range(2)]
    tags = [s3.upload_part(Bucket="later", Key="mp", UploadId=up, PartNumber=i + 1, Body=p)["ETag"]
            for i, p in enumerate(parts)]
    s3.complete_multipart_upload(Bucket="later", Key="mp", UploadId=up, MultipartUpload={
        "Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(tags)]})
    h = s3.head_object(Bucket="later", Key="mp")
    assert h["ObjectLockLegalHoldStatus"] == "ON" and h["ObjectLockMode"] == "GOVERNANCE", h
    assert s3.get_object(Bucket="later", Key="mp")["Body"].read() == b"".join(parts)
    # A copy gets the destination's default or the request's lock, not the
    # source's.
    s3.copy_object(Bucket="later", Key="copy", CopySource="later/mine")
    h = s3.head_object(Bucket="later", Key="copy")
    assert h["ObjectLockMode"] == "GOVERNANCE", h
    s3.create_bucket(Bucket="nolock")
    s3.copy_object(Bucket="nolock", Key="copy", CopySource="later/mine")
    assert "ObjectLockMode" not in s3.head_object(Bucket="nolock", Key="copy")
    # Removing the rule stops defaults; the lock stays enabled for good.
    s3.put_object_lock_configuration(Bucket="later", ObjectLockConfiguration={"ObjectLockEnabled": "Enabled"})
    s3.put_object(Bucket="later", Key="after", Body=b"a")
    assert "ObjectLockMode" not in s3.head_object(Bucket="later", Key="after")
    assert s3.get_object_lock_configuration(Bucket="later")["ObjectLockConfiguration"] == {"ObjectLockEnabled": "Enabled"}


def test_lock_request_refusals(server, s3):
    s3.create_bucket(Bucket="refuse", ObjectLockEnabledForBucket=True)
    soon = later(days=1).strftime("%Y-%m-%dT%H:%M:%SZ")
    past = "2001-01-01T00:00:00Z"
    md5 = base64.b64encode(hashlib.md5(b"x").digest()).decode()

    def hdr(mode, until):
        return {"x-amz-object-lock-mode": mode, "x-amz-object-lock-retain-until-date": until}

    def put(headers, body=b"x"):
        return signed_request(server.endpoint, "PUT", "/refuse/k", body=body, headers=headers)

    cases = [
        ({"x-amz-object-lock-mode": "GOVERNANCE", "content-md5": md5}, 400, "InvalidArgument"),
        ({"x-amz-object-lock-retain-until-date": soon, "content-md5": md5}, 400, "InvalidArgument"),
        ({**hdr("GOVERNANCE", past), "content-md5": md5}, 400, "InvalidArgument"),
        ({**hdr("FOREVER", soon), "content-md5": md5}, 400, "InvalidArgument"),
        ({"x-amz-object-lock-legal-hold": "MAYBE", "content-md5": md5}, 400, "InvalidArgument"),
    ]
    for headers, status, code in cases:
        r = put(headers)
        assert r.status_code == status and f"<Code>{code}</Code>" in r.text, (headers, r.status_code, r.text)
    # A locked PUT must prove its body: an unsigned payload with neither
    # Content-MD5 nor a checksum is refused (AWS's rule).
    h = {"x-amz-object-lock-legal-hold": "ON"}
    r = signed_request(server.endpoint, "PUT", "/refuse/k", body=b"x", headers=h, payload_hash="UNSIGNED-PAYLOAD")
    assert r.status_code == 400 and "<Code>InvalidRequest</Code>" in r.text, r.text
    r = put({**h, "content-md5": md5})
    assert r.status_code == 200, r.text
    assert err(lambda: s3.get_object_retention(Bucket="refuse", Key="nope")) == (404, "NoSuchKey")
    # Retention on a delete marker: not allowed.
    d = s3.delete_object(Bucket="refuse", Key="k")
    assert err(lambda: s3.put_object_legal_hold(Bucket="refuse", Key="k", VersionId=d["VersionId"],
                                                LegalHold={"Status": "ON"}))[0] == 405
    assert err(lambda: s3.put_object_retention(Bucket="refuse", Key="k", Retention={
        "Mode": "GOVERNANCE", "RetainUntilDate": datetime.datetime(2001, 1, 1, tzinfo=datetime.timezone.utc)})) == (
        400, "InvalidArgument")


def test_lifecycle_keeps_locked_versions(make_server):
    srv = make_server(extra_args=["--lifecycle-interval-secs", "1", "--lifecycle-day-secs", "1"])
    s3 = srv.client()
    s3.create_bucket(Bucket="lclock", ObjectLockEnabledForBucket=True)
    held = s3.put_object(Bucket="lclock", Key="ckpt", Body=b"v1", ObjectLockLegalHoldStatus="ON")["VersionId"]
    free = s3.put_object(Bucket="lclock", Key="ckpt", Body=b"v2")["VersionId"]
    s3.put_object(Bucket="lclock", Key="ckpt", Body=b"v3")
    s3.put_bucket_lifecycle_configuration(Bucket="lclock", LifecycleConfiguration={"Rules": [
        {"ID": "old", "Status": "Enabled", "Filter": {}, "NoncurrentVersionExpiration": {"NoncurrentDays": 1}}]})
    wait_for("the unlocked noncurrent version expired",
             lambda: ("ckpt", free) not in versions(s3, "lclock"), timeout=30)
    wait_for("the locked one kept and counted", lambda: metric(srv, "tarn_lifecycle_locked_kept_total") >= 1)
    assert ("ckpt", held) in versions(s3, "lclock")
    assert s3.get_object(Bucket="lclock", Key="ckpt", VersionId=held)["Body"].read() == b"v1"
    # Lifted, the next pass expires it.
    s3.put_object_legal_hold(Bucket="lclock", Key="ckpt", VersionId=held, LegalHold={"Status": "OFF"})
    wait_for("the lifted version expired", lambda: ("ckpt", held) not in versions(s3, "lclock"), timeout=30)


def test_locks_survive_restart_drive_loss_and_heal(make_server):
    srv = make_server(expected_errors=[r"drive faulty", r"drive offline", r"erasure set is degraded", r"read failed",
                                       r"shard", r"metadata write failed", r"lost write quorum"])
    s3 = srv.client()
    s3.create_bucket(Bucket="durable", ObjectLockEnabledForBucket=True)
    until = later(days=1)
    body = data("big", 2 << 20)
    big = s3.put_object(Bucket="durable", Key="big", Body=body, ObjectLockMode="COMPLIANCE",
                        ObjectLockRetainUntilDate=until)["VersionId"]
    small = s3.put_object(Bucket="durable", Key="small", Body=b"s", ObjectLockLegalHoldStatus="ON")["VersionId"]
    # A restart reads the locks back; then a drive's contents go while the
    # server runs (a replaced disk), and heal rebuilds it.
    srv.stop()
    srv.start()
    s3 = srv.client()
    assert err(lambda: s3.delete_object(Bucket="durable", Key="small", VersionId=small)) == (403, "AccessDenied")
    wiped = srv.drives[1]
    for name in os.listdir(wiped):
        p = os.path.join(wiped, name)
        shutil.rmtree(p) if os.path.isdir(p) and not os.path.islink(p) else os.remove(p)
    assert s3.get_object(Bucket="durable", Key="big")["Body"].read() == body
    wait_for("the wipe to be noticed", lambda: metric(srv, "tarn_drive_faults_total") >= 1)
    wait_for("the drive to rejoin", lambda: requests.get(f"{srv.admin}/admin/drives", headers={
        "Authorization": f"Bearer {SECRET_KEY}"}).json()[1]["state"] == "online")
    r = requests.post(f"{srv.admin}/admin/heal", headers={"Authorization": f"Bearer {SECRET_KEY}"}).json()
    assert r["failures"] == 0, r
    # The lock bucket and its versions' locks are what they were.
    assert s3.get_object_lock_configuration(Bucket="durable")["ObjectLockConfiguration"]["ObjectLockEnabled"] == "Enabled"
    assert err(lambda: s3.put_bucket_versioning(Bucket="durable", VersioningConfiguration={"Status": "Suspended"})) == (
        409, "InvalidBucketState")
    assert s3.get_object(Bucket="durable", Key="big")["Body"].read() == body
    for key, vid in (("big", big), ("small", small)):
        assert err(lambda: s3.delete_object(Bucket="durable", Key=key, VersionId=vid)) == (403, "AccessDenied"), key
    # The healed drive holds the locks too: two others lost, still locked.
    srv.stop()
    shutil.rmtree(srv.drives[2])
    shutil.rmtree(srv.drives[3])
    srv.start()
    s3 = srv.client()
    assert s3.get_object_retention(Bucket="durable", Key="big")["Retention"]["Mode"] == "COMPLIANCE"
    assert err(lambda: s3.delete_object(Bucket="durable", Key="big", VersionId=big)) == (403, "AccessDenied")


def test_aws_cli_object_lock(server, tmp_path):
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1",
               AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null")
    aws = [os.path.join(os.path.dirname(sys.executable), "aws"), "--endpoint-url", server.endpoint, "s3api"]

    def run(*args, ok=True):
        r = subprocess.run([*aws, *args], capture_output=True, text=True, env=env, timeout=120)
        assert (r.returncode == 0) == ok, f"{args}: {r.stderr}"
        return json.loads(r.stdout) if ok and r.stdout.strip() else r.stderr

    run("create-bucket", "--bucket", "cli-lock", "--object-lock-enabled-for-bucket")
    run("put-object-lock-configuration", "--bucket", "cli-lock", "--object-lock-configuration",
        json.dumps({"ObjectLockEnabled": "Enabled", "Rule": {"DefaultRetention": {"Mode": "COMPLIANCE", "Days": 1}}}))
    assert run("get-object-lock-configuration", "--bucket", "cli-lock")["ObjectLockConfiguration"]["Rule"] == {
        "DefaultRetention": {"Mode": "COMPLIANCE", "Days": 1}}
    f = tmp_path / "w.bin"
    f.write_bytes(data("cli", 100_000))
    vid = run("put-object", "--bucket", "cli-lock", "--key", "w", "--body", str(f))["VersionId"]
    assert run("get-object-retention", "--bucket", "cli-lock", "--key", "w")["Retention"]["Mode"] == "COMPLIANCE"
    run("put-object-legal-hold", "--bucket", "cli-lock", "--key", "w", "--legal-hold", "Status=ON")
    assert run("get-object-legal-hold", "--bucket", "cli-lock", "--key", "w")["LegalHold"]["Status"] == "ON"
    out = run("delete-object", "--bucket", "cli-lock", "--key", "w", "--version-id", vid, ok=False)
    assert "AccessDenied" in out, out


def test_form_upload_with_a_lock(s3):
    from test_s3_post import post
    s3.create_bucket(Bucket="formlock", ObjectLockEnabledForBucket=True)
    until = later(days=1).strftime("%Y-%m-%dT%H:%M:%S.000Z")
    fields = {"x-amz-object-lock-mode": "GOVERNANCE", "x-amz-object-lock-retain-until-date": until,
              "x-amz-object-lock-legal-hold": "ON"}
    r = post(s3, "formlock", "up", b"form body", fields=fields, conditions=[{k: v} for k, v in fields.items()])
    assert r.status_code == 204, r.text
    h = s3.head_object(Bucket="formlock", Key="up")
    assert h["ObjectLockMode"] == "GOVERNANCE" and h["ObjectLockLegalHoldStatus"] == "ON", h
    assert err(lambda: s3.delete_object(Bucket="formlock", Key="up", VersionId=h["VersionId"])) == (403, "AccessDenied")
