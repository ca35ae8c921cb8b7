"""S3 edge answers from the hardening issue (issue 12, item 7), each pinning a
defect of the previous build: the signing region was not checked; presigned
URLs valid for more than a week were accepted; a DeleteObjects with an
oversized key failed the whole request with 500; a bad aws-chunked chunk
signature and a body that did not match its signed SHA-256 came back as
generic 400s; keys with control characters produced listing XML no parser
accepts."""

import hashlib
import urllib.parse
import xml.etree.ElementTree as ET

import boto3
import botocore.config
import botocore.exceptions
import pytest
import requests

from sigv4 import sign, signed_request
from tarnproc import ACCESS_KEY, SECRET_KEY

NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


def client(server, region):
    return boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=region,
        config=botocore.config.Config(signature_version="s3v4", retries={"max_attempts": 1, "mode": "standard"}),
    )


def error_of(r):
    root = ET.fromstring(r.content)
    return {c.tag: c.text for c in root}


def test_requests_signed_for_another_region_are_refused(server, s3):
    # Before: a request signed for any region was served.
    s3.create_bucket(Bucket="reg")
    s3.put_object(Bucket="reg", Key="k", Body=b"v")
    # Before: a request signed for any region was served. Now it is refused
    # with AWS's error, which names the right region...
    r = signed_request(server.endpoint, "GET", "/reg/k", region="eu-west-1")
    assert r.status_code == 400, r.content
    assert error_of(r)["Code"] == "AuthorizationHeaderMalformed"
    assert "'eu-west-1' is wrong; expecting 'us-east-1'" in error_of(r)["Message"]
    # ...so that boto3, configured for the wrong region, redirects and succeeds
    # (its region redirector reads x-amz-bucket-region), as against AWS.
    other = client(server, "eu-west-1")
    sent = []
    other.meta.events.register("before-send.s3.*", lambda request, **kw: sent.append(request.headers["Authorization"]))
    assert other.get_object(Bucket="reg", Key="k")["Body"].read() == b"v"
    assert b"/eu-west-1/" in sent[0] and b"/us-east-1/" in sent[-1], sent
    # AWS's answer names the right region, so clients can retry with it (s3cmd's "US").
    r = signed_request(server.endpoint, "GET", "/reg/k", region="US")
    assert r.status_code == 400
    assert error_of(r)["Region"] == "us-east-1"
    assert r.headers["x-amz-bucket-region"] == "us-east-1"
    assert signed_request(server.endpoint, "GET", "/reg/k").content == b"v"
    # Presigned: the same, in the query's words.
    url = other.generate_presigned_url("get_object", Params={"Bucket": "reg", "Key": "k"}, ExpiresIn=60)
    r = requests.get(url)
    assert r.status_code == 400 and error_of(r)["Code"] == "AuthorizationQueryParametersError", r.content
    assert error_of(r)["Region"] == "us-east-1"


def test_presigned_urls_valid_for_more_than_a_week_are_refused(server, s3):
    s3 = client(server, "us-east-1")
    s3.create_bucket(Bucket="pre")
    s3.put_object(Bucket="pre", Key="k", Body=b"v")
    week = s3.generate_presigned_url("get_object", Params={"Bucket": "pre", "Key": "k"}, ExpiresIn=604800)
    assert requests.get(week).content == b"v"
    longer = s3.generate_presigned_url("get_object", Params={"Bucket": "pre", "Key": "k"}, ExpiresIn=604801)
    assert "X-Amz-Expires=604801" in longer
    r = requests.get(longer)
    assert r.status_code == 400, r.content
    err = error_of(r)
    assert err["Code"] == "AuthorizationQueryParametersError"
    assert "604800" in err["Message"]


def test_delete_objects_with_an_oversized_key_is_a_client_error(s3):
    # Before: 500 InternalError. Now the request is refused whole with 400,
    # before anything is deleted.
    s3.create_bucket(Bucket="del")
    s3.put_object(Bucket="del", Key="keep", Body=b"v")
    s3.put_object(Bucket="del", Key="gone", Body=b"v")
    for n in (1025, 4096):
        with pytest.raises(botocore.exceptions.ClientError) as e:
            s3.delete_objects(Bucket="del", Delete={"Objects": [{"Key": "gone"}, {"Key": "x" * n}]})
        assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
        assert e.value.response["Error"]["Code"] == "KeyTooLongError"
    assert sorted(o["Key"] for o in s3.list_objects_v2(Bucket="del")["Contents"]) == ["gone", "keep"]
    r = s3.delete_objects(Bucket="del", Delete={"Objects": [{"Key": "gone"}, {"Key": "x" * 1024}]})
    assert [d["Key"] for d in r["Deleted"]] == ["gone", "x" * 1024]
    assert [o["Key"] for o in s3.list_objects_v2(Bucket="del")["Contents"]] == ["keep"]


