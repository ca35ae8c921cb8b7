"""Permissions (issue 13, last part): bucket ownership, bucket policies, ACLs,
the public access block and object ownership controls, checked on every S3
path: reads, listings, writes, deletes, copies (their sources too),
multipart, presigned URLs, DeleteObjects key by key.

Before: every user could read, list, overwrite and delete every other user's
buckets; anonymous requests were refused whatever a bucket said; ACL headers
were refused with 501 and no policy could be set."""

import hashlib
import json
import os
import subprocess
import sys

import boto3
import botocore
import botocore.config
import botocore.exceptions
import pytest
import requests

from tarnproc import add_user, admin

CFG = botocore.config.Config(retries={"max_attempts": 1}, s3={"addressing_style": "path"})


def client(server, key):
    return server.client(key, s3={"addressing_style": "path"})


def anonymous(server):
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        region_name="us-east-1",
        config=CFG.merge(botocore.config.Config(signature_version=botocore.UNSIGNED)),
    )


def fails(call, code="AccessDenied"):
    with pytest.raises(botocore.exceptions.ClientError) as e:
        call()
    assert e.value.response["Error"]["Code"] == code, e.value.response
    return e.value.response


def read(c, bucket, key):
    return c.get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.fixture
def team(server, s3):
    """alice owns bucket `aaa` with objects; bob owns bucket `bbb`."""
    alice, bob = add_user(server, "alice"), add_user(server, "bob")
    a, b = client(server, alice), client(server, bob)
    a.create_bucket(Bucket="aaa")
    a.put_object(Bucket="aaa", Key="doc.txt", Body=b"alice's")
    a.put_object(Bucket="aaa", Key="pub/x", Body=b"public part")
    b.create_bucket(Bucket="bbb")
    return a, b, alice, bob


def bob_is_locked_out(a, b):
    fails(lambda: read(b, "aaa", "doc.txt"))
    fails(lambda: b.head_object(Bucket="aaa", Key="doc.txt"), "403")
    fails(lambda: b.list_objects_v2(Bucket="aaa"))
    fails(lambda: b.put_object(Bucket="aaa", Key="new", Body=b"bob's"))
    fails(lambda: b.delete_object(Bucket="aaa", Key="doc.txt"))
    fails(lambda: b.copy_object(Bucket="bbb", Key="stolen", CopySource="aaa/doc.txt"))
    fails(lambda: b.create_multipart_upload(Bucket="aaa", Key="mp"))
    fails(lambda: b.get_bucket_policy(Bucket="aaa"))
    fails(lambda: b.delete_bucket(Bucket="aaa"))
    fails(lambda: b.get_bucket_acl(Bucket="aaa"))
    r = b.delete_objects(Bucket="aaa", Delete={"Objects": [{"Key": "doc.txt"}]})
    assert [e["Code"] for e in r["Errors"]] == ["AccessDenied"]
    assert read(a, "aaa", "doc.txt") == b"alice's"
    assert {"doc.txt", "pub/x"} <= {o["Key"] for o in a.list_objects_v2(Bucket="aaa")["Contents"]}


