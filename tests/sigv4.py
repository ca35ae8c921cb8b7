"""SigV4 for raw requests in tests: what botocore would send, but with every
part in the test's hands (region, query, payload hash)."""

import datetime
import hashlib
import hmac
import urllib.parse

import requests

from tarnproc import ACCESS_KEY, SECRET_KEY


def _hmac(key, msg):
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _quote(s):
    return urllib.parse.quote(s, safe="-_.~")


def sign(endpoint, method, path, query=(), region="us-east-1", headers=None, payload_hash="UNSIGNED-PAYLOAD",
         access_key=ACCESS_KEY, secret_key=SECRET_KEY):  # fmt: skip
    """The headers of a SigV4-signed request (Authorization included) and
    its target (path and query string)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    amz_date = now.strftime("%Y%m%dT%H%M%SZ")
    day = amz_date[:8]
    host = endpoint.replace("http://", "")
    hs = dict(headers or {}, host=host, **{"x-amz-date": amz_date, "x-amz-content-sha256": payload_hash})
    names = sorted(h.lower() for h in hs)
    lower = {k.lower(): str(v).strip() for k, v in hs.items()}
    canonical_headers = "".join(f"{n}:{lower[n]}\n" for n in names)
    signed = ";".join(names)
    qs = "&".join(f"{_quote(k)}={_quote(v)}" for k, v in sorted(query))
    canonical = f"{method}\n{_quote_path(path)}\n{qs}\n{canonical_headers}\n{signed}\n{payload_hash}"
    scope = f"{day}/{region}/s3/aws4_request"
    sts = f"AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{hashlib.sha256(canonical.encode()).hexdigest()}"
    k = _hmac(("AWS4" + secret_key).encode(), day)
    for part in (region, "s3", "aws4_request"):
        k = _hmac(k, part)
    sig = hmac.new(k, sts.encode(), hashlib.sha256).hexdigest()
    hs["Authorization"] = f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={signed}, Signature={sig}"
    return hs, _quote_path(path) + (f"?{qs}" if qs else "")


def signed_request(endpoint, method, path, query=(), body=b"", region="us-east-1", headers=None, payload_hash=None,
                   access_key=ACCESS_KEY, secret_key=SECRET_KEY):  # fmt: skip
    """Sends a SigV4-signed request; `query` is a list of (name, value)."""
    payload_hash = payload_hash or hashlib.sha256(body).hexdigest()
    hs, target = sign(endpoint, method, path, query, region, headers, payload_hash, access_key, secret_key)
    return requests.request(method, f"{endpoint}{target}", headers=hs, data=body)


def raw_head(endpoint, method, path, headers=None, **kw):
    """The bytes of a signed request's head (UNSIGNED-PAYLOAD), for tests
    that drive the socket themselves."""
    hs, target = sign(endpoint, method, path, headers=headers, **kw)
    lines = [f"{method} {target} HTTP/1.1"] + [f"{k}: {v}" for k, v in hs.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _quote_path(path):
    return urllib.parse.quote(path, safe="/-_.~")
