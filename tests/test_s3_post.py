"""Browser form uploads, POST Object (issue 42): the signed policy's every
condition is checked (s3s), the key's `${filename}` is the uploaded file's
name (a POST to `form/${filename}` answered 204 and `form/a.txt` did not
exist), success_action_status and success_action_redirect answer as S3,
and the upload is judged as the PutObject it is: its key's permissions, its
ACL and encryption fields honoured or refused, never ignored."""

import urllib.parse
import xml.etree.ElementTree as ET

import botocore.exceptions
import pytest
import requests

from tarnproc import add_user

NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def post(c, bucket, key, body, name="a.txt", fields=None, conditions=None, expires=60, tamper=None):
    p = c.generate_presigned_post(Bucket=bucket, Key=key, Fields=fields, Conditions=conditions, ExpiresIn=expires)
    form = dict(p["fields"])
    if tamper:
        tamper(form)
    return requests.post(p["url"], data=form, files={"file": (name, body)}, allow_redirects=False, timeout=30)


def code(r):
    return ET.fromstring(r.content).find("Code").text


def test_form_uploads(server, s3):
    s3.create_bucket(Bucket="forms")
    starts = [["starts-with", "$key", "form/"]]
    r = post(s3, "forms", "form/${filename}", b"hello", conditions=starts)
    assert r.status_code == 204, r.text
    assert s3.get_object(Bucket="forms", Key="form/a.txt")["Body"].read() == b"hello"
    with pytest.raises(botocore.exceptions.ClientError):
        s3.head_object(Bucket="forms", Key="form/${filename}")
    # 201: the body names the key written.
    r = post(s3, "forms", "form/${filename}", b"two", name="b & c.txt",
             fields={"success_action_status": "201"},
             conditions=[*starts, {"success_action_status": "201"}])
    assert r.status_code == 201, r.text
    doc = ET.fromstring(r.content)
    assert doc.find("Key").text == "form/b & c.txt"
    assert doc.find("Bucket").text == "forms"
    assert doc.find("ETag").text.strip('"') == s3.head_object(Bucket="forms", Key="form/b & c.txt")["ETag"].strip('"')
    # 303 to the redirect, with bucket, key and ETag.
    r = post(s3, "forms", "form/${filename}", b"three", name="d.txt",
             fields={"success_action_redirect": "https://app.example/done?x=1"},
             conditions=[*starts, {"success_action_redirect": "https://app.example/done?x=1"}])
    assert r.status_code == 303, r.text
    q = urllib.parse.parse_qs(urllib.parse.urlparse(r.headers["Location"]).query)
    assert q["key"] == ["form/d.txt"] and q["bucket"] == ["forms"] and q["x"] == ["1"]
    assert s3.get_object(Bucket="forms", Key="form/d.txt")["Body"].read() == b"three"
    # A plain key.
    assert post(s3, "forms", "plain.bin", b"p").status_code == 204
    assert s3.get_object(Bucket="forms", Key="plain.bin")["Body"].read() == b"p"


def test_form_refusals(server, s3):
    s3.create_bucket(Bucket="forms")
    starts = [["starts-with", "$key", "form/"]]
    # Expired policy.
    r = post(s3, "forms", "form/x", b"x", conditions=starts, expires=-60)
    assert r.status_code == 403, r.text
    # content-length-range.
    r = post(s3, "forms", "form/x", b"x" * 100, conditions=[["content-length-range", 1, 10]])
    assert r.status_code == 400 and code(r) == "EntityTooLarge", r.text
    r = post(s3, "forms", "form/x", b"", conditions=[["content-length-range", 1, 10]])
    assert r.status_code == 400, r.text
    # Past the form limit (a form's file is held in memory): refused.
    r = post(s3, "forms", "form/x", b"x" * ((128 << 20) + 1))
    assert r.status_code == 400 and code(r) == "EntityTooLarge", r.text[:300]
    # A key outside starts-with.
    r = post(s3, "forms", "form/x", b"x", conditions=starts, tamper=lambda f: f.update(key="other/x"))
    assert r.status_code == 403, r.text
    # A field the policy does not name.
    r = post(s3, "forms", "form/x", b"x", tamper=lambda f: f.update({"x-amz-meta-extra": "1"}))
    assert r.status_code == 403, r.text
    # A wrong signature.
    def forge(f):
        name = "x-amz-signature" if "x-amz-signature" in f else "signature"
        f[name] = ("1" if f[name][0] == "0" else "0") + f[name][1:]

    r = post(s3, "forms", "form/x", b"x", tamper=forge)
    assert r.status_code == 403, r.text
    # ${filename} with a file part that has no name.
    r = post(s3, "forms", "form/${filename}", b"x", name="", conditions=starts)
    assert r.status_code == 400, r.text
    assert "Contents" not in s3.list_objects_v2(Bucket="forms")
    # Fields Tarn reads from a PUT's headers are not ignored in a form:
    # encryption is refused until supported, an ACL where ACLs are disabled
    # is refused.
    r = post(s3, "forms", "form/x", b"x", fields={"x-amz-server-side-encryption": "AES256"},
             conditions=[{"x-amz-server-side-encryption": "AES256"}])
    assert r.status_code == 501, r.text
    r = post(s3, "forms", "form/x", b"x", fields={"acl": "public-read"}, conditions=[{"acl": "public-read"}])
    assert r.status_code == 403, r.text
    r = post(s3, "forms", "form/x", b"x", fields={"x-amz-grant-read": 'id="root"'},
             conditions=[{"x-amz-grant-read": 'id="root"'}])
    assert r.status_code == 400 and code(r) == "AccessControlListNotSupported", r.text
    assert "Contents" not in s3.list_objects_v2(Bucket="forms")


@pytest.mark.parametrize("sig", ["s3v4", "s3"])
def test_both_signature_versions(server, sig):
    """Forms signed with SigV4 (x-amz-signature) and SigV2 (signature)."""
    c = server.client(signature_version=sig)
    c.create_bucket(Bucket="sigs")
    fields = c.generate_presigned_post(Bucket="sigs", Key="k")["fields"]
    assert ("x-amz-signature" in fields) == (sig == "s3v4")
    assert post(c, "sigs", "up/${filename}", b"v", name="f.bin").status_code == 204
    assert c.get_object(Bucket="sigs", Key="up/f.bin")["Body"].read() == b"v"


def test_a_form_is_judged_by_its_key(server, s3):
    """The permission is the PutObject of the key the form writes (with
    the file's name in place): a user allowed `uploads/*` only may post
    there and nowhere else."""
    erin = add_user(server, "erin")
    e = server.client(erin)
    s3.create_bucket(Bucket="shared")
    s3.put_bucket_policy(Bucket="shared", Policy=(
        '{"Statement": [{"Effect": "Allow", "Principal": {"AWS": ["erin"]}, "Action": "s3:PutObject",'
        ' "Resource": "arn:aws:s3:::shared/uploads/*"}]}'))
    assert post(e, "shared", "uploads/${filename}", b"ok", name="e.txt").status_code == 204
    assert s3.get_object(Bucket="shared", Key="uploads/e.txt")["Body"].read() == b"ok"
    r = post(e, "shared", "private/${filename}", b"no", name="e.txt")
    assert r.status_code == 403 and code(r) == "AccessDenied", r.text
    r = post(e, "shared", "${filename}", b"no", name="e.txt")
    assert r.status_code == 403, r.text
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="shared")["Contents"]]
    assert keys == ["uploads/e.txt"]
