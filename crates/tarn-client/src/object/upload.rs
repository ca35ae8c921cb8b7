//! Writes: one PUT for an object that fits in a part, else a multipart
//! upload whose parts the workers send in parallel, each body written to the
//! socket from the registered buffer as it lies, each with its CRC32C
//! (`x-amz-checksum-crc32c`) for the server to check. A part that fails for
//! good aborts the upload; nothing half-written becomes visible.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use super::engine::{ensure, status_failure, Call, Shared};
use super::http::Conn;
use super::{xml, Buffer, Error, Failure, ObjectError};

/// Most parts S3 allows in one upload.
const PARTS_MAX: u64 = 10_000;
/// Smallest part S3 allows (all but the last).
const PART_MIN: u64 = 5 << 20;

/// How to write an object.
#[derive(Debug, Clone, Default)]
pub struct PutOptions {
    /// Part size; default the client's `part_bytes`.
    pub part_bytes: Option<u64>,
    pub content_type: Option<String>,
    /// Only if no object has the key (`If-None-Match: *`): a write that
    /// would replace one fails with 412 and changes nothing.
    pub if_none_match: bool,
    /// Only if the object's ETag is this one (`If-Match`).
    pub if_match: Option<String>,
}

pub(crate) struct Upload {
    bucket: String,
    key: String,
    /// None: a single PUT.
    upload_id: Option<String>,
    buffer: Buffer,
    /// Headers of a single PUT (content type, conditions).
    single_headers: Vec<(&'static str, String)>,
    state: Mutex<Parts>,
    changed: Condvar,
    /// A part failed for good: the rest are not sent.
    failed: AtomicBool,
}

struct Parts {
    left: usize,
    /// (ETag, CRC32C in base64), or the failure.
    results: Vec<Option<Result<(String, String), ObjectError>>>,
}

pub(crate) struct PartJob {
    upload: Arc<Upload>,
    /// 1-based; 0 for a single PUT.
    number: u32,
    /// Where the part's bytes lie in the buffer, and in the object.
    offset: u64,
    object_offset: u64,
    pub len: u64,
}

pub(crate) fn put(
    sh: &Arc<Shared>,
    bucket: &str,
    key: &str,
    buffer: &Buffer,
    offset: u64,
    len: u64,
    opts: &PutOptions,
) -> Result<String, Error> {
    if offset
        .checked_add(len)
        .is_none_or(|e| e > buffer.len() as u64)
    {
        return Err(Error::Usage(format!(
            "{len} bytes at offset {offset} do not fit in a buffer of {} bytes",
            buffer.len()
        )));
    }
    if bucket.is_empty() || key.is_empty() {
        return Err(Error::Usage("empty bucket or key".into()));
    }
    let mut part = opts.part_bytes.unwrap_or(sh.cfg.part_bytes).max(PART_MIN);
    if len.div_ceil(part) > PARTS_MAX {
        part = len.div_ceil(PARTS_MAX).div_ceil(1 << 20) << 20;
    }
    let mut conditions: Vec<(&'static str, String)> = Vec::new();
    if opts.if_none_match {
        conditions.push(("If-None-Match", "*".into()));
    }
    if let Some(e) = &opts.if_match {
        conditions.push(("If-Match", e.clone()));
    }
    let mut single_headers = conditions.clone();
    if let Some(t) = &opts.content_type {
        single_headers.push(("Content-Type", t.clone()));
    }
    let err = |f: Failure, attempts: u32| -> Error {
        ObjectError::new(bucket, key, None, f, attempts).into()
    };
    if len <= part {
        let up = Upload::new(bucket, key, None, buffer, single_headers, 1);
        sh.enqueue_parts(vec![Arc::new(PartJob {
            upload: up.clone(),
            number: 0,
            offset,
            object_offset: 0,
            len,
        })]);
        let mut results = up.wait();
        return match results.pop().flatten() {
            Some(Ok((etag, _))) => Ok(etag),
            Some(Err(e)) => Err(e.into()),
            None => Err(err(Failure::Cancelled, 1)),
        };
    }

    let mut create_headers = vec![("x-amz-checksum-algorithm", "CRC32C".to_string())];
    if let Some(t) = &opts.content_type {
        create_headers.push(("Content-Type", t.clone()));
    }
    let (_, body) = sh
        .control(
            &Call::new("POST", bucket, key)
                .query(&[("uploads", "")])
                .headers(&create_headers),
            &[],
        )
        .map_err(|(f, a)| err(f, a))?;
    let upload_id = xml::first(&String::from_utf8_lossy(&body), "UploadId").ok_or_else(|| {
        err(
            Failure::Protocol("CreateMultipartUpload answered without an UploadId".into()),
            1,
        )
    })?;
    let count = len.div_ceil(part);
    let up = Upload::new(
        bucket,
        key,
        Some(upload_id.clone()),
        buffer,
        Vec::new(),
        count as usize,
    );
    let jobs = (0..count)
        .map(|i| {
            Arc::new(PartJob {
                upload: up.clone(),
                number: i as u32 + 1,
                offset: offset + i * part,
                object_offset: i * part,
                len: part.min(len - i * part),
            })
        })
        .collect();
    sh.enqueue_parts(jobs);
    let results = up.wait();
    let abort = || {
        let q = [("uploadId", upload_id.as_str())];
        let _ = sh.control(&Call::new("DELETE", bucket, key).query(&q), &[]);
    };
    // The failure to report: a part's own, not one skipped because of it.
    let first_failure = results
        .iter()
        .flatten()
        .filter_map(|r| r.as_ref().err())
        .find(|e| e.failure != Failure::Cancelled)
        .cloned();
    if let Some(e) = first_failure {
        abort();
        return Err(e.into());
    }
    let mut xml_body = String::from("<CompleteMultipartUpload>");
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Some(Ok((etag, crc))) => xml_body.push_str(&format!(
                "<Part><PartNumber>{}</PartNumber><ETag>{}</ETag><ChecksumCRC32C>{crc}</ChecksumCRC32C></Part>",
                i + 1,
                xml::escape(&etag)
            )),
            Some(Err(e)) => {
                abort();
                return Err(e.into());
            }
            None => {
                abort();
                return Err(err(Failure::Cancelled, 1));
            }
        }
    }
    xml_body.push_str("</CompleteMultipartUpload>");
    let (_, body) = sh
        .control(
            &Call::new("POST", bucket, key)
                .query(&[("uploadId", &upload_id)])
                .headers(&conditions),
            xml_body.as_bytes(),
        )
        .map_err(|(f, a)| {
            abort();
            err(f, a)
        })?;
    Ok(xml::first(&String::from_utf8_lossy(&body), "ETag").unwrap_or_default())
}

