"""Every S3 operation in botocore's model of S3 is counted in
`tarn_requests_total` under its own name, whatever the answer: the ones
Tarn serves, the ones it refuses (501, 403, 400), and requests refused
before they reach the S3 layer (a bad signature). Operations that share one
wire form (GetBucketLifecycle and GetBucketLifecycleConfiguration, …) count
under the current name."""

import re
import urllib.request

import botocore.session

from sigv4 import signed_request
from tarnproc import SECRET_KEY

# Same method, path and query: the older name and the one AWS uses now.
SAME_WIRE = {
    "GetBucketLifecycle": "GetBucketLifecycleConfiguration",
    "PutBucketLifecycle": "PutBucketLifecycleConfiguration",
    "GetBucketNotification": "GetBucketNotificationConfiguration",
    "PutBucketNotification": "PutBucketNotificationConfiguration",
    "ListDirectoryBuckets": "ListBuckets",
}
# Not S3 bucket or object operations (another host or API).
NOT_HERE = {"WriteGetObjectResponse"}


def counts(server):
    req = urllib.request.Request(server.admin + "/metrics", headers={"Authorization": f"Bearer {SECRET_KEY}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    out = {}
    for op, n in re.findall(r'^tarn_requests_total\{op="([^"]+)",status="\d+"\} (\d+)$', text, re.M):
        out[op] = out.get(op, 0) + int(n)
    return out


def wire(op):
    """(method, path, query pairs, headers) for one operation of the model,
    with its required query parameters and the headers that tell it apart."""
    http = op.http
    uri = http["requestUri"]
    path, _, fixed = uri.partition("?")
    path = path.replace("{Bucket}", "opnames").replace("{Key+}", "some/key")
    query = []
    for part in fixed.split("&") if fixed else []:
        k, _, v = part.partition("=")
        query.append((k, v))
    headers = {}
    shape = op.input_shape
    if shape is not None:
        for name in shape.required_members:
            m = shape.members[name]
            loc, wire_name = m.serialization.get("location"), m.serialization.get("name", name)
            if loc == "querystring" and wire_name not in [k for k, _ in query]:
                query.append((wire_name, "1" if m.type_name in ("integer", "long") else "x"))
            elif loc == "header":
                headers[wire_name] = "/opnames/source" if wire_name == "x-amz-copy-source" else "x"
    return http["method"], path, query, headers


def test_every_operation_is_counted_under_its_name(server):
    server.client().create_bucket(Bucket="opnames")
    model = botocore.session.get_session().get_service_model("s3")
    wrong = []
    for name in model.operation_names:
        if name in NOT_HERE:
            continue
        method, path, query, headers = wire(model.operation_model(name))
        want = SAME_WIRE.get(name, name)
        before = counts(server).get(want, 0)
        r = signed_request(server.endpoint, method, path, query, body=b"", headers=headers)
        after = counts(server).get(want, 0)
        if after != before + 1:
            wrong.append(f"{name} ({method} {path}?{query}) answered {r.status_code}, counted as something else")
    assert not wrong, "\n".join(wrong)


def test_operations_without_a_route_are_refused_and_touch_nothing(server):
    """Operations of newer S3 that Tarn does not implement used to be taken
    for others: a PUT of ?encryption on a key (UpdateObjectEncryption) or of
    ?annotation emptied the object, a DELETE of ?annotation deleted it, a
    PUT of ?abac or ?metadataJournalTable on a bucket answered 200, a DELETE
    of ?metadataConfiguration was a DeleteBucket. Each is a 501 now."""
    s3 = server.client()
    s3.create_bucket(Bucket="keep")
    s3.put_object(Bucket="keep", Key="ckpt", Body=b"precious")
    cases = [
        ("PUT", "/keep/ckpt", [("encryption", "")]),
        ("PUT", "/keep/ckpt", [("annotation", ""), ("annotationName", "a")]),
        ("GET", "/keep/ckpt", [("annotation", ""), ("annotationName", "a")]),
        ("GET", "/keep/ckpt", [("annotation", "")]),
        ("DELETE", "/keep/ckpt", [("annotation", ""), ("annotationName", "a")]),
        ("PUT", "/keep", [("abac", "")]),
        ("GET", "/keep", [("abac", "")]),
        ("PUT", "/keep", [("metadataJournalTable", "")]),
        ("PUT", "/keep", [("metadataInventoryTable", "")]),
        ("PUT", "/keep", [("metadataAnnotationTable", "")]),
        ("POST", "/keep", [("metadataTable", "")]),
        ("GET", "/keep", [("metadataTable", "")]),
        ("DELETE", "/keep", [("metadataTable", "")]),
        ("POST", "/keep", [("metadataConfiguration", "")]),
        ("GET", "/keep", [("metadataConfiguration", "")]),
        ("DELETE", "/keep", [("metadataConfiguration", "")]),
    ]
    for method, path, query in cases:
        r = signed_request(server.endpoint, method, path, query, body=b"")
        assert r.status_code == 501 and b"<Code>NotImplemented</Code>" in r.content, (method, path, query, r.status_code, r.content)
    assert s3.get_object(Bucket="keep", Key="ckpt")["Body"].read() == b"precious"
    s3.delete_object(Bucket="keep", Key="ckpt")
    # An empty bucket survives the DELETE ?metadataConfiguration too.
    assert signed_request(server.endpoint, "DELETE", "/keep", [("metadataConfiguration", "")]).status_code == 501
    s3.head_bucket(Bucket="keep")


def test_refused_requests_keep_their_names(server):
    server.client().create_bucket(Bucket="opnames")
    before = counts(server)
    # A wrong signature, a missing bucket, a method S3 has no operation for.
    r = signed_request(server.endpoint, "GET", "/opnames/k", secret_key="wrong-secret")
    assert r.status_code == 403
    r = signed_request(server.endpoint, "PUT", "/nope-bucket", query=[("versioning", "")])
    assert r.status_code in (400, 404)
    after = counts(server)
    assert after.get("GetObject", 0) == before.get("GetObject", 0) + 1
    assert after.get("PutBucketVersioning", 0) == before.get("PutBucketVersioning", 0) + 1
