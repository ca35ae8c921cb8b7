//! Writes: one PUT for an object that fits in a part, else a multipart
//! upload whose parts the workers send in parallel, each body written to the
//! socket from the registered buffer as it lies, each with its CRC32C
//! (`x-amz-checksum-crc32c`) for the server to check. A part that fails for
//! good aborts the upload; nothing half-written becomes visible.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::engine::{ensure, status_failure, Call, Shared};
use super::http::Conn;
use super::{xml, Buffer, Error, Failure, ObjectError};

/// Most parts S3 allows in one upload.
const PARTS_MAX: u64 = 10_000;
/// Smallest part S3 allows (all but the last).
const PART_MIN: u64 = 5 << 20;
/// How long a send that failed waits for the answer the server may have
/// sent before closing.
const EARLY_ANSWER_WAIT: Duration = Duration::from_millis(500);

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
    /// Headers of a single PUT (content type, conditions).
    single_headers: Vec<(&'static str, String)>,
    state: Mutex<Parts>,
    changed: Condvar,
    /// A part failed for good, or the upload is being aborted: the parts
    /// still queued are not sent.
    failed: AtomicBool,
}

#[derive(Default)]
struct Parts {
    /// Parts queued or being sent.
    outstanding: usize,
    /// Per part number (0 for a single PUT): (ETag, CRC32C in base64), or
    /// the failure.
    results: BTreeMap<u32, Result<(String, String), ObjectError>>,
    /// Part numbers finished and not yet taken by [`Multipart::wait_parts`].
    fresh: VecDeque<u32>,
}

pub(crate) struct PartJob {
    upload: Arc<Upload>,
    /// 1-based; 0 for a single PUT.
    number: u32,
    /// Where the part's bytes lie: in `buffer`, and in the object.
    buffer: Buffer,
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
    check_range(buffer, offset, len)?;
    if bucket.is_empty() || key.is_empty() {
        return Err(Error::Usage("empty bucket or key".into()));
    }
    let mut part = opts.part_bytes.unwrap_or(sh.cfg.part_bytes).max(PART_MIN);
    if len.div_ceil(part) > PARTS_MAX {
        part = len.div_ceil(PARTS_MAX).div_ceil(1 << 20) << 20;
    }
    if len > part {
        let mp = Multipart::create(sh, bucket, key, opts)?;
        for i in 0..len.div_ceil(part) {
            let at = i * part;
            mp.send_part(i as u32 + 1, at, buffer, offset + at, part.min(len - at))?;
        }
        return mp.complete();
    }
    let mut headers = conditions(opts);
    if let Some(t) = &opts.content_type {
        headers.push(("Content-Type", t.clone()));
    }
    let up = Upload::new(bucket, key, None, headers);
    up.enqueue(
        sh,
        PartJob {
            upload: up.clone(),
            number: 0,
            buffer: buffer.clone(),
            offset,
            object_offset: 0,
            len,
        },
    );
    up.wait_all();
    let mut s = up.lock();
    match s.results.remove(&0) {
        Some(Ok((etag, _))) => Ok(etag),
        Some(Err(e)) => Err(e.into()),
        None => Err(ObjectError::new(bucket, key, None, Failure::Cancelled, 1).into()),
    }
}

fn check_range(buffer: &Buffer, offset: u64, len: u64) -> Result<(), Error> {
    if offset
        .checked_add(len)
        .is_none_or(|e| e > buffer.len() as u64)
    {
        return Err(Error::Usage(format!(
            "{len} bytes at offset {offset} do not fit in a buffer of {} bytes",
            buffer.len()
        )));
    }
    Ok(())
}

/// The conditional headers of a write.
fn conditions(opts: &PutOptions) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = Vec::new();
    if opts.if_none_match {
        out.push(("If-None-Match", "*".into()));
    }
    if let Some(e) = &opts.if_match {
        out.push(("If-Match", e.clone()));
    }
    out
}