def test_a_delete_objects_body_over_20_mib_is_a_client_error(server, s3):
    # Before: a 20 MiB key in DeleteObjects answered 500 InternalError (s3s
    # took its own body limit for a server fault). Now 400
    # MaxMessageLengthExceeded, with a length declared or not, and nothing
    # is deleted.
    s3.create_bucket(Bucket="big-del")
    s3.put_object(Bucket="big-del", Key="keep", Body=b"v")
    doc = b"<Delete><Object><Key>keep</Key></Object><Object><Key>" + b"x" * (20 << 20) + b"</Key></Object></Delete>"
    r = signed_request(server.endpoint, "POST", "/big-del", query=[("delete", "")], body=doc)
    assert r.status_code == 400, r.content[:300]
    assert error_of(r)["Code"] == "MaxMessageLengthExceeded"

    # aws-chunked, as boto3 sends it: the decoded length declared, the
    # chunks' framing around it.
    from test_s3_chunked import put_raw, seed_request, signed_chunks
    import datetime

    host = server.endpoint.replace("http://", "")
    now = datetime.datetime.now(datetime.timezone.utc)
    for declared in (len(doc), 1000):  # the truth, and a lie
        extra = {"content-encoding": "aws-chunked", "x-amz-decoded-content-length": str(declared)}
        headers, seed, amz_date, scope = seed_request("POST", host, "/big-del", extra,
                                                      "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", now, query="delete=")  # fmt: skip
        wire = signed_chunks(doc, 64 * 1024, seed, amz_date, scope)
        r = requests.post(f"{server.endpoint}/big-del?delete=", headers=dict(headers, **{"Content-Length": str(len(wire))}),
                          data=wire)  # fmt: skip
        assert r.status_code == 400, (declared, r.content[:300])
    assert [o["Key"] for o in s3.list_objects_v2(Bucket="big-del")["Contents"]] == ["keep"]


def test_sigv2_works_and_its_presigned_urls_live_at_most_a_week(server, s3):
    # boto3 presigns with SigV2 by default against a custom endpoint, so
    # Tarn supports SigV2 whole (docs/s3.md): headers, presigned URLs and
    # forms. Before: a SigV2 URL valid until the year 2200 was served.
    import base64
    import hmac

    s3.create_bucket(Bucket="sigv2")
    s3.put_object(Bucket="sigv2", Key="k", Body=b"v")
    v2 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY,
                      aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                      config=botocore.config.Config(signature_version="s3", retries={"max_attempts": 1}))  # fmt: skip
    v2.put_object(Bucket="sigv2", Key="dir/a b+c", Body=b"x")
    assert v2.get_object(Bucket="sigv2", Key="k")["Body"].read() == b"v"
    # Listings, with the query parameters that are not signed in SigV2.
    assert [o["Key"] for o in v2.list_objects(Bucket="sigv2")["Contents"]] == ["dir/a b+c", "k"]
    assert [o["Key"] for o in v2.list_objects_v2(Bucket="sigv2", Prefix="dir/")["Contents"]] == ["dir/a b+c"]
    page = v2.list_objects_v2(Bucket="sigv2", Delimiter="/", MaxKeys=1)
    assert [p["Prefix"] for p in page.get("CommonPrefixes", [])] == ["dir/"], page
    assert page["IsTruncated"]
    rest = v2.list_objects_v2(Bucket="sigv2", Delimiter="/", ContinuationToken=page["NextContinuationToken"])
    assert [o["Key"] for o in rest["Contents"]] == ["k"]
    assert [o["Key"] for o in v2.list_objects(Bucket="sigv2", Marker="dir/a b+c")["Contents"]] == ["k"]
    assert len(v2.list_object_versions(Bucket="sigv2")["Versions"]) == 2
    mp = v2.create_multipart_upload(Bucket="sigv2", Key="mp")
    assert [u["Key"] for u in v2.list_multipart_uploads(Bucket="sigv2")["Uploads"]] == ["mp"]
    v2.abort_multipart_upload(Bucket="sigv2", Key="mp", UploadId=mp["UploadId"])
    assert [b["Name"] for b in v2.list_buckets()["Buckets"]] == ["sigv2"]
    # A wrong secret is refused.
    bad = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=ACCESS_KEY,
                       aws_secret_access_key="wrong-secret", region_name="us-east-1",
                       config=botocore.config.Config(signature_version="s3", retries={"max_attempts": 1}))  # fmt: skip
    with pytest.raises(botocore.exceptions.ClientError) as e:
        bad.list_objects(Bucket="sigv2")
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 403
    # Presigned, as boto3 makes them by default: a week works, longer does not.
    url = s3.generate_presigned_url("get_object", Params={"Bucket": "sigv2", "Key": "k"}, ExpiresIn=7 * 86400)
    assert "Signature=" in url and "Expires=" in url, url
    assert requests.get(url).content == b"v"
    expires = "7258118400"  # 2200-01-01
    sig = base64.b64encode(hmac.new(SECRET_KEY.encode(), f"GET\n\n\n{expires}\n/sigv2/k".encode(), "sha1").digest())
    r = requests.get(f"{server.endpoint}/sigv2/k", params={"AWSAccessKeyId": ACCESS_KEY, "Expires": expires, "Signature": sig})
    assert r.status_code == 400 and error_of(r)["Code"] == "AuthorizationQueryParametersError", r.content
    assert "604800" in error_of(r)["Message"]
    # An expired one is refused.
    past = str(int(__import__("time").time()) - 10)
    sig = base64.b64encode(hmac.new(SECRET_KEY.encode(), f"GET\n\n\n{past}\n/sigv2/k".encode(), "sha1").digest())
    r = requests.get(f"{server.endpoint}/sigv2/k", params={"AWSAccessKeyId": ACCESS_KEY, "Expires": past, "Signature": sig})
    assert r.status_code == 403, r.content
    # A browser form signed with SigV2 (boto3's default presigned POST).
    post = s3.generate_presigned_post("sigv2", "form")
    assert "signature" in post["fields"], post
    r = requests.post(post["url"], data=post["fields"], files={"file": ("f", b"form body")})
    assert r.status_code in (200, 204), r.content
    assert s3.get_object(Bucket="sigv2", Key="form")["Body"].read() == b"form body"