def test_another_users_bucket_is_closed_until_a_policy_grants(server, s3, team):
    """Bug: any user could read, list, write, delete and copy from any other
    user's bucket."""
    a, b, alice, bob = team
    bob_is_locked_out(a, b)
    # Each user lists only its own buckets; root sees all.
    assert [x["Name"] for x in b.list_buckets()["Buckets"]] == ["bbb"]
    assert [x["Name"] for x in a.list_buckets()["Buckets"]] == ["aaa"]
    assert {x["Name"] for x in s3.list_buckets()["Buckets"]} >= {"aaa", "bbb"}
    # Another's bucket name is taken, not "yours".
    fails(lambda: b.create_bucket(Bucket="aaa"), "BucketAlreadyExists")
    a.create_bucket(Bucket="aaa")  # the owner: 200 in us-east-1
    # ... but not when it asks for settings the bucket does not have.
    fails(lambda: a.create_bucket(Bucket="aaa", ObjectOwnership="ObjectWriter"), "BucketAlreadyOwnedByYou")
    assert a.get_bucket_ownership_controls(Bucket="aaa")["OwnershipControls"]["Rules"] == [
        {"ObjectOwnership": "BucketOwnerEnforced"}
    ]

    # A policy lets bob read and list, and nothing else.
    policy = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"AWS": ["arn:aws:iam::000000000000:user/bob"]},
                "Action": ["s3:GetObject", "s3:ListBucket"],
                "Resource": ["arn:aws:s3:::aaa", "arn:aws:s3:::aaa/*"],
            }
        ],
    }
    a.put_bucket_policy(Bucket="aaa", Policy=json.dumps(policy))
    assert json.loads(a.get_bucket_policy(Bucket="aaa")["Policy"]) == policy
    assert a.get_bucket_policy_status(Bucket="aaa")["PolicyStatus"]["IsPublic"] is False
    assert read(b, "aaa", "doc.txt") == b"alice's"
    assert b.head_object(Bucket="aaa", Key="doc.txt")["ContentLength"] == 7
    assert [o["Key"] for o in b.list_objects_v2(Bucket="aaa")["Contents"]] == ["doc.txt", "pub/x"]
    b.copy_object(Bucket="bbb", Key="copied", CopySource="aaa/doc.txt")
    assert read(b, "bbb", "copied") == b"alice's"
    fails(lambda: b.put_object(Bucket="aaa", Key="new", Body=b"bob's"))
    fails(lambda: b.delete_object(Bucket="aaa", Key="doc.txt"))
    fails(lambda: b.copy_object(Bucket="aaa", Key="into-a", CopySource="bbb/copied"))
    # The policy does not reach other users.
    carol = client(server, add_user(server, "carol"))
    fails(lambda: read(carol, "aaa", "doc.txt"))

    # Presigned URLs carry the signer's permissions.
    url_b = b.generate_presigned_url("get_object", Params={"Bucket": "aaa", "Key": "doc.txt"})
    url_c = carol.generate_presigned_url("get_object", Params={"Bucket": "aaa", "Key": "doc.txt"})
    put_c = carol.generate_presigned_url("put_object", Params={"Bucket": "aaa", "Key": "evil"})
    assert requests.get(url_b).content == b"alice's"
    assert requests.get(url_c).status_code == 403
    assert requests.put(put_c, data=b"x").status_code == 403

    # An explicit Deny wins over the Allow; the owner keeps control of the policy.
    policy["Statement"].append(
        {"Effect": "Deny", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::aaa/doc.txt"}
    )
    a.put_bucket_policy(Bucket="aaa", Policy=json.dumps(policy))
    fails(lambda: read(b, "aaa", "doc.txt"))
    fails(lambda: read(a, "aaa", "doc.txt"))
    assert read(b, "aaa", "pub/x") == b"public part"
    assert read(s3, "aaa", "doc.txt") == b"alice's"  # root administers everything

    # Write and delete, limited to a prefix, key by key in DeleteObjects.
    policy["Statement"] = [
        {
            "Effect": "Allow",
            "Principal": {"AWS": "bob"},
            "Action": ["s3:PutObject", "s3:DeleteObject"],
            "Resource": "arn:aws:s3:::aaa/pub/*",
        }
    ]
    a.put_bucket_policy(Bucket="aaa", Policy=json.dumps(policy))
    b.put_object(Bucket="aaa", Key="pub/from-bob", Body=b"bob's")
    up = b.create_multipart_upload(Bucket="aaa", Key="pub/mp")
    part = b.upload_part(Bucket="aaa", Key="pub/mp", UploadId=up["UploadId"], PartNumber=1, Body=b"p" * 100)
    b.complete_multipart_upload(
        Bucket="aaa",
        Key="pub/mp",
        UploadId=up["UploadId"],
        MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": part["ETag"]}]},
    )
    r = b.delete_objects(Bucket="aaa", Delete={"Objects": [{"Key": "pub/from-bob"}, {"Key": "doc.txt"}]})
    assert [d["Key"] for d in r["Deleted"]] == ["pub/from-bob"]
    assert [(e["Key"], e["Code"]) for e in r["Errors"]] == [("doc.txt", "AccessDenied")]
    assert read(a, "aaa", "doc.txt") == b"alice's"
    assert read(a, "aaa", "pub/mp") == b"p" * 100

    # Without the policy bob is out again, and the settings survive a restart.
    a.put_bucket_policy(Bucket="aaa", Policy=json.dumps(policy))
    server.stop()
    server.start()
    a, b = client(server, alice), client(server, bob)
    b.put_object(Bucket="aaa", Key="pub/after-restart", Body=b"x")
    a.delete_bucket_policy(Bucket="aaa")
    fails(lambda: a.get_bucket_policy(Bucket="aaa"), "NoSuchBucketPolicy")
    bob_is_locked_out(a, b)


def test_anonymous_is_denied_until_a_public_read_policy(server, team):
    """Bug: anonymous requests could not be allowed at all (no policy), so
    a public dataset needed a shared secret key."""
    a, b, alice, bob = team
    anon = anonymous(server)
    fails(lambda: read(anon, "aaa", "pub/x"))
    fails(lambda: anon.list_objects_v2(Bucket="aaa"))
    fails(lambda: anon.list_buckets())
    assert requests.get(f"{server.endpoint}/aaa/pub/x").status_code == 403
    public = {
        "Version": "2012-10-17",
        "Statement": [
            {"Sid": "PublicRead", "Effect": "Allow", "Principal": "*", "Action": "s3:GetObject",
             "Resource": "arn:aws:s3:::aaa/pub/*"}
        ],
    }  # fmt: skip
    # New buckets block public policies, as on AWS.
    assert a.get_public_access_block(Bucket="aaa")["PublicAccessBlockConfiguration"] == {
        "BlockPublicAcls": True,
        "IgnorePublicAcls": True,
        "BlockPublicPolicy": True,
        "RestrictPublicBuckets": True,
    }
    fails(lambda: a.put_bucket_policy(Bucket="aaa", Policy=json.dumps(public)))
    fails(lambda: a.get_bucket_policy(Bucket="aaa"), "NoSuchBucketPolicy")
    a.delete_public_access_block(Bucket="aaa")
    fails(lambda: a.get_public_access_block(Bucket="aaa"), "NoSuchPublicAccessBlockConfiguration")
    a.put_bucket_policy(Bucket="aaa", Policy=json.dumps(public))
    assert a.get_bucket_policy_status(Bucket="aaa")["PolicyStatus"]["IsPublic"] is True
    assert read(anon, "aaa", "pub/x") == b"public part"
    assert requests.get(f"{server.endpoint}/aaa/pub/x").content == b"public part"
    # Only what the policy names.
    fails(lambda: read(anon, "aaa", "doc.txt"))
    fails(lambda: anon.list_objects_v2(Bucket="aaa"))
    fails(lambda: anon.put_object(Bucket="aaa", Key="pub/y", Body=b"x"))
    fails(lambda: anon.delete_object(Bucket="aaa", Key="pub/x"))
    assert requests.put(f"{server.endpoint}/aaa/pub/y", data=b"x").status_code == 403
    # A policy pinned to an address range that is not loopback is not public
    # and does not reach this client.
    pinned = dict(public)
    pinned["Statement"] = [dict(public["Statement"][0], Condition={"IpAddress": {"aws:SourceIp": "10.0.0.0/8"}})]
    a.put_bucket_policy(Bucket="aaa", Policy=json.dumps(pinned))
    assert a.get_bucket_policy_status(Bucket="aaa")["PolicyStatus"]["IsPublic"] is False
    fails(lambda: read(anon, "aaa", "pub/x"))
    pinned["Statement"][0]["Condition"] = {"IpAddress": {"aws:SourceIp": "127.0.0.0/8"}}
    a.put_bucket_policy(Bucket="aaa", Policy=json.dumps(pinned))
    assert read(anon, "aaa", "pub/x") == b"public part"
    # RestrictPublicBuckets turns public grants off again without removing them.
    a.put_bucket_policy(Bucket="aaa", Policy=json.dumps(public))
    a.put_public_access_block(Bucket="aaa", PublicAccessBlockConfiguration={"RestrictPublicBuckets": True})
    fails(lambda: read(anon, "aaa", "pub/x"))
    fails(lambda: read(b, "aaa", "pub/x"))
    assert read(a, "aaa", "pub/x") == b"public part"


def test_acls_grant_exactly_what_they_name(server, team):
    """Bug: `x-amz-acl` and `x-amz-grant-*` were refused (501) and
    Get/PutBucketAcl and Get/PutObjectAcl did not exist."""
    a, b, alice, bob = team
    anon = anonymous(server)
    # ACLs are disabled by default (BucketOwnerEnforced), as on AWS.
    assert a.get_bucket_ownership_controls(Bucket="aaa")["OwnershipControls"]["Rules"] == [
        {"ObjectOwnership": "BucketOwnerEnforced"}
    ]
    # (A public ACL meets the public access block first: 403, as AWS.)
    fails(lambda: a.put_object(Bucket="aaa", Key="k", Body=b"x", ACL="public-read"))
    fails(lambda: a.put_object(Bucket="aaa", Key="k", Body=b"x", GrantRead="id=bob"), "AccessControlListNotSupported")
    fails(lambda: a.put_bucket_acl(Bucket="aaa", GrantRead="id=bob"), "AccessControlListNotSupported")
    a.put_object(Bucket="aaa", Key="k", Body=b"x", ACL="bucket-owner-full-control")  # what it is anyway
    acl = a.get_object_acl(Bucket="aaa", Key="k")
    assert acl["Owner"]["ID"] == "alice"
    assert [(g["Grantee"].get("ID"), g["Permission"]) for g in acl["Grants"]] == [("alice", "FULL_CONTROL")]
    fails(lambda: a.create_bucket(Bucket="pub", ACL="public-read"), "InvalidBucketAclWithObjectOwnership")

    # A bucket with ACLs on.
    a.create_bucket(Bucket="acls", ObjectOwnership="ObjectWriter")
    a.put_object(Bucket="acls", Key="private", Body=b"private")
    a.put_object(Bucket="acls", Key="for-bob", Body=b"for bob", GrantRead="id=bob")
    fails(lambda: b.list_objects_v2(Bucket="acls"))
    assert read(b, "acls", "for-bob") == b"for bob"
    fails(lambda: read(b, "acls", "private"))
    fails(lambda: b.get_object_acl(Bucket="acls", Key="for-bob"))
    # Bucket READ lets bob list, not read objects; WRITE lets him write.
    a.put_bucket_acl(Bucket="acls", GrantRead="id=bob", GrantWrite="id=bob", GrantFullControl="id=alice")
    grants = a.get_bucket_acl(Bucket="acls")["Grants"]
    assert sorted((g["Grantee"]["ID"], g["Permission"]) for g in grants) == [
        ("alice", "FULL_CONTROL"),
        ("bob", "READ"),
        ("bob", "WRITE"),
    ]
    assert [o["Key"] for o in b.list_objects_v2(Bucket="acls")["Contents"]] == ["for-bob", "private"]
    fails(lambda: read(b, "acls", "private"))
    b.put_object(Bucket="acls", Key="bobs", Body=b"bob wrote")
    # ObjectWriter: bob owns what he wrote; alice reads it only when granted.
    assert b.get_object_acl(Bucket="acls", Key="bobs")["Owner"]["ID"] == "bob"
    fails(lambda: read(a, "acls", "bobs"))
    b.put_object_acl(Bucket="acls", Key="bobs", ACL="bucket-owner-read")
    assert read(a, "acls", "bobs") == b"bob wrote"
    # A copy gets the request's ACL, never the source's.
    a.copy_object(Bucket="acls", Key="copy", CopySource="acls/for-bob")
    fails(lambda: read(b, "acls", "copy"))
    # Public ACLs are blocked until the public access block allows them.
    fails(lambda: a.put_object_acl(Bucket="acls", Key="private", ACL="public-read"))
    a.delete_public_access_block(Bucket="acls")
    a.put_object_acl(Bucket="acls", Key="private", ACL="public-read")
    assert read(anon, "acls", "private") == b"private"
    fails(lambda: read(anon, "acls", "for-bob"))
    # IgnorePublicAcls turns them off without removing them.
    a.put_public_access_block(Bucket="acls", PublicAccessBlockConfiguration={"IgnorePublicAcls": True})
    fails(lambda: read(anon, "acls", "private"))
    # Enforcing bucket ownership needs an owner-only bucket ACL.
    fails(
        lambda: a.put_bucket_ownership_controls(
            Bucket="acls", OwnershipControls={"Rules": [{"ObjectOwnership": "BucketOwnerEnforced"}]}
        ),
        "InvalidBucketAclWithObjectOwnership",
    )
    a.put_bucket_acl(Bucket="acls", ACL="private")
    a.put_bucket_ownership_controls(
        Bucket="acls", OwnershipControls={"Rules": [{"ObjectOwnership": "BucketOwnerEnforced"}]}
    )
    # Now object ACLs count for nothing: bob loses his grant.
    fails(lambda: read(b, "acls", "for-bob"))
    assert read(a, "acls", "bobs") == b"bob wrote"


def test_malformed_policies_and_acls_change_nothing(server, team):
    """Bad input gets MalformedPolicy / MalformedACLError and the stored
    settings stay as they were."""
    a, b, alice, bob = team
    good = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"AWS": "bob"}, "Action": "s3:GetObject",
                       "Resource": "arn:aws:s3:::aaa/*"}],
    }  # fmt: skip
    a.put_bucket_policy(Bucket="aaa", Policy=json.dumps(good))
    bad = [
        "{not json",
        json.dumps({"Statement": []}),
        json.dumps(dict(good, Statement=[dict(good["Statement"][0], Resource="arn:aws:s3:::bbb/*")])),
        json.dumps(dict(good, Statement=[dict(good["Statement"][0], Principal={"AWS": "nobody"})])),
        json.dumps(dict(good, Statement=[dict(good["Statement"][0], Action="iam:PassRole")])),
        json.dumps(
            dict(good, Statement=[dict(good["Statement"][0], Condition={"StringEquals": {"aws:Unknown": "x"}})])
        ),
        json.dumps(dict(good, Id="x" * 21000)),
    ]
    for text in bad:
        fails(lambda: a.put_bucket_policy(Bucket="aaa", Policy=text), "MalformedPolicy")
    assert json.loads(a.get_bucket_policy(Bucket="aaa")["Policy"]) == good
    assert read(b, "aaa", "doc.txt") == b"alice's"
    a.create_bucket(Bucket="acls", ObjectOwnership="BucketOwnerPreferred")
    resp = requests.put(
        f"{server.endpoint}/acls?acl",
        data=b"<AccessControlPolicy><Owner><ID>alice",
        auth=None,
    )
    assert resp.status_code == 403  # unsigned: nobody may change it
    # A signed malformed body: send it through botocore's signer.
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    def signed_put(body):
        req = AWSRequest(method="PUT", url=f"{server.endpoint}/acls?acl", data=body)
        req.headers["x-amz-content-sha256"] = hashlib.sha256(body).hexdigest()
        SigV4Auth(Credentials(alice["access_key"], alice["secret_key"]), "s3", "us-east-1").add_auth(req)
        return requests.put(req.url, data=body, headers=dict(req.headers))

    r = signed_put(b"<AccessControlPolicy><Owner><ID>alice")
    assert r.status_code == 400 and b"<Code>MalformedACLError</Code>" in r.content, r.content
    too_many = "".join(
        '<Grant><Grantee xmlns:xsi="http://www.w3.org/2001/XMLSchema-instance" xsi:type="CanonicalUser">'
        "<ID>bob</ID></Grantee><Permission>READ</Permission></Grant>"
        for _ in range(101)
    )
    r = signed_put(
        f'<AccessControlPolicy xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Owner><ID>alice</ID></Owner>'
        f"<AccessControlList>{too_many}</AccessControlList></AccessControlPolicy>".encode()
    )
    assert r.status_code == 400 and b"MalformedACLError" in r.content, r.content
    fails(lambda: a.put_bucket_acl(Bucket="acls", GrantRead="id=nobody"), "InvalidArgument")
    fails(lambda: a.put_bucket_acl(Bucket="acls", GrantRead='emailAddress="x@y"'), "UnresolvableGrantByEmailAddress")
    assert [(g["Grantee"]["ID"], g["Permission"]) for g in a.get_bucket_acl(Bucket="acls")["Grants"]] == [
        ("alice", "FULL_CONTROL")
    ]
    fails(lambda: b.list_objects_v2(Bucket="acls"))
    # A policy naming a user removed since does not block other changes.
    admin(server, "user", "remove", "bob")
    a.put_public_access_block(Bucket="aaa", PublicAccessBlockConfiguration={"BlockPublicAcls": True})
    assert json.loads(a.get_bucket_policy(Bucket="aaa")["Policy"]) == good