/// A multipart upload whose parts the caller hands over one at a time, from
/// buffers it may reuse once [`Multipart::wait_parts`] says the part is
/// done: what streams a checkpoint out through a few staging buffers. The
/// parts go out in parallel on the client's workers; the object appears at
/// [`Multipart::complete`] (under the conditions of its [`PutOptions`]), and
/// never if the upload is aborted or dropped before.
pub struct Multipart {
    sh: Arc<Shared>,
    up: Arc<Upload>,
    conditions: Vec<(&'static str, String)>,
    ended: AtomicBool,
}

impl Multipart {
    pub(crate) fn create(
        sh: &Arc<Shared>,
        bucket: &str,
        key: &str,
        opts: &PutOptions,
    ) -> Result<Multipart, Error> {
        if bucket.is_empty() || key.is_empty() {
            return Err(Error::Usage("empty bucket or key".into()));
        }
        let mut headers = vec![("x-amz-checksum-algorithm", "CRC32C".to_string())];
        if let Some(t) = &opts.content_type {
            headers.push(("Content-Type", t.clone()));
        }
        let err = |f: Failure, attempts: u32| -> Error {
            ObjectError::new(bucket, key, None, f, attempts).into()
        };
        let (_, body) = sh
            .control(
                &Call::new("POST", bucket, key)
                    .query(&[("uploads", "")])
                    .headers(&headers),
                &[],
            )
            .map_err(|(f, a)| err(f, a))?;
        let id = xml::first(&String::from_utf8_lossy(&body), "UploadId").ok_or_else(|| {
            err(
                Failure::Protocol("CreateMultipartUpload answered without an UploadId".into()),
                1,
            )
        })?;
        Ok(Multipart {
            sh: sh.clone(),
            up: Upload::new(bucket, key, Some(id), Vec::new()),
            conditions: conditions(opts),
            ended: AtomicBool::new(false),
        })
    }

    pub fn upload_id(&self) -> &str {
        self.up.upload_id.as_deref().unwrap_or_default()
    }

    /// Queues part `number` (1 to 10000, each once): `len` bytes of
    /// `buffer` from `offset`, which are the object's bytes from
    /// `object_offset` (named in errors). Every part but the last must be
    /// at least 5 MiB (the server checks at completion). The buffer must not
    /// change until the part is done.
    pub fn send_part(
        &self,
        number: u32,
        object_offset: u64,
        buffer: &Buffer,
        offset: u64,
        len: u64,
    ) -> Result<(), Error> {
        check_range(buffer, offset, len)?;
        if !(1..=PARTS_MAX as u32).contains(&number) {
            return Err(Error::Usage(format!(
                "part number {number}: parts are numbered 1 to {PARTS_MAX}"
            )));
        }
        if self.ended.load(Ordering::Relaxed) {
            return Err(Error::Usage("the upload has ended".into()));
        }
        {
            let mut s = self.up.lock();
            if s.results.contains_key(&number) {
                return Err(Error::Usage(format!("part {number} was sent already")));
            }
            // Reserved until it finishes: a second send of the number is refused.
            s.results.insert(
                number,
                Err(ObjectError::new(
                    &self.up.bucket,
                    &self.up.key,
                    None,
                    Failure::Cancelled,
                    0,
                )),
            );
        }
        self.up.enqueue(
            &self.sh,
            PartJob {
                upload: self.up.clone(),
                number,
                buffer: buffer.clone(),
                offset,
                object_offset,
                len,
            },
        );
        Ok(())
    }

