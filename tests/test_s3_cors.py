"""CORS (issue 42): Get/Put/DeleteBucketCors were 501, OPTIONS preflights
unanswered, so browser apps could not reach Tarn. Rules are kept and
checked as S3 checks them; a preflight is answered from them without
credentials; responses to an allowed origin carry the Access-Control-*
headers, others none."""

import botocore.exceptions
import pytest
import requests

RULES = [
    {"ID": "app", "AllowedOrigins": ["https://*.example.com"], "AllowedMethods": ["GET", "PUT", "POST"],
     "AllowedHeaders": ["x-amz-*", "content-type", "authorization"], "ExposeHeaders": ["ETag", "x-amz-version-id"],
     "MaxAgeSeconds": 600},
    {"AllowedOrigins": ["*"], "AllowedMethods": ["GET", "HEAD"]},
]


def err(call):
    with pytest.raises(botocore.exceptions.ClientError) as e:
        call()
    r = e.value.response
    return r["ResponseMetadata"]["HTTPStatusCode"], r["Error"]["Code"]


def preflight(server, path, origin, method, headers=None):
    h = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers:
        h["Access-Control-Request-Headers"] = headers
    return requests.options(f"{server.endpoint}{path}", headers=h, timeout=10)


def test_cors_configuration_and_preflight(server, s3):
    s3.create_bucket(Bucket="web")
    s3.put_object(Bucket="web", Key="index.html", Body=b"<p>hi</p>")
    assert err(lambda: s3.get_bucket_cors(Bucket="web")) == (404, "NoSuchCORSConfiguration")
    r = preflight(server, "/web/index.html", "https://app.example.com", "GET")
    assert r.status_code == 403 and "CORS is not enabled" in r.text
    s3.put_bucket_cors(Bucket="web", CORSConfiguration={"CORSRules": RULES})
    assert s3.get_bucket_cors(Bucket="web")["CORSRules"] == RULES
    for bad in ([{"AllowedOrigins": ["*"], "AllowedMethods": ["PATCH"]}],
                [{"AllowedOrigins": ["https://*.*.com"], "AllowedMethods": ["GET"]}]):
        assert err(lambda: s3.put_bucket_cors(Bucket="web", CORSConfiguration={"CORSRules": bad})) == (400, "InvalidRequest")
    assert s3.get_bucket_cors(Bucket="web")["CORSRules"] == RULES

    # An allowed preflight: no credentials needed.
    r = preflight(server, "/web/up/file.bin", "https://app.example.com", "PUT", "Content-Type, X-Amz-Date")
    assert r.status_code == 200, r.text
    assert r.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
    assert r.headers["Access-Control-Allow-Methods"] == "GET, PUT, POST"
    assert r.headers["Access-Control-Allow-Headers"] == "Content-Type, X-Amz-Date"
    assert r.headers["Access-Control-Max-Age"] == "600"
    assert r.headers["Access-Control-Allow-Credentials"] == "true"
    assert "ETag" in r.headers["Access-Control-Expose-Headers"]
    # Disallowed origin, method or header: 403 and no CORS headers.
    for origin, method, hdrs in (("https://evil.com", "PUT", None), ("https://app.example.com", "DELETE", None),
                                 ("https://app.example.com", "PUT", "x-custom")):
        r = preflight(server, "/web/k", origin, method, hdrs)
        assert r.status_code == 403, (origin, method, hdrs)
        assert "Access-Control-Allow-Origin" not in r.headers
    # Any origin may GET (the second rule).
    r = preflight(server, "/web/index.html", "https://other.org", "GET")
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "*"
    # Without an Origin: 400.
    assert requests.options(f"{server.endpoint}/web/k", timeout=10).status_code == 400

    # Actual requests: the headers on the answer when the origin is let in.
    url = s3.generate_presigned_url("get_object", Params={"Bucket": "web", "Key": "index.html"})
    r = requests.get(url, headers={"Origin": "https://app.example.com"}, timeout=10)
    assert r.status_code == 200 and r.headers["Access-Control-Allow-Origin"] == "https://app.example.com"
    assert "ETag" in r.headers["Access-Control-Expose-Headers"]
    r = requests.get(url, timeout=10)
    assert "Access-Control-Allow-Origin" not in r.headers
    r = requests.delete(s3.generate_presigned_url("delete_object", Params={"Bucket": "web", "Key": "nothing"}),
                        headers={"Origin": "https://app.example.com"}, timeout=10)
    assert "Access-Control-Allow-Origin" not in r.headers

    s3.delete_bucket_cors(Bucket="web")
    assert err(lambda: s3.get_bucket_cors(Bucket="web")) == (404, "NoSuchCORSConfiguration")
    assert preflight(server, "/web/index.html", "https://other.org", "GET").status_code == 403