def aws(server, key, *args):
    env = dict(
        os.environ,
        AWS_ACCESS_KEY_ID=key["access_key"],
        AWS_SECRET_ACCESS_KEY=key["secret_key"],
        AWS_DEFAULT_REGION="us-east-1",
        AWS_CONFIG_FILE="/dev/null",
        AWS_SHARED_CREDENTIALS_FILE="/dev/null",
    )
    cmd = [os.path.join(os.path.dirname(sys.executable), "aws"), "--endpoint-url", server.endpoint, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_aws_cli_under_two_users(server, team, tmp_path):
    """The aws CLI as bob: denied on alice's bucket until her policy grants,
    allowed exactly then."""
    a, b, alice, bob = team
    dst = tmp_path / "got"
    r = aws(server, bob, "s3", "cp", "s3://aaa/doc.txt", str(dst))
    assert r.returncode != 0 and "403" in r.stderr
    r = aws(server, bob, "s3", "ls", "s3://aaa/")
    assert r.returncode != 0 and "AccessDenied" in r.stderr
    policy = aws(
        server,
        alice,
        "s3api",
        "put-bucket-policy",
        "--bucket",
        "aaa",
        "--policy",
        json.dumps(
            {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Principal": {"AWS": "bob"},
                               "Action": ["s3:GetObject", "s3:ListBucket"],
                               "Resource": ["arn:aws:s3:::aaa", "arn:aws:s3:::aaa/*"]}],
            }  # fmt: skip
        ),
    )
    assert policy.returncode == 0, policy.stderr
    r = aws(server, bob, "s3", "cp", "s3://aaa/doc.txt", str(dst))
    assert r.returncode == 0, r.stderr
    assert dst.read_bytes() == b"alice's"
    assert "doc.txt" in aws(server, bob, "s3", "ls", "s3://aaa/").stdout
    (tmp_path / "up").write_bytes(b"bob's")
    r = aws(server, bob, "s3", "cp", str(tmp_path / "up"), "s3://aaa/up")
    assert r.returncode != 0 and "AccessDenied" in r.stderr