impl Upload {
    fn new(
        bucket: &str,
        key: &str,
        upload_id: Option<String>,
        buffer: &Buffer,
        single_headers: Vec<(&'static str, String)>,
        parts: usize,
    ) -> Arc<Upload> {
        Arc::new(Upload {
            bucket: bucket.into(),
            key: key.into(),
            upload_id,
            buffer: buffer.clone(),
            single_headers,
            state: Mutex::new(Parts {
                left: parts,
                results: vec![None; parts],
            }),
            changed: Condvar::new(),
            failed: AtomicBool::new(false),
        })
    }

    fn wait(&self) -> Vec<Option<Result<(String, String), ObjectError>>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        while s.left > 0 {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        std::mem::take(&mut s.results)
    }

    fn finish(&self, index: usize, r: Result<(String, String), ObjectError>) {
        if r.is_err() {
            self.failed.store(true, Ordering::Relaxed);
        }
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.results[index] = Some(r);
        s.left -= 1;
        drop(s);
        self.changed.notify_all();
    }
}

/// Sends one part (or the single PUT), with retries.
pub(crate) fn run_part(sh: &Shared, conn: &mut Option<Conn>, p: &PartJob, index: usize) {
    let up = &p.upload;
    let slot = (p.number.max(1) - 1) as usize;
    let range = Some((p.object_offset, p.object_offset + p.len));
    let err = |f: Failure, attempts: u32| ObjectError::new(&up.bucket, &up.key, range, f, attempts);
    if up.failed.load(Ordering::Relaxed) {
        up.finish(slot, Err(err(Failure::Cancelled, 0)));
        return;
    }
    // SAFETY: inside the buffer (checked by `put`), which the upload keeps
    // mapped; uploads only read it.
    let body = unsafe {
        std::slice::from_raw_parts(up.buffer.as_ptr().add(p.offset as usize), p.len as usize)
    };
    let crc = base64(&tarn_wire::proto::crc32c(body).to_be_bytes());
    let number = p.number.to_string();
    let query: Vec<(&str, &str)> = match &up.upload_id {
        Some(id) => vec![("partNumber", &number), ("uploadId", id)],
        None => Vec::new(),
    };
    let mut headers: Vec<(&str, String)> = vec![("x-amz-checksum-crc32c", crc.clone())];
    if up.upload_id.is_none() {
        headers.extend(up.single_headers.iter().map(|(k, v)| (*k, v.clone())));
    }
    let mut attempts = 0u32;
    loop {
        attempts += 1;
        let outcome = (|| -> Result<String, (Failure, bool)> {
            let cn = ensure(sh, conn, index).map_err(|f| (f, false))?;
            let call = Call::new("PUT", &up.bucket, &up.key)
                .query(&query)
                .headers(&headers);
            let head = sh.request_head(cn.endpoint, &call, p.len);
            sh.counters.requests.fetch_add(1, Ordering::Relaxed);
            let io = |cn: &Conn, e: std::io::Error| {
                let stale = cn.uses > 1 && e.kind() == std::io::ErrorKind::UnexpectedEof;
                (
                    Failure::Io {
                        kind: e.kind(),
                        message: e.to_string(),
                    },
                    stale,
                )
            };
            if let Err(e) = cn.send(&head, body) {
                return Err(io(cn, e));
            }
            sh.counters.bytes_sent.fetch_add(p.len, Ordering::Relaxed);
            let h = cn.read_head().map_err(|e| io(cn, e))?;
            let b = cn.read_body_to_vec(&h, 1 << 20).map_err(|e| io(cn, e))?;
            if (200..300).contains(&h.status) {
                return Ok(h.header("etag").unwrap_or_default().to_string());
            }
            Err((status_failure(h.status, &b), false))
        })();
        match outcome {
            Ok(etag) => {
                up.finish(slot, Ok((etag, crc)));
                return;
            }
            Err((f, stale)) => {
                if conn.as_ref().is_some_and(|c| !c.reusable()) {
                    *conn = None;
                }
                if stale {
                    attempts -= 1;
                    *conn = None;
                    continue;
                }
                if !f.transient() || attempts > sh.cfg.retries || up.failed.load(Ordering::Relaxed)
                {
                    up.finish(slot, Err(err(f, attempts)));
                    return;
                }
                *conn = None;
                sh.counters.retries.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(sh.backoff(attempts));
            }
        }
    }
}

fn base64(b: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(b.len().div_ceil(3) * 4);
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= c.len() {
                out.push(T[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_of_checksums() {
        assert_eq!(super::base64(b""), "");
        assert_eq!(super::base64(b"f"), "Zg==");
        assert_eq!(super::base64(b"fo"), "Zm8=");
        assert_eq!(super::base64(b"foo"), "Zm9v");
        assert_eq!(super::base64(&[0xE3, 0x06, 0x9A, 0x89]), "4waaiQ==");
    }
}
