//! Request bodies: the adapter from s3s's stream to the engine's, verifying the
//! x-amz-checksum-* the client declared (as a header, or as a trailer after an
//! aws-chunked body) before the engine's commit point.

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use s3s::checksum::ChecksumHasher;
use s3s::crypto::{Checksum as _, Crc32, Crc32c, Crc64Nvme, Sha1, Sha256};
use s3s::dto::StreamingBlob;
use s3s::{S3Error, S3ErrorCode, S3Result, TrailingHeaders};
use tarn_store::{ObjectBody, StoreError};

pub const CHECKSUM_ALGORITHMS: [&str; 5] = ["CRC32", "CRC32C", "CRC64NVME", "SHA1", "SHA256"];

/// What the client promised about a body's checksum.
#[derive(Debug, Clone, Default)]
pub struct ChecksumSpec {
    /// (algorithm, base64 value) from an x-amz-checksum-* header.
    pub header: Option<(String, String)>,
    /// Algorithm announced by x-amz-trailer; the value arrives after the body.
    pub trailer: Option<String>,
}

impl ChecksumSpec {
    pub fn from_request(
        headers: &http::HeaderMap,
        declared: [Option<&String>; 5],
    ) -> S3Result<Self> {
        let mut spec = ChecksumSpec::default();
        for (algo, v) in CHECKSUM_ALGORITHMS.iter().zip(declared) {
            if let Some(v) = v {
                if spec.header.is_some() {
                    return Err(S3Error::with_message(
                        S3ErrorCode::InvalidRequest,
                        "Expecting a single x-amz-checksum- header",
                    ));
                }
                spec.header = Some((algo.to_string(), v.clone()));
            }
        }
        if let Some(t) = headers.get("x-amz-trailer").and_then(|v| v.to_str().ok()) {
            let name = t.trim().to_ascii_lowercase();
            if let Some(algo) = name.strip_prefix("x-amz-checksum-") {
                let algo = algo.to_ascii_uppercase();
                if !CHECKSUM_ALGORITHMS.contains(&algo.as_str()) {
                    return Err(S3Error::with_message(
                        S3ErrorCode::InvalidRequest,
                        "unsupported trailing checksum",
                    ));
                }
                spec.trailer = Some(algo);
            }
        }
        Ok(spec)
    }

    fn algorithm(&self) -> Option<&str> {
        self.header
            .as_ref()
            .map(|(a, _)| a.as_str())
            .or(self.trailer.as_deref())
    }
}

fn hasher_for(algo: &str) -> ChecksumHasher {
    let mut h = ChecksumHasher::default();
    match algo {
        "CRC32" => h.crc32 = Some(Crc32::new()),
        "CRC32C" => h.crc32c = Some(Crc32c::new()),
        "CRC64NVME" => h.crc64nvme = Some(Crc64Nvme::new()),
        "SHA1" => h.sha1 = Some(Sha1::new()),
        "SHA256" => h.sha256 = Some(Sha256::new()),
        _ => {}
    }
    h
}

fn value_of(c: &s3s::dto::Checksum, algo: &str) -> Option<String> {
    match algo {
        "CRC32" => c.checksum_crc32.clone(),
        "CRC32C" => c.checksum_crc32c.clone(),
        "CRC64NVME" => c.checksum_crc64nvme.clone(),
        "SHA1" => c.checksum_sha1.clone(),
        "SHA256" => c.checksum_sha256.clone(),
        _ => None,
    }
}

/// How the HTTP layer's body idle timeout starts its error's message.
pub const BODY_IDLE_MESSAGE: &str = "request body idle timeout";

/// What went wrong reading a body, told apart where the client must hear it:
/// a forged or corrupted chunk of a signed stream (403), a body that does not
/// hash to what was signed (400), anything else (the stream broke off). s3s
/// keeps its stream error types private, so they are recognised by their
/// messages (pinned by a test; s3s is pinned to one version).
pub fn body_error(e: &(dyn std::error::Error + 'static)) -> StoreError {
    let text = e.to_string();
    if text.contains(BODY_IDLE_MESSAGE) {
        StoreError::RequestTimeout(text)
    } else if text.contains("AwsChunkedStreamError: SignatureMismatch") {
        StoreError::BodySignature
    } else if text.contains("UploadStreamError: Sha256Mismatch") {
        StoreError::BodyHash
    } else {
        StoreError::Body(text)
    }
}

/// Builds the engine body: hashes the declared checksum on the fly and checks it
/// (and a trailer's value) when the engine calls `finish`.
pub fn object_body(
    blob: Option<StreamingBlob>,
    declared_len: Option<u64>,
    spec: ChecksumSpec,
    trailers: Option<TrailingHeaders>,
) -> ObjectBody {
    let stream = match blob {
        Some(b) => b.map(|r| r.map_err(|e| body_error(&*e))).boxed(),
        None => futures::stream::empty().boxed(),
    };
    checked_body(stream, declared_len, spec, trailers)
}

/// An engine body over `stream` that hashes and checks what `spec` declares
/// (a spec with only a trailer algorithm and no trailers computes the
/// checksum to store).
pub fn checked_body(
    stream: tarn_store::BodyStream,
    declared_len: Option<u64>,
    spec: ChecksumSpec,
    trailers: Option<TrailingHeaders>,
) -> ObjectBody {
    let Some(algo) = spec.algorithm().map(str::to_string) else {
        return ObjectBody {
            stream,
            declared_len,
            finish: None,
        };
    };
    let hasher = Arc::new(Mutex::new(Some(hasher_for(&algo))));
    let h2 = hasher.clone();
    let stream = stream
        .map(move |r| {
            if let Ok(b) = &r {
                if let Some(h) = h2.lock().expect("hasher lock").as_mut() {
                    h.update(b);
                }
            }
            r
        })
        .boxed();
    let finish = Box::new(move || {
        let computed = hasher
            .lock()
            .expect("hasher lock")
            .take()
            .map(|h| h.finalize());
        let computed = computed
            .as_ref()
            .and_then(|c| value_of(c, &algo))
            .unwrap_or_default();
        let expected = match (&spec.header, &spec.trailer) {
            (Some((_, v)), _) => Some(v.clone()),
            (None, Some(a)) => {
                let name = format!("x-amz-checksum-{}", a.to_ascii_lowercase());
                trailers
                    .as_ref()
                    .and_then(|t| {
                        t.read(|h| {
                            h.get(&name)
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_string)
                        })
                    })
                    .flatten()
            }
            (None, None) => None,
        };
        match expected {
            Some(v) if v != computed => Err(StoreError::ChecksumMismatch {
                algorithm: algo.clone(),
            }),
            // A trailer that was announced but never sent: keep what we computed.
            _ => Ok(Some((algo.clone(), computed))),
        }
    });
    ObjectBody {
        stream,
        declared_len,
        finish: Some(finish),
    }
}

/// Decodes a Content-MD5 header (base64 of 16 bytes).
pub fn content_md5(v: Option<&String>) -> S3Result<Option<[u8; 16]>> {
    let Some(v) = v else { return Ok(None) };
    let bytes = base64_simd::STANDARD.decode_to_vec(v.trim()).map_err(|_| {
        S3Error::with_message(
            S3ErrorCode::InvalidDigest,
            "The Content-MD5 you specified is not valid.",
        )
    })?;
    let arr: [u8; 16] = bytes.try_into().map_err(|_| {
        S3Error::with_message(
            S3ErrorCode::InvalidDigest,
            "The Content-MD5 you specified is not valid.",
        )
    })?;
    Ok(Some(arr))
}