def test_reads_of_missing_keys_reveal_nothing_without_list(server, team):
    """Bug (issue 42): on a bucket with ACLs a GET or HEAD of a missing key
    answered 404 to anyone and of an existing key 403, which told strangers
    which keys exist. As on AWS, a caller who may not list the bucket
    (s3:ListBucket, or READ on the bucket's ACL) hears 403 for both; one who
    may list hears 404."""
    a, b, alice, bob = team
    anon = anonymous(server)
    a.create_bucket(Bucket="acls", ObjectOwnership="ObjectWriter")
    a.delete_public_access_block(Bucket="acls")
    a.put_object(Bucket="acls", Key="secret", Body=b"s")
    a.put_object(Bucket="acls", Key="open", Body=b"o", ACL="public-read")
    for who in (anon, b):
        assert read(who, "acls", "open") == b"o"
        for key in ("secret", "missing"):
            fails(lambda: read(who, "acls", key))
            fails(lambda: who.head_object(Bucket="acls", Key=key), "403")
            fails(lambda: who.get_object_attributes(Bucket="acls", Key=key, ObjectAttributes=["ETag"]))
    # A bucket ACL that lets everyone list: the missing key is 404 again.
    a.put_bucket_acl(Bucket="acls", ACL="public-read")
    for who in (anon, b):
        fails(lambda: read(who, "acls", "missing"), "NoSuchKey")
        fails(lambda: who.head_object(Bucket="acls", Key="missing"), "404")
        fails(lambda: read(who, "acls", "secret"))
    # Policies the same: GetObject alone hides absence, ListBucket shows it.
    grant = lambda actions, res: json.dumps({"Statement": [
        {"Effect": "Allow", "Principal": {"AWS": ["bob"]}, "Action": a_, "Resource": r}
        for a_, r in zip(actions, res)]})
    a.put_bucket_policy(Bucket="aaa", Policy=grant(["s3:GetObject"], ["arn:aws:s3:::aaa/*"]))
    assert read(b, "aaa", "doc.txt") == b"alice's"
    fails(lambda: read(b, "aaa", "missing"))
    fails(lambda: b.head_object(Bucket="aaa", Key="missing"), "403")
    a.put_bucket_policy(Bucket="aaa", Policy=grant(["s3:GetObject", "s3:ListBucket"],
                                                   ["arn:aws:s3:::aaa/*", "arn:aws:s3:::aaa"]))
    fails(lambda: read(b, "aaa", "missing"), "NoSuchKey")
    fails(lambda: b.head_object(Bucket="aaa", Key="missing"), "404")
    # The owner (and root) always hear 404.
    fails(lambda: read(a, "aaa", "missing"), "NoSuchKey")