def test_bad_chunk_signature_and_payload_hash_have_their_own_errors(server, s3):
    from test_s3_chunked import put_raw, seed_request, signed_chunks

    s3.create_bucket(Bucket="sig")
    s3.put_object(Bucket="sig", Key="k", Body=b"original")
    host = server.endpoint.replace("http://", "")
    import datetime

    now = datetime.datetime.now(datetime.timezone.utc)
    body = b"z" * 200_000
    extra = {"content-encoding": "aws-chunked", "x-amz-decoded-content-length": str(len(body))}
    headers, seed, amz_date, scope = seed_request("PUT", host, "/sig/k", extra, "STREAMING-AWS4-HMAC-SHA256-PAYLOAD", now)
    wire = signed_chunks(body, 64 * 1024, seed, amz_date, scope, corrupt=True)
    r = put_raw(server, "/sig/k", dict(headers, **{"Content-Length": str(len(wire))}), wire)
    assert r.status_code == 403, r.content
    assert error_of(r)["Code"] == "SignatureDoesNotMatch"
    # A body that is not the one whose SHA-256 was signed.
    signed_hash = hashlib.sha256(b"what was signed").hexdigest()
    r = signed_request(server.endpoint, "PUT", "/sig/k", body=b"what was sent!!", payload_hash=signed_hash)
    assert r.status_code == 400, r.content
    assert error_of(r)["Code"] == "XAmzContentSHA256Mismatch"
    assert s3.get_object(Bucket="sig", Key="k")["Body"].read() == b"original"


CONTROL_KEYS = ["a\x01b", "carriage\rreturn", "esc\x1b[0m", "fine\ttab", "line\nfeed"]


@pytest.mark.parametrize("op", ["v2", "v1", "versions", "uploads"])
def test_keys_with_control_characters_list_as_valid_xml(server, s3, op):
    # Before: the listing carried the raw bytes; aws CLI and boto3 failed to
    # parse it (AWS itself writes "&#x1;", which XML 1.0 forbids too).
    s3.create_bucket(Bucket="ctl")
    for k in CONTROL_KEYS + ["plain"]:
        if op == "uploads":
            s3.create_multipart_upload(Bucket="ctl", Key=k)
        else:
            s3.put_object(Bucket="ctl", Key=k, Body=b"v")
    query = {"v2": [("list-type", "2")], "v1": [], "versions": [("versions", "")], "uploads": [("uploads", "")]}[op]
    r = signed_request(server.endpoint, "GET", "/ctl", query=query)
    assert r.status_code == 200, r.content
    root = ET.fromstring(r.content)  # must parse
    assert root.find(f"{NS}EncodingType").text == "url"
    tag = {"v2": "Contents", "v1": "Contents", "versions": "Version", "uploads": "Upload"}[op]
    keys = sorted(urllib.parse.unquote(e.find(f"{NS}Key").text) for e in root.iter(f"{NS}{tag}"))
    assert keys == sorted(CONTROL_KEYS + ["plain"])
    # What boto3 sends (encoding-type=url) decodes to the same keys.
    if op == "v2":
        got = sorted(o["Key"] for o in s3.list_objects_v2(Bucket="ctl")["Contents"])
        assert got == sorted(CONTROL_KEYS + ["plain"])
    # A listing without such keys is not encoded unless asked.
    r = signed_request(server.endpoint, "GET", "/ctl", query=query + [("prefix", "plain")])
    root = ET.fromstring(r.content)
    assert root.find(f"{NS}EncodingType") is None
