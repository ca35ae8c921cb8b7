//! A file being written: sequential writes from offset 0, sent as the parts
//! of a multipart upload while they are written (one PUT when the whole
//! file fits in a part), visible under its name when it is closed (flush)
//! or synced. A write anywhere but at the end fails with EINVAL; nothing is
//! uploaded for a file whose writing failed.

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use tarn_client::object::{Buffer, Multipart, ObjectClient, PutOptions};

use crate::errno::{from_client, from_object, Errno};
use crate::inode::Version;

/// Parts in flight at once before a write waits for one: bounds the memory
/// a fast writer holds to this many parts.
const PARTS_IN_FLIGHT: usize = 4;

pub struct Writer {
    pub bucket: String,
    pub key: String,
    client: ObjectClient,
    part_bytes: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    written: u64,
    part: Vec<u8>,
    upload: Option<Multipart>,
    parts_sent: u32,
    /// The first failure: every later call gives it.
    failed: Option<Errno>,
    /// Set once the upload ended (the object is there, or it failed).
    done: Option<Result<Version, Errno>>,
    /// An empty object put at a flush before anything was written.
    empty: Option<Version>,
}

impl Writer {
    pub fn new(client: &ObjectClient, bucket: &str, key: &str) -> Arc<Writer> {
        let part_bytes = (client.config().part_bytes as usize).max(5 << 20);
        Arc::new(Writer {
            bucket: bucket.to_string(),
            key: key.to_string(),
            client: client.clone(),
            part_bytes,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether the upload ended (closed, synced or abandoned).
    pub fn is_done(&self) -> bool {
        self.lock().done.is_some()
    }

    /// Bytes written so far.
    pub fn written(&self) -> u64 {
        self.lock().written
    }

    pub fn write(&self, offset: u64, data: &[u8]) -> Result<usize, Errno> {
        let mut st = self.lock();
        if st.done.is_some() {
            tracing::warn!(
                "s3://{}/{}: a write after the file was closed or synced: its upload is done",
                self.bucket,
                self.key
            );
            return Err(libc::EBADF);
        }
        if let Some(e) = st.failed {
            return Err(e);
        }
        if offset != st.written {
            tracing::warn!(
                "s3://{}/{}: a write at offset {offset}, but {} bytes are written: \
                 files are written sequentially",
                self.bucket,
                self.key,
                st.written
            );
            return Err(libc::EINVAL);
        }
        let mut at = 0;
        while at < data.len() {
            let room = self.part_bytes - st.part.len();
            let n = room.min(data.len() - at);
            if st.part.capacity() == 0 {
                st.part.reserve_exact(self.part_bytes);
            }
            st.part.extend_from_slice(&data[at..at + n]);
            at += n;
            if st.part.len() == self.part_bytes {
                if let Err(e) = self.send_part(&mut st) {
                    st.failed = Some(e);
                    return Err(e);
                }
            }
        }
        st.written += data.len() as u64;
        Ok(data.len())
    }

    /// Sends the full part, starting the upload with the first.
    fn send_part(&self, st: &mut State) -> Result<(), Errno> {
        if st.upload.is_none() {
            let up = self
                .client
                .multipart(&self.bucket, &self.key, &PutOptions::default())
                .map_err(|e| from_client(&e, &self.bucket, &self.key))?;
            st.upload = Some(up);
        }
        let up = st.upload.as_ref().expect("started above");
        // Bounded: wait for a part before queuing more than the limit.
        while up.outstanding() >= PARTS_IN_FLIGHT {
            for (_, r) in up.wait_parts(1, None) {
                r.map_err(|e| from_object(&e))?;
            }
        }
        let number = st.parts_sent + 1;
        let object_offset = st.parts_sent as u64 * self.part_bytes as u64;
        let len = st.part.len() as u64;
        let buf = Buffer::from_vec(std::mem::take(&mut st.part));
        up.send_part(number, object_offset, &buf, 0, len)
            .map_err(|e| from_client(&e, &self.bucket, &self.key))?;
        st.parts_sent = number;
        Ok(())
    }

    /// A close of one of the file's descriptors. Before anything is written
    /// it may not be the last (a shell's `> file` opens, duplicates the
    /// descriptor and closes the first before the command writes): the
    /// file appears empty now and stays open for writing. Else the upload
    /// ends ([`Writer::finish`]).
    pub fn flush(&self) -> Result<Version, Errno> {
        let mut st = self.lock();
        if st.done.is_none() && st.written == 0 && st.failed.is_none() {
            if let Some(v) = &st.empty {
                return Ok(v.clone());
            }
            let v = self.put_whole(&mut st)?;
            st.empty = Some(v.clone());
            return Ok(v);
        }
        drop(st);
        self.finish()
    }

    /// Ends the upload: the object appears with what was written. Once;
    /// later calls give the same answer.
    pub fn finish(&self) -> Result<Version, Errno> {
        let mut st = self.lock();
        if let Some(done) = &st.done {
            return done.clone();
        }
        if st.written == 0 && st.failed.is_none() {
            if let Some(v) = st.empty.clone() {
                st.done = Some(Ok(v.clone()));
                return Ok(v);
            }
        }
        let result = self.finish_locked(&mut st);
        if result.is_err() {
            if let Some(up) = st.upload.take() {
                let _ = up.abort();
            }
        }
        st.done = Some(result.clone());
        result
    }

    fn finish_locked(&self, st: &mut State) -> Result<Version, Errno> {
        if let Some(e) = st.failed {
            return Err(e);
        }
        if st.upload.is_none() {
            return self.put_whole(st);
        }
        if !st.part.is_empty() {
            self.send_part(st)?;
        }
        let etag = st
            .upload
            .as_ref()
            .expect("an upload")
            .complete()
            .map_err(|e| from_client(&e, &self.bucket, &self.key))?;
        Ok(Version {
            size: st.written,
            etag,
            mtime: SystemTime::now(),
        })
    }

    /// What was written, in one PUT (it fits in a part).
    fn put_whole(&self, st: &mut State) -> Result<Version, Errno> {
        let len = st.part.len() as u64;
        let buf = Buffer::from_vec(std::mem::take(&mut st.part));
        let etag = self
            .client
            .put(
                &self.bucket,
                &self.key,
                &buf,
                0,
                len,
                &PutOptions::default(),
            )
            .map_err(|e| from_client(&e, &self.bucket, &self.key))?;
        Ok(Version {
            size: st.written,
            etag,
            mtime: SystemTime::now(),
        })
    }

    /// Drops what was written without uploading it.
    pub fn abandon(&self) {
        let mut st = self.lock();
        if st.done.is_none() {
            if let Some(up) = st.upload.take() {
                let _ = up.abort();
            }
            st.done = Some(Err(libc::EIO));
        }
    }
}