def test_acl_answers_as_aws(server, team):
    """Bugs (issue 42): PutBucketAcl on a bucket whose ACLs are disabled
    answered 200 to an ACL of no grants or `private` and changed nothing
    (AWS: 400 AccessControlListNotSupported, ACLs cannot be set there);
    recreating one's own bucket with an ACL was 400 (AWS: 409
    BucketAlreadyOwnedByYou); a public ACL under BlockPublicAcls was 400
    where the bucket also disabled ACLs (AWS: 403, the block decides
    first). Grants come back in the order S3 gives them; GetBucketPolicyStatus
    without a policy is 404 NoSuchBucketPolicy, as AWS answers."""
    a, b, alice, bob = team
    owner = {"ID": "alice", "DisplayName": "alice"}
    # ACLs disabled (the default): setting any ACL is refused.
    fails(lambda: a.put_bucket_acl(Bucket="aaa", ACL="private"), "AccessControlListNotSupported")
    fails(lambda: a.put_bucket_acl(Bucket="aaa", AccessControlPolicy={"Owner": owner, "Grants": []}),
          "AccessControlListNotSupported")
    fails(lambda: a.put_object_acl(Bucket="aaa", Key="doc.txt", ACL="private"), "AccessControlListNotSupported")
    a.put_object_acl(Bucket="aaa", Key="doc.txt", ACL="bucket-owner-full-control")
    acl = a.get_bucket_acl(Bucket="aaa")
    assert acl["Grants"] == [{"Grantee": {**owner, "Type": "CanonicalUser"}, "Permission": "FULL_CONTROL"}]
    # Public ACLs meet the public access block first: 403.
    fails(lambda: a.put_bucket_acl(Bucket="aaa", ACL="public-read"))
    fails(lambda: a.put_object(Bucket="aaa", Key="p", Body=b"x", ACL="public-read"))
    fails(lambda: a.put_object_acl(Bucket="aaa", Key="doc.txt", ACL="public-read"))
    # One's own bucket again, with an ACL: 409, unchanged.
    fails(lambda: a.create_bucket(Bucket="aaa", ACL="public-read"), "BucketAlreadyOwnedByYou")
    fails(lambda: a.create_bucket(Bucket="aaa", GrantRead='id="bob"'), "BucketAlreadyOwnedByYou")
    a.create_bucket(Bucket="aaa")  # us-east-1: 200 for the same bucket
    fails(lambda: b.create_bucket(Bucket="aaa"), "BucketAlreadyExists")
    # An ACL bucket: an ACL of no grants is stored as given.
    a.create_bucket(Bucket="oww", ObjectOwnership="ObjectWriter")
    a.delete_public_access_block(Bucket="oww")
    a.put_bucket_acl(Bucket="oww", AccessControlPolicy={"Owner": owner, "Grants": []})
    assert a.get_bucket_acl(Bucket="oww").get("Grants", []) == []
    a.put_bucket_acl(Bucket="oww", ACL="public-read-write")
    grants = [(g["Grantee"].get("ID") or g["Grantee"]["URI"].rsplit("/", 1)[1], g["Permission"])
              for g in a.get_bucket_acl(Bucket="oww")["Grants"]]
    assert grants == [("alice", "FULL_CONTROL"), ("AllUsers", "READ"), ("AllUsers", "WRITE")]
    a.put_bucket_acl(Bucket="oww", GrantFullControl='id="alice"', GrantRead='id="bob"', GrantWriteACP='id="bob"')
    grants = [(g["Grantee"]["ID"], g["Permission"]) for g in a.get_bucket_acl(Bucket="oww")["Grants"]]
    assert grants == [("bob", "READ"), ("bob", "WRITE_ACP"), ("alice", "FULL_CONTROL")]
    fails(lambda: a.get_bucket_policy_status(Bucket="oww"), "NoSuchBucketPolicy")