    /// Waits until `min` parts have finished since the last call (fewer if
    /// fewer are outstanding) or `timeout` passes; returns them, each with
    /// its failure if it failed for good (after its retries).
    pub fn wait_parts(
        &self,
        min: usize,
        timeout: Option<Duration>,
    ) -> Vec<(u32, Result<(), ObjectError>)> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut s = self.up.lock();
        loop {
            let want = min.min(s.fresh.len() + s.outstanding);
            if s.fresh.len() >= want {
                break;
            }
            s = match deadline {
                None => self.up.changed.wait(s).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    self.up
                        .changed
                        .wait_timeout(s, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
        let fresh: Vec<u32> = s.fresh.drain(..).collect();
        fresh
            .into_iter()
            .map(|n| {
                let r = match s.results.get(&n) {
                    Some(Err(e)) => Err(e.clone()),
                    _ => Ok(()),
                };
                (n, r)
            })
            .collect()
    }

    /// Parts queued or being sent.
    pub fn outstanding(&self) -> usize {
        self.up.lock().outstanding
    }

    /// Waits for every part, then completes the upload (with the
    /// conditions of its options): the object appears now. If a part failed,
    /// or none was sent, or the completion fails, the upload is aborted and
    /// the error returned. Returns the ETag.
    pub fn complete(&self) -> Result<String, Error> {
        if self.ended.swap(true, Ordering::Relaxed) {
            return Err(Error::Usage("the upload has ended".into()));
        }
        self.up.wait_all();
        let bucket = self.up.bucket.as_str();
        let key = self.up.key.as_str();
        let results = std::mem::take(&mut self.up.lock().results);
        // The failure to report: a part's own, not one skipped because of it.
        let first_failure = results
            .values()
            .filter_map(|r| r.as_ref().err())
            .find(|e| e.failure != Failure::Cancelled)
            .or_else(|| results.values().find_map(|r| r.as_ref().err()))
            .cloned();
        if let Some(e) = first_failure {
            let _ = self.abort_request();
            return Err(e.into());
        }
        if results.is_empty() {
            let _ = self.abort_request();
            return Err(Error::Usage(format!(
                "s3://{bucket}/{key}: a multipart upload needs at least one part"
            )));
        }
        let mut xml_body = String::from("<CompleteMultipartUpload>");
        for (n, r) in &results {
            let (etag, crc) = r.as_ref().expect("failures returned above");
            xml_body.push_str(&format!(
                "<Part><PartNumber>{n}</PartNumber><ETag>{}</ETag><ChecksumCRC32C>{crc}</ChecksumCRC32C></Part>",
                xml::escape(etag)
            ));
        }
        xml_body.push_str("</CompleteMultipartUpload>");
        let (_, body) = self
            .sh
            .control(
                &Call::new("POST", bucket, key)
                    .query(&[("uploadId", self.upload_id())])
                    .headers(&self.conditions),
                xml_body.as_bytes(),
            )
            .map_err(|(f, a)| {
                let _ = self.abort_request();
                Error::from(ObjectError::new(bucket, key, None, f, a))
            })?;
        Ok(xml::first(&String::from_utf8_lossy(&body), "ETag").unwrap_or_default())
    }

    /// Stops the parts still queued, waits for those being sent, and aborts
    /// the upload: its parts are dropped and the object does not change.
    pub fn abort(&self) -> Result<(), Error> {
        if self.ended.swap(true, Ordering::Relaxed) {
            return Ok(());
        }
        self.up.failed.store(true, Ordering::Relaxed);
        self.up.wait_all();
        self.abort_request()
    }

    fn abort_request(&self) -> Result<(), Error> {
        let q = [("uploadId", self.upload_id())];
        match self.sh.control(
            &Call::new("DELETE", &self.up.bucket, &self.up.key).query(&q),
            &[],
        ) {
            Ok(_) | Err((Failure::NotFound { .. }, _)) => Ok(()),
            Err((f, a)) => Err(ObjectError::new(&self.up.bucket, &self.up.key, None, f, a).into()),
        }
    }
}

impl Drop for Multipart {
    /// An upload neither completed nor aborted is aborted; either way no
    /// part is in flight once the drop returns (their buffers may go).
    fn drop(&mut self) {
        if !self.ended.load(Ordering::Relaxed) {
            let _ = self.abort();
        } else {
            self.up.wait_all();
        }
    }
}

impl Upload {
    fn new(
        bucket: &str,
        key: &str,
        upload_id: Option<String>,
        single_headers: Vec<(&'static str, String)>,
    ) -> Arc<Upload> {
        Arc::new(Upload {
            bucket: bucket.into(),
            key: key.into(),
            upload_id,
            single_headers,
            state: Mutex::new(Parts::default()),
            changed: Condvar::new(),
            failed: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Parts> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn enqueue(&self, sh: &Shared, job: PartJob) {
        self.lock().outstanding += 1;
        sh.enqueue_parts(vec![Arc::new(job)]);
    }

    /// Until no part is queued or being sent.
    fn wait_all(&self) {
        let mut s = self.lock();
        while s.outstanding > 0 {
            s = self.changed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn finish(&self, number: u32, r: Result<(String, String), ObjectError>) {
        if r.is_err() {
            self.failed.store(true, Ordering::Relaxed);
        }
        let mut s = self.lock();
        s.results.insert(number, r);
        s.fresh.push_back(number);
        s.outstanding -= 1;
        drop(s);
        self.changed.notify_all();
    }
}

/// Sends one part (or the single PUT), with retries.
pub(crate) fn run_part(sh: &Shared, conn: &mut Option<Conn>, p: &PartJob, index: usize) {
    let up = &p.upload;
    let slot = p.number;
    let range = Some((p.object_offset, p.object_offset + p.len));
    let err = |f: Failure, attempts: u32| ObjectError::new(&up.bucket, &up.key, range, f, attempts);
    if up.failed.load(Ordering::Relaxed) {
        up.finish(slot, Err(err(Failure::Cancelled, 0)));
        return;
    }
    // SAFETY: inside the buffer (checked when the part was queued), which
    // the job keeps mapped; uploads only read it.
    let body = unsafe {
        std::slice::from_raw_parts(p.buffer.as_ptr().add(p.offset as usize), p.len as usize)
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
            let h = match cn.send(&head, body) {
                Ok(()) => {
                    sh.counters.bytes_sent.fetch_add(p.len, Ordering::Relaxed);
                    cn.read_head().map_err(|e| io(cn, e))?
                }
                // A server that refuses a body answers before reading it
                // all and closes: its answer (a full drive, a denied
                // write) says more than the broken pipe, when it came in
                // before the close.
                Err(e) => match cn.read_early_head(EARLY_ANSWER_WAIT) {
                    Ok(h) if !(200..300).contains(&h.status) => h,
                    _ => return Err(io(cn, e)),
                },
            };
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
