//! S3 failures as errnos. The S3 error goes to the log; the caller gets
//! the errno a file system would give.

use tarn_client::object::{Error, Failure, ObjectError};

pub type Errno = i32;

/// A request's failure, after its retries.
pub fn from_object(e: &ObjectError) -> Errno {
    let errno = match &e.failure {
        Failure::NotFound { .. } => libc::ENOENT,
        Failure::Denied { .. } => libc::EACCES,
        Failure::Changed => libc::EIO,
        Failure::OutOfRange { .. } => libc::EIO,
        Failure::Status { status: 400, .. } => libc::EINVAL,
        Failure::Status { .. } | Failure::Protocol(_) => libc::EIO,
        Failure::Io { kind, .. } if *kind == std::io::ErrorKind::TimedOut => libc::ETIMEDOUT,
        Failure::Io { .. } => libc::EIO,
        Failure::Cancelled => libc::EINTR,
    };
    if errno != libc::ENOENT {
        tracing::error!(
            "s3://{}/{}: {} ({} attempts)",
            e.bucket,
            e.key,
            e.failure,
            e.attempts
        );
    }
    errno
}

/// A client call's failure.
pub fn from_client(e: &Error, bucket: &str, key: &str) -> Errno {
    match e {
        Error::Object(o) => from_object(o),
        other => {
            tracing::error!("s3://{bucket}/{key}: {other}");
            libc::EIO
        }
    }
}