def test_policy_condition_keys_aws_documents(server, team):
    """Bug (issue 42): condition keys AWS documents for S3 were
    MalformedPolicy. Header keys (s3:if-none-match, s3:RequestObjectTag/K,
    object lock, SSE key ids) are evaluated from the request,
    aws:RequestedRegion from the signature, s3:signatureAge from its date;
    keys no request to Tarn carries (VPC endpoints, organizations, MFA)
    hold as AWS's do for a request without them."""
    a, b, alice, bob = team

    def policy(*statements):
        a.put_bucket_policy(Bucket="aaa", Policy=json.dumps({"Version": "2012-10-17", "Statement": list(statements)}))

    allow_bob = {"Effect": "Allow", "Principal": {"AWS": ["bob"]}, "Action": ["s3:PutObject", "s3:GetObject"],
                 "Resource": "arn:aws:s3:::aaa/*"}
    # AWS's recipe "enforce conditional writes": PUTs without If-None-Match denied.
    policy(allow_bob, {"Effect": "Deny", "Principal": "*", "Action": "s3:PutObject", "Resource": "arn:aws:s3:::aaa/*",
                       "Condition": {"Null": {"s3:if-none-match": "true"}}})
    fails(lambda: b.put_object(Bucket="aaa", Key="c1", Body=b"x"))
    b.put_object(Bucket="aaa", Key="c1", Body=b"x", IfNoneMatch="*")
    # Tags on the request.
    policy({**allow_bob, "Action": "s3:PutObject",
            "Condition": {"StringEquals": {"s3:RequestObjectTag/team": "ml"}}})
    fails(lambda: b.put_object(Bucket="aaa", Key="t1", Body=b"x"))
    fails(lambda: b.put_object(Bucket="aaa", Key="t1", Body=b"x", Tagging="team=web"))
    b.put_object(Bucket="aaa", Key="t1", Body=b"x", Tagging="team=ml")
    # The signature's region, and its age.
    policy({**allow_bob, "Condition": {"StringEquals": {"aws:RequestedRegion": "us-east-1"},
                                       "NumericLessThan": {"s3:signatureAge": 600000}}})
    b.put_object(Bucket="aaa", Key="r1", Body=b"x")
    policy({**allow_bob, "Condition": {"StringEquals": {"aws:RequestedRegion": "eu-west-1"}}})
    fails(lambda: b.put_object(Bucket="aaa", Key="r2", Body=b"x"))
    # "Only through my VPC endpoint": no request to Tarn comes through one,
    # so the deny holds for every request (as on AWS for one without it),
    # and an allow on it never applies.
    policy(allow_bob, {"Effect": "Deny", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::aaa/*",
                       "Condition": {"StringNotEquals": {"aws:SourceVpce": "vpce-1a2b3c4d"}}})
    fails(lambda: read(b, "aaa", "t1"))
    policy({**allow_bob, "Condition": {"Bool": {"aws:MultiFactorAuthPresent": "true"}}})
    fails(lambda: read(b, "aaa", "t1"))
    # Keys Tarn cannot evaluate yet are still refused, never ignored.
    bad = json.dumps({"Statement": [{**allow_bob, "Condition": {"StringEquals": {"aws:ResourceTag/x": "y"}}}]})
    fails(lambda: a.put_bucket_policy(Bucket="aaa", Policy=bad), "MalformedPolicy")


def test_tag_and_principal_condition_keys(server):
    """s3:ExistingObjectTag/KEY (the object's tags as stored),
    s3:RequestObjectTagKeys (a set: ForAllValues / ForAnyValue) and
    aws:PrincipalArn, which once answered MalformedPolicy."""
    s3 = server.client()
    s3.create_bucket(Bucket="tagged")
    dana = client(server, add_user(server, "dana"))
    s3.put_object(Bucket="tagged", Key="open", Body=b"o", Tagging="class=public")
    s3.put_object(Bucket="tagged", Key="closed", Body=b"c", Tagging="class=secret")
    policy = {"Version": "2012-10-17", "Statement": [
        {"Effect": "Allow", "Principal": {"AWS": "dana"}, "Action": "s3:GetObject", "Resource": "arn:aws:s3:::tagged/*",
         "Condition": {"StringEquals": {"s3:ExistingObjectTag/class": "public"}}},
        {"Effect": "Allow", "Principal": {"AWS": "dana"}, "Action": "s3:PutObject", "Resource": "arn:aws:s3:::tagged/*",
         "Condition": {"ForAllValues:StringEquals": {"s3:RequestObjectTagKeys": ["team", "cost"]},
                       "StringLike": {"aws:PrincipalArn": "arn:aws:iam::*:user/dana"}}}]}
    s3.put_bucket_policy(Bucket="tagged", Policy=json.dumps(policy))
    assert read(dana, "tagged", "open") == b"o"
    fails(lambda: read(dana, "tagged", "closed"))
    # Retagged, the object follows its new tags.
    s3.put_object_tagging(Bucket="tagged", Key="closed", Tagging={"TagSet": [{"Key": "class", "Value": "public"}]})
    assert read(dana, "tagged", "closed") == b"c"
    dana.put_object(Bucket="tagged", Key="mine", Body=b"m", Tagging="team=ml&cost=42")
    dana.put_object(Bucket="tagged", Key="untagged", Body=b"u")
    fails(lambda: dana.put_object(Bucket="tagged", Key="x", Body=b"x", Tagging="team=ml&secret=1"))
    # Another user's ARN does not match.
    policy["Statement"][1]["Condition"]["StringLike"]["aws:PrincipalArn"] = "arn:aws:iam::*:user/erin"
    s3.put_bucket_policy(Bucket="tagged", Policy=json.dumps(policy))
    fails(lambda: dana.put_object(Bucket="tagged", Key="y", Body=b"y", Tagging="team=ml"))
