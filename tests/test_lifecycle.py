"""Bucket lifecycle (issue 42): Get/Put/DeleteBucketLifecycleConfiguration
answered and checked as S3 does (they were 501), and the background
scanner that applies the rules, on a short interval (`--lifecycle-day-secs`
makes a day a few seconds), on one node and in a cluster where one node at
a time scans a bucket."""

import json
import os
import subprocess
import sys
import time

import botocore.exceptions
import pytest

from clusterproc import form, stop_all
from tarnproc import ACCESS_KEY, SECRET_KEY, metric, wait_for

DAY = 2  # seconds in a lifecycle day here
FAST = ["--lifecycle-interval-secs", "1", "--lifecycle-day-secs", str(DAY)]


def err(call):
    with pytest.raises(botocore.exceptions.ClientError) as e:
        call()
    r = e.value.response
    return r["ResponseMetadata"]["HTTPStatusCode"], r["Error"]["Code"]


def rule(id, **kw):
    return {"ID": id, "Status": "Enabled", "Filter": {"Prefix": ""}, **kw}


def put_rules(c, bucket, *rules):
    c.put_bucket_lifecycle_configuration(Bucket=bucket, LifecycleConfiguration={"Rules": list(rules)})


def keys(c, bucket):
    return sorted(o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", []))


def versions(c, bucket):
    r = c.list_object_versions(Bucket=bucket)
    return r.get("Versions", []), r.get("DeleteMarkers", [])


def test_configuration_is_kept_and_checked(server, s3):
    """What S3 accepts is kept and answered back as given; what it refuses
    is refused with its codes, and a refused configuration changes nothing.
    Transitions are NotImplemented (one storage class)."""
    s3.create_bucket(Bucket="lcb")
    assert err(lambda: s3.get_bucket_lifecycle_configuration(Bucket="lcb")) == (404, "NoSuchLifecycleConfiguration")
    rules = [
        {"ID": "tmp", "Status": "Enabled", "Filter": {"Prefix": "tmp/"}, "Expiration": {"Days": 3}},
        {"ID": "tagged", "Status": "Disabled", "Filter": {"Tag": {"Key": "class", "Value": "scratch"}},
         "Expiration": {"Date": "2030-01-01T00:00:00Z"}},
        {"ID": "and", "Status": "Enabled",
         "Filter": {"And": {"Prefix": "runs/", "Tags": [{"Key": "a", "Value": "1"}], "ObjectSizeGreaterThan": 10,
                            "ObjectSizeLessThan": 1000}},
         "NoncurrentVersionExpiration": {"NoncurrentDays": 1, "NewerNoncurrentVersions": 3}},
        {"ID": "uploads", "Status": "Enabled", "Filter": {"Prefix": ""},
         "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 2},
         "Expiration": {"ExpiredObjectDeleteMarker": True}},
        {"ID": "big", "Status": "Enabled", "Filter": {"ObjectSizeGreaterThan": 1 << 30}, "Expiration": {"Days": 30}},
    ]
    put_rules(s3, "lcb", *rules)
    got = s3.get_bucket_lifecycle_configuration(Bucket="lcb")["Rules"]
    for g in got:
        if "Expiration" in g and "Date" in g["Expiration"]:
            g["Expiration"]["Date"] = g["Expiration"]["Date"].strftime("%Y-%m-%dT%H:%M:%SZ")
    assert got == rules
    bad = [
        (rule("t", Transitions=[{"Days": 30, "StorageClass": "GLACIER"}]), (501, "NotImplemented")),
        (rule("d", Expiration={"Days": 0}), (400, "InvalidArgument")),
        (rule("m", Expiration={"Date": "2030-01-01T12:00:00Z"}), (400, "InvalidArgument")),
        (rule("n"), (400, "InvalidRequest")),
        ({"ID": "x", "Status": "Enabled", "Filter": {"Tag": {"Key": "k", "Value": "v"}},
          "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}}, (400, "InvalidRequest")),
        (rule("e", Expiration={"Days": 1, "ExpiredObjectDeleteMarker": True}), (400, "MalformedXML")),
        (rule("v", NoncurrentVersionExpiration={"NoncurrentDays": 1, "NewerNoncurrentVersions": 101}),
         (400, "InvalidArgument")),
        ({"ID": "s", "Status": "Sometimes", "Filter": {"Prefix": ""}, "Expiration": {"Days": 1}}, (400, "MalformedXML")),
        ({"ID": "i" * 256, "Status": "Enabled", "Filter": {"Prefix": ""}, "Expiration": {"Days": 1}},
         (400, "InvalidArgument")),
    ]
    for r, want in bad:
        assert err(lambda: put_rules(s3, "lcb", r)) == want, r
    same_id = rule("dup", Expiration={"Days": 1})
    assert err(lambda: put_rules(s3, "lcb", same_id, same_id)) == (400, "InvalidArgument")
    assert len(s3.get_bucket_lifecycle_configuration(Bucket="lcb")["Rules"]) == len(rules)
    # A rule without an ID is given one.
    put_rules(s3, "lcb", {"Status": "Enabled", "Filter": {"Prefix": "x/"}, "Expiration": {"Days": 1}})
    [r] = s3.get_bucket_lifecycle_configuration(Bucket="lcb")["Rules"]
    assert r["ID"] and r["Filter"] == {"Prefix": "x/"}
    s3.delete_bucket_lifecycle(Bucket="lcb")
    assert err(lambda: s3.get_bucket_lifecycle_configuration(Bucket="lcb")) == (404, "NoSuchLifecycleConfiguration")
    # The aws CLI, as people write it.
    env = dict(os.environ, AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY,
               AWS_DEFAULT_REGION="us-east-1", AWS_CONFIG_FILE="/dev/null", AWS_SHARED_CREDENTIALS_FILE="/dev/null")
    aws = [os.path.join(os.path.dirname(sys.executable), "aws"), "--endpoint-url", server.endpoint, "s3api"]
    conf = json.dumps({"Rules": [{"ID": "old", "Status": "Enabled", "Prefix": "logs/", "Expiration": {"Days": 7}}]})
    r = subprocess.run([*aws, "put-bucket-lifecycle-configuration", "--bucket", "lcb", "--lifecycle-configuration", conf],
                       capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([*aws, "get-bucket-lifecycle-configuration", "--bucket", "lcb"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert json.loads(r.stdout)["Rules"] == json.loads(conf)["Rules"], r.stdout


def test_rules_run_on_one_node(make_server):
    """Expiration by days (prefix, tag and size filters), expiry of current
    versions in a versioned bucket (a delete marker), noncurrent versions
    beyond the newest N (keep the last N checkpoints), lone delete markers,
    and incomplete uploads; what no rule names stays."""
    srv = make_server(extra_args=FAST)
    c = srv.client()
    c.create_bucket(Bucket="plain")
    put_rules(c, "plain",
              {"ID": "tmp", "Status": "Enabled", "Filter": {"Prefix": "tmp/"}, "Expiration": {"Days": 1}},
              {"ID": "scratch", "Status": "Enabled", "Filter": {"Tag": {"Key": "class", "Value": "scratch"}},
               "Expiration": {"Days": 1}},
              {"ID": "small", "Status": "Enabled",
               "Filter": {"And": {"Prefix": "sized/", "ObjectSizeLessThan": 100}}, "Expiration": {"Days": 1}},
              {"ID": "off", "Status": "Disabled", "Filter": {"Prefix": "keep/"}, "Expiration": {"Days": 1}},
              {"ID": "uploads", "Status": "Enabled", "Filter": {"Prefix": "up/"},
               "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1}})
    for k in ("tmp/a", "tmp/b", "keep/a", "sized/small"):
        c.put_object(Bucket="plain", Key=k, Body=b"x")
    c.put_object(Bucket="plain", Key="sized/large", Body=b"x" * 200)
    c.put_object(Bucket="plain", Key="t/scratch", Body=b"x", Tagging="class=scratch")
    c.put_object(Bucket="plain", Key="t/kept", Body=b"x", Tagging="class=gold")
    up = c.create_multipart_upload(Bucket="plain", Key="up/big")["UploadId"]
    other = c.create_multipart_upload(Bucket="plain", Key="elsewhere/big")["UploadId"]
    want = ["keep/a", "sized/large", "t/kept"]
    wait_for("expiry", lambda: keys(c, "plain") == want, timeout=30)
    wait_for("abort", lambda: [u["UploadId"] for u in c.list_multipart_uploads(Bucket="plain").get("Uploads", [])] == [other],
             timeout=30)
    assert metric(srv, "tarn_lifecycle_expired_total") >= 4
    assert metric(srv, "tarn_lifecycle_uploads_aborted_total") == 1
    assert up != other

    # Keep the last 2 checkpoints: the pointer object's older versions go,
    # the newest two noncurrent stay.
    c.create_bucket(Bucket="runs")
    c.put_bucket_versioning(Bucket="runs", VersioningConfiguration={"Status": "Enabled"})
    put_rules(c, "runs", {"ID": "last-2", "Status": "Enabled", "Filter": {"Prefix": "ckpt/"},
                          "NoncurrentVersionExpiration": {"NoncurrentDays": 1, "NewerNoncurrentVersions": 2}})
    ids = [c.put_object(Bucket="runs", Key="ckpt/model.pt", Body=b"step %d" % i)["VersionId"] for i in range(6)]
    c.put_object(Bucket="runs", Key="other/x", Body=b"1")
    c.put_object(Bucket="runs", Key="other/x", Body=b"2")
    wait_for("noncurrent expiry", lambda: len(versions(c, "runs")[0]) == 5, timeout=30)
    vs, _ = versions(c, "runs")
    assert [v["VersionId"] for v in vs if v["Key"] == "ckpt/model.pt"] == ids[::-1][:3]
    assert c.get_object(Bucket="runs", Key="ckpt/model.pt")["Body"].read() == b"step 5"
    time.sleep(3 * DAY)
    assert len(versions(c, "runs")[0]) == 5

    # Current versions expire into delete markers; their noncurrent
    # versions and then the lone markers go too.
    c.create_bucket(Bucket="vexp")
    c.put_bucket_versioning(Bucket="vexp", VersioningConfiguration={"Status": "Enabled"})
    for k in ("a", "b"):
        c.put_object(Bucket="vexp", Key=k, Body=b"x")
    put_rules(c, "vexp", rule("current", Expiration={"Days": 1}))
    wait_for("delete markers", lambda: len(versions(c, "vexp")[1]) == 2, timeout=30)
    vs, markers = versions(c, "vexp")
    assert len(vs) == 2 and all(m["IsLatest"] for m in markers)
    time.sleep(2 * DAY)
    assert len(versions(c, "vexp")[1]) == 2, "one delete marker per key, never another"
    put_rules(c, "vexp", rule("noncurrent", NoncurrentVersionExpiration={"NoncurrentDays": 1}),
              {"ID": "markers", "Status": "Enabled", "Filter": {"Prefix": ""},
               "Expiration": {"ExpiredObjectDeleteMarker": True}})
    wait_for("everything gone", lambda: versions(c, "vexp") == ([], []), timeout=40)
    assert metric(srv, "tarn_lifecycle_delete_markers_removed_total") == 2
    c.delete_bucket(Bucket="vexp")


def test_one_scanner_per_bucket_in_a_cluster(tmp_path):
    """Every node runs the scanner; a lease lets one node at a time scan a
    bucket, once per interval: the passes all nodes made add up to about
    one per interval, and every object is expired once."""
    etcd, nodes = form(str(tmp_path), count=3, drives=2, data_shards=2, parity_shards=1, extra=FAST)
    try:
        c = nodes[0].client()
        c.create_bucket(Bucket="shared")
        c.put_bucket_versioning(Bucket="shared", VersioningConfiguration={"Status": "Enabled"})
        for i in range(30):
            nodes[i % 3].client().put_object(Bucket="shared", Key=f"tmp/{i:02d}", Body=b"x")
        nodes[1].client().put_object(Bucket="shared", Key="keep", Body=b"x")
        put_rules(nodes[2].client(), "shared",
                  {"ID": "tmp", "Status": "Enabled", "Filter": {"Prefix": "tmp/"}, "Expiration": {"Days": 1}})
        wait_for("expiry", lambda: keys(c, "shared") == ["keep"], timeout=60)
        before = sum(metric(n, "tarn_lifecycle_passes_total") for n in nodes)
        window = 8
        time.sleep(window)
        passes = sum(metric(n, "tarn_lifecycle_passes_total") for n in nodes) - before
        # One interval is 1 s; each node checks four times a second.
        assert 2 <= passes <= window + 3, passes
        expired = sum(metric(n, "tarn_lifecycle_expired_total") for n in nodes)
        assert expired == 30, expired
        _, markers = versions(c, "shared")
        assert len(markers) == 30
    finally:
        stop_all(etcd, nodes)
