//! The one place engine errors become S3 error codes.

use s3s::{S3Error, S3ErrorCode};
use tarn_store::StoreError;

pub fn s3_error(e: StoreError) -> S3Error {
    use S3ErrorCode as C;
    let (code, msg): (S3ErrorCode, String) = match &e {
        StoreError::NoSuchBucket(_) => (C::NoSuchBucket, e.to_string()),
        StoreError::BucketExists(_) => (C::BucketAlreadyOwnedByYou, e.to_string()),
        StoreError::BucketNotEmpty(_) => (C::BucketNotEmpty, e.to_string()),
        StoreError::InvalidBucketName(_) => (C::InvalidBucketName, e.to_string()),
        StoreError::InvalidKey(_) => (C::KeyTooLongError, e.to_string()),
        StoreError::NoSuchKey { .. } | StoreError::DeleteMarker { .. } => {
            (C::NoSuchKey, "The specified key does not exist.".into())
        }
        StoreError::NoSuchVersion { .. } => (C::NoSuchVersion, e.to_string()),
        StoreError::MethodNotAllowed => (
            C::MethodNotAllowed,
            "The specified method is not allowed against this resource.".into(),
        ),
        StoreError::ObjectLocked(_) => (C::AccessDenied, e.to_string()),
        StoreError::InvalidBucketState(_) => (C::InvalidBucketState, e.to_string()),
        StoreError::NoSuchUpload(_) => (C::NoSuchUpload, e.to_string()),
        StoreError::InvalidPart(_) => (C::InvalidPart, e.to_string()),
        StoreError::InvalidPartOrder => (C::InvalidPartOrder, e.to_string()),
        StoreError::EntityTooSmall { .. } => (C::EntityTooSmall, e.to_string()),
        StoreError::EntityTooLarge { .. } => (C::EntityTooLarge, e.to_string()),
        StoreError::PreconditionFailed(_) => (
            C::PreconditionFailed,
            "At least one of the pre-conditions you specified did not hold".into(),
        ),
        StoreError::NotModified { .. } => (C::NotModified, "Not Modified".into()),
        StoreError::InvalidRange => (
            C::InvalidRange,
            "The requested range is not satisfiable".into(),
        ),
        StoreError::InvalidPartNumber => (C::Custom("InvalidPartNumber".into()), e.to_string()),
        StoreError::InvalidArgument(_) => (C::InvalidArgument, e.to_string()),
        StoreError::InvalidRequest(_) => (C::InvalidRequest, e.to_string()),
        StoreError::BadDigest => (
            C::BadDigest,
            "The Content-MD5 you specified did not match what we received.".into(),
        ),
        StoreError::ChecksumMismatch { .. } => (C::BadDigest, e.to_string()),
        StoreError::IncompleteBody { .. } => (C::IncompleteBody, e.to_string()),
        StoreError::Body(_) => (C::IncompleteBody, e.to_string()),
        StoreError::BodySignature => (
            C::SignatureDoesNotMatch,
            "The request signature we calculated does not match the signature you provided. Check your key and signing method.".into(),
        ),
        StoreError::BodyHash => (
            C::Custom("XAmzContentSHA256Mismatch".into()),
            "The provided 'x-amz-content-sha256' header does not match what was computed.".into(),
        ),
        StoreError::RequestTimeout(_) => (
            C::RequestTimeout,
            "Your socket connection to the server was not read from or written to within the timeout period.".into(),
        ),
        StoreError::SlowDown(_) => (C::SlowDown, "Please reduce your request rate.".into()),
        StoreError::StorageFull(_) => (
            C::Custom("InsufficientStorage".into()),
            format!("{e}. Delete objects or add capacity; reads and DELETEs keep working."),
        ),
        StoreError::QuorumLost { .. }
        | StoreError::Catalog(_)
        | StoreError::Superseded { .. }
        | StoreError::Late { .. } => {
            (C::ServiceUnavailable, e.to_string())
        }
        StoreError::Unreadable { .. }
        | StoreError::Drive { .. }
        | StoreError::IndexCorrupt { .. }
        | StoreError::DriveInUse { .. }
        | StoreError::CorruptMetadata { .. }
        | StoreError::Config(_)
        | StoreError::Io(_) => {
            tracing::error!(error = %e, "internal error");
            (
                C::InternalError,
                "We encountered an internal error. Please try again.".into(),
            )
        }
    };
    let custom_status = match e {
        StoreError::BodyHash => Some(http::StatusCode::BAD_REQUEST),
        StoreError::InvalidPartNumber => Some(http::StatusCode::RANGE_NOT_SATISFIABLE),
        StoreError::StorageFull(_) => Some(http::StatusCode::INSUFFICIENT_STORAGE),
        _ => None,
    };
    let mut err = S3Error::with_message(code, msg);
    if let Some(status) = custom_status {
        err.set_status_code(status);
    }
    if let StoreError::NotModified { etag } = &e {
        let mut h = http::HeaderMap::new();
        if let Ok(v) = http::HeaderValue::from_str(&format!("\"{etag}\"")) {
            h.insert(http::header::ETAG, v);
        }
        err.set_headers(h);
    }
    if let StoreError::PreconditionFailed(condition) = &e {
        err.set_headers(condition_header(condition));
    }
    if let StoreError::NoSuchBucket(name) = &e {
        if let Ok(v) = http::HeaderValue::from_str(name) {
            let mut h = http::HeaderMap::new();
            h.insert(BUCKET_NAME_HEADER, v);
            err.set_headers(h);
        }
    }
    if let StoreError::DeleteMarker { version, .. } = &e {
        let mut h = http::HeaderMap::new();
        h.insert(
            "x-amz-delete-marker",
            http::HeaderValue::from_static("true"),
        );
        if let Some(v) = version
            .as_deref()
            .and_then(|v| http::HeaderValue::from_str(v).ok())
        {
            h.insert("x-amz-version-id", v);
        }
        err.set_headers(h);
    }
    err
}

/// The internal header that names a failed precondition; the server turns
/// it into the error body's `<Condition>` element (which s3s cannot write)
/// and never sends it.
pub const CONDITION_HEADER: &str = "x-tarn-condition";

/// The same for a NoSuchBucket's `<BucketName>` (as S3's error names it).
pub const BUCKET_NAME_HEADER: &str = "x-tarn-bucket-name";

pub fn condition_header(condition: &'static str) -> http::HeaderMap {
    let mut h = http::HeaderMap::new();
    h.insert(CONDITION_HEADER, http::HeaderValue::from_static(condition));
    h
}

/// A 412 that names the condition that did not hold.
pub fn precondition_failed(condition: &'static str) -> S3Error {
    s3_error(StoreError::PreconditionFailed(condition))
}
