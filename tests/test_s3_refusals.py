"""No wrong successes for encryption and object lock (issue 13, first part).

Before: a PUT with SSE-C headers (a customer-provided key) was stored in
plaintext and a GET without the key returned it; SSE-S3 and SSE-KMS headers,
object-lock headers on PutObject and CreateBucket were accepted and ignored.
Object lock is not implemented yet: each such request is refused (501
NotImplemented) and stores nothing. Encryption is (issue 42,
test_s3_sse.py); a server without a master key or KMS key file still refuses
SSE-S3 and SSE-KMS the same way, and stores nothing. SSE-C key headers on a
read of an object not encrypted with a key are 400 InvalidRequest, as AWS.
"""

import datetime
import os

import botocore.exceptions
import pytest

from sigv4 import signed_request

KEY = os.urandom(32)


def refused(call, code, status):
    with pytest.raises(botocore.exceptions.ClientError) as e:
        call()
    err = e.value.response
    assert err["Error"]["Code"] == code, err
    assert err["ResponseMetadata"]["HTTPStatusCode"] == status, err


def missing(s3, bucket, key):
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_object(Bucket=bucket, Key=key)
    return e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404


ENCRYPTIONS = {
    "sse-c": {"SSECustomerAlgorithm": "AES256", "SSECustomerKey": KEY},
    "sse-s3": {"ServerSideEncryption": "AES256"},
    "sse-kms": {"ServerSideEncryption": "aws:kms", "SSEKMSKeyId": "some-key"},
}


@pytest.mark.parametrize("kind", ["sse-s3", "sse-kms"])
def test_encryption_without_keys_is_refused_and_stores_nothing(s3, kind):
    sse = ENCRYPTIONS[kind]
    s3.create_bucket(Bucket="enc")
    s3.put_object(Bucket="enc", Key="plain", Body=b"plain")
    refused(lambda: s3.put_object(Bucket="enc", Key="secret", Body=b"secret", **sse), "NotImplemented", 501)
    assert missing(s3, "enc", "secret")
    refused(lambda: s3.copy_object(Bucket="enc", Key="copy", CopySource={"Bucket": "enc", "Key": "plain"}, **sse),
            "NotImplemented", 501)  # fmt: skip
    assert missing(s3, "enc", "copy")
    refused(lambda: s3.create_multipart_upload(Bucket="enc", Key="mp", **sse), "NotImplemented", 501)
    assert s3.list_multipart_uploads(Bucket="enc").get("Uploads", []) == []
    # The plain object is untouched.
    assert s3.get_object(Bucket="enc", Key="plain")["Body"].read() == b"plain"


def test_customer_keys_on_reads_do_not_apply(s3):
    s3.create_bucket(Bucket="encr")
    s3.put_object(Bucket="encr", Key="plain", Body=b"plain")
    sse = ENCRYPTIONS["sse-c"]
    refused(lambda: s3.get_object(Bucket="encr", Key="plain", **sse), "InvalidRequest", 400)
    with pytest.raises(botocore.exceptions.ClientError) as e:
        s3.head_object(Bucket="encr", Key="plain", **sse)
    assert e.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400


def test_object_lock_outside_a_lock_bucket_is_refused(s3):
    """Object lock is served (test_s3_object_lock.py); asked of a bucket
    made without it, it is refused and nothing is stored."""
    s3.create_bucket(Bucket="lockobj")
    until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    refused(lambda: s3.put_object(Bucket="lockobj", Key="k", Body=b"x", ObjectLockMode="GOVERNANCE",
                                  ObjectLockRetainUntilDate=until), "InvalidRequest", 400)  # fmt: skip
    refused(lambda: s3.put_object(Bucket="lockobj", Key="k", Body=b"x", ObjectLockLegalHoldStatus="ON"),
            "InvalidRequest", 400)  # fmt: skip
    assert missing(s3, "lockobj", "k")
    refused(lambda: s3.get_object_lock_configuration(Bucket="lockobj"), "ObjectLockConfigurationNotFoundError", 404)


def test_no_such_bucket_names_the_bucket(server, s3):
    """NoSuchBucket's body names the bucket, as S3's does (`<BucketName>`)."""
    r = signed_request(server.endpoint, "GET", "/not-a-bucket-here", query=[("list-type", "2")])
    assert r.status_code == 404, r.text
    assert "<Code>NoSuchBucket</Code>" in r.text and "<BucketName>not-a-bucket-here</BucketName>" in r.text, r.text
    r = signed_request(server.endpoint, "PUT", "/not-a-bucket-here/k", body=b"x")
    assert r.status_code == 404 and "<BucketName>not-a-bucket-here</BucketName>" in r.text, r.text
    assert "x-tarn-bucket-name" not in {k.lower() for k in r.headers}
