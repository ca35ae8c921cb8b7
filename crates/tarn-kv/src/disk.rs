//! The NVMe tier: log-structured segment files written with O_DIRECT.
//!
//! Blocks evicted from RAM are appended to the open segment through an aligned
//! write buffer; full buffers go to a flusher thread and stay readable from
//! memory until written. When the tier is full the oldest segment is deleted
//! whole (FIFO), after the engine has moved any pinned block out of it. After a
//! restart the index is rebuilt by scanning record headers; values are
//! verified on every read, not at the scan. Byte layouts: docs/format.md.

use std::collections::VecDeque;
use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::Arc;

use tarn_io::AlignedBuf;

use crate::proto::{crc32c, Digest, DIGEST_BYTES, NAMESPACE_MAX_BYTES};

pub const SEGMENT_MAGIC: u64 = u64::from_le_bytes(*b"TARNKVSG");
pub const SEGMENT_VERSION: u32 = 1;
pub const SEGMENT_HEADER_BYTES: u64 = 4096;
pub const RECORD_MAGIC: u32 = u32::from_le_bytes(*b"TKVR");
pub const RECORD_VERSION: u8 = 1;
/// Records start on this boundary so every read and write is O_DIRECT-able.
pub const RECORD_ALIGN: u64 = 4096;
/// Fixed part of a record header; the namespace and a CRC32C follow it.
pub const RECORD_FIXED_BYTES: usize = 24 + DIGEST_BYTES;
/// Bytes read per step when scanning a segment after a restart.
const SCAN_WINDOW_BYTES: usize = 1 << 20;

const _: () = assert!(RECORD_FIXED_BYTES + NAMESPACE_MAX_BYTES + 4 <= RECORD_ALIGN as usize);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum RecordKind {
    Block = 1,
    /// The key was deleted: a restart must not bring back older copies.
    Tombstone = 2,
}

/// Length of the record header (fixed part, namespace, header CRC).
pub fn record_header_len(namespace_len: usize) -> usize {
    RECORD_FIXED_BYTES + namespace_len + 4
}

/// Bytes a record occupies in its segment, padding included.
pub fn record_len(namespace_len: usize, value_len: u64) -> u64 {
    (record_header_len(namespace_len) as u64 + value_len).next_multiple_of(RECORD_ALIGN)
}

/// Writes a record (header, namespace, header CRC, value) at the end of `buf`,
/// zero-padded to [`RECORD_ALIGN`]. The buffer must have room.
pub fn encode_record(
    buf: &mut AlignedBuf,
    kind: RecordKind,
    namespace: &[u8],
    digest: &Digest,
    value: &[u8],
    value_crc: u32,
) {
    let start = buf.len();
    let total = record_len(namespace.len(), value.len() as u64) as usize;
    assert!(
        buf.remaining() >= total,
        "record does not fit the write buffer"
    );
    let mut head = [0u8; RECORD_FIXED_BYTES];
    head[0..4].copy_from_slice(&RECORD_MAGIC.to_le_bytes());
    head[4] = RECORD_VERSION;
    head[5] = kind as u8;
    head[6..8].copy_from_slice(&(namespace.len() as u16).to_le_bytes());
    head[8..16].copy_from_slice(&(value.len() as u64).to_le_bytes());
    head[16..20].copy_from_slice(&value_crc.to_le_bytes());
    // 20..24 reserved
    head[24..24 + DIGEST_BYTES].copy_from_slice(digest);
    buf.extend_from_slice(&head);
    buf.extend_from_slice(namespace);
    let hcrc = crc32c(&buf[start..]);
    buf.extend_from_slice(&hcrc.to_le_bytes());
    buf.extend_from_slice(value);
    let pad = start + total - buf.len();
    let len = buf.len();
    buf.spare_mut()[..pad].fill(0);
    buf.set_len(len + pad);
}

/// A record header as found on disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordHeader {
    pub kind: RecordKind,
    pub namespace: Vec<u8>,
    pub digest: Digest,
    pub value_len: u64,
    pub value_crc: u32,
}

impl RecordHeader {
    pub fn record_len(&self) -> u64 {
        record_len(self.namespace.len(), self.value_len)
    }
    pub fn value_offset(&self) -> usize {
        record_header_len(self.namespace.len())
    }
}

/// Parses a record header from the start of `b`; `None` for anything that is
/// not an intact header (zeros, torn writes, bit flips).
pub fn decode_record_header(b: &[u8], value_max_bytes: u64) -> Option<RecordHeader> {
    if b.len() < RECORD_FIXED_BYTES + 4 {
        return None;
    }
    if u32::from_le_bytes(b[0..4].try_into().ok()?) != RECORD_MAGIC || b[4] != RECORD_VERSION {
        return None;
    }
    let kind = match b[5] {
        1 => RecordKind::Block,
        2 => RecordKind::Tombstone,
        _ => return None,
    };
    let ns_len = u16::from_le_bytes([b[6], b[7]]) as usize;
    if ns_len > NAMESPACE_MAX_BYTES || b.len() < record_header_len(ns_len) {
        return None;
    }
    let value_len = u64::from_le_bytes(b[8..16].try_into().ok()?);
    if value_len > value_max_bytes {
        return None;
    }
    let value_crc = u32::from_le_bytes(b[16..20].try_into().ok()?);
    let hend = RECORD_FIXED_BYTES + ns_len;
    let hcrc = u32::from_le_bytes(b[hend..hend + 4].try_into().ok()?);
    if crc32c(&b[..hend]) != hcrc {
        return None;
    }
    Some(RecordHeader {
        kind,
        namespace: b[RECORD_FIXED_BYTES..hend].to_vec(),
        digest: b[24..24 + DIGEST_BYTES].try_into().ok()?,
        value_len,
        value_crc,
    })
}

fn segment_header(id: u64, segment_bytes: u64) -> [u8; 36] {
    let mut b = [0u8; 36];
    b[0..8].copy_from_slice(&SEGMENT_MAGIC.to_le_bytes());
    b[8..12].copy_from_slice(&SEGMENT_VERSION.to_le_bytes());
    b[16..24].copy_from_slice(&id.to_le_bytes());
    b[24..32].copy_from_slice(&segment_bytes.to_le_bytes());
    let c = crc32c(&b[..32]);
    b[32..36].copy_from_slice(&c.to_le_bytes());
    b
}

fn check_segment_header(b: &[u8], id: u64) -> bool {
    b.len() >= 36
        && b[0..8] == SEGMENT_MAGIC.to_le_bytes()
        && b[8..12] == SEGMENT_VERSION.to_le_bytes()
        && b[16..24] == id.to_le_bytes()
        && crc32c(&b[..32]).to_le_bytes() == b[32..36]
}

fn segment_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("seg-{id:016x}.tkv"))
}

/// Opens with O_DIRECT, falling back to buffered I/O on filesystems that
/// refuse it (tmpfs). Returns whether O_DIRECT is in effect.
fn open_segment_file(path: &Path, create: bool) -> io::Result<(fs::File, bool)> {
    let mut o = fs::OpenOptions::new();
    o.read(true);
    if create {
        o.write(true).create_new(true);
    }
    match o
        .clone()
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            if create {
                let _ = fs::remove_file(path);
            }
            Ok((o.custom_flags(libc::O_CLOEXEC).open(path)?, false))
        }
        Err(e) => Err(e),
    }
}

/// One segment file.
pub struct Segment {
    pub id: u64,
    path: PathBuf,
    file: Arc<fs::File>,
    /// The same descriptor for async reads on the caller's io_uring.
    pub io: tarn_io::File,
    /// Keys with a record here, for invalidation when the segment is dropped.
    pub keys: Vec<crate::engine::Key>,
}

/// A record's place on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DiskLoc {
    pub segment: u64,
    pub offset: u64,
}

/// How to fetch a record: from the file, or from a buffer not yet written.
pub enum RecordSource {
    File(tarn_io::File, u64),
    Memory(Arc<AlignedBuf>, usize),
}

struct FlushJob {
    file: Arc<fs::File>,
    segment: u64,
    offset: u64,
    buf: Arc<AlignedBuf>,
}

/// Reported back by the flusher thread.
pub struct Flushed {
    pub segment: u64,
    pub offset: u64,
    pub result: io::Result<()>,
}

struct Pending {
    segment: u64,
    offset: u64,
    buf: Arc<AlignedBuf>,
}

struct Open {
    segment: u64,
    /// File offset where `buf` starts.
    buf_offset: u64,
    buf: AlignedBuf,
}

/// The NVMe tier's state; lives inside the engine's lock.
pub struct DiskTier {
    dir: PathBuf,
    pub segment_bytes: u64,
    pub segments_max: usize,
    pub segments: VecDeque<Segment>,
    next_id: u64,
    open: Option<Open>,
    pending: Vec<Pending>,
    spare: Vec<AlignedBuf>,
    buffers_max: usize,
    buffers_allocated: usize,
    write_buffer_bytes: usize,
    flush_tx: Option<mpsc::Sender<FlushJob>>,
    flusher: Option<std::thread::JoinHandle<()>>,
    pub direct_io: bool,
    pub value_max_bytes: u64,
}

/// A record found by the restart scan.
pub struct Scanned {
    pub header: RecordHeader,
    pub loc: DiskLoc,
}

pub struct ScanReport {
    pub records: Vec<Scanned>,
    pub segments: usize,
    /// 4 KiB blocks skipped because no intact header was there.
    pub blocks_skipped: u64,
    pub segments_discarded: usize,
}

impl DiskTier {
    /// Opens the tier on `dir`: scans the segments left by a previous run
    /// (oldest first), so the caller can rebuild its index.
    pub fn open(
        dir: &Path,
        disk_bytes: u64,
        segment_bytes: u64,
        value_max_bytes: u64,
        on_flushed: impl Fn(Flushed) + Send + 'static,
    ) -> io::Result<(DiskTier, ScanReport)> {
        fs::create_dir_all(dir)?;
        let max_record = record_len(NAMESPACE_MAX_BYTES, value_max_bytes);
        let write_buffer_bytes = (max_record.max(4 << 20)) as usize;
        // At least eight segments when the tier is small, so dropping the
        // oldest loses an eighth of it, not half.
        let segment_bytes = segment_bytes
            .min(disk_bytes / 8)
            .max(2 * write_buffer_bytes as u64 + SEGMENT_HEADER_BYTES)
            .next_multiple_of(RECORD_ALIGN);
        if disk_bytes < 2 * segment_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "the KV disk tier needs at least {} bytes (two segments of {segment_bytes})",
                    2 * segment_bytes
                ),
            ));
        }
        let segments_max = (disk_bytes / segment_bytes) as usize;
        let mut ids: Vec<u64> = Vec::new();
        for e in fs::read_dir(dir)? {
            let name = e?.file_name();
            let name = name.to_string_lossy();
            if let Some(hex) = name
                .strip_prefix("seg-")
                .and_then(|s| s.strip_suffix(".tkv"))
            {
                if let Ok(id) = u64::from_str_radix(hex, 16) {
                    ids.push(id);
                }
            }
        }
        ids.sort_unstable();
        let mut report = ScanReport {
            records: Vec::new(),
            segments: 0,
            blocks_skipped: 0,
            segments_discarded: 0,
        };
        // A smaller tier than last time keeps the newest segments.
        while ids.len() > segments_max.saturating_sub(1) {
            let id = ids.remove(0);
            let _ = fs::remove_file(segment_path(dir, id));
            report.segments_discarded += 1;
        }
        let mut segments = VecDeque::new();
        let mut direct_io = true;
        for id in &ids {
            let path = segment_path(dir, *id);
            let (file, direct) = open_segment_file(&path, false)?;
            direct_io &= direct;
            match scan_segment(&file, *id, value_max_bytes, &mut report) {
                Ok(()) => {}
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "unreadable KV segment discarded");
                    let _ = fs::remove_file(&path);
                    report.segments_discarded += 1;
                    continue;
                }
            }
            report.segments += 1;
            let file = Arc::new(file);
            segments.push_back(Segment {
                id: *id,
                path,
                io: io_file(&file)?,
                file,
                keys: Vec::new(),
            });
        }
        let (tx, rx) = mpsc::channel::<FlushJob>();
        let flusher = std::thread::Builder::new()
            .name("tarn-kv-flush".into())
            .spawn(move || {
                for job in rx {
                    let result = job.file.write_all_at(&job.buf, job.offset);
                    on_flushed(Flushed {
                        segment: job.segment,
                        offset: job.offset,
                        result,
                    });
                }
            })?;
        let tier = DiskTier {
            dir: dir.to_path_buf(),
            segment_bytes,
            segments_max,
            segments,
            next_id: ids.last().map(|i| i + 1).unwrap_or(1),
            open: None,
            pending: Vec::new(),
            spare: Vec::new(),
            buffers_max: 8,
            buffers_allocated: 0,
            write_buffer_bytes,
            flush_tx: Some(tx),
            flusher: Some(flusher),
            direct_io,
            value_max_bytes,
        };
        Ok((tier, report))
    }

    pub fn used_bytes(&self) -> u64 {
        self.segments.len() as u64 * self.segment_bytes
    }

    pub fn capacity_bytes(&self) -> u64 {
        self.segments_max as u64 * self.segment_bytes
    }

    /// The segment a key's record is in, if it still exists.
    pub fn segment_mut(&mut self, id: u64) -> Option<&mut Segment> {
        self.segments.iter_mut().find(|s| s.id == id)
    }

    /// True if appending `len` more bytes needs a new segment.
    pub fn needs_new_segment(&self, len: u64) -> bool {
        match &self.open {
            None => true,
            Some(o) => o.buf_offset + o.buf.len() as u64 + len > self.segment_bytes,
        }
    }

    /// True when opening a new segment first drops the oldest.
    pub fn full(&self) -> bool {
        self.segments.len() >= self.segments_max
    }

    /// Removes the oldest segment from the tier (the caller invalidates its
    /// keys, may copy pinned records out with [`read_record_sync`], then
    /// calls [`delete_segment`]).
    pub fn pop_oldest(&mut self) -> Option<Segment> {
        let seg = self.segments.pop_front()?;
        self.pending.retain(|p| p.segment != seg.id);
        if self.open.as_ref().is_some_and(|o| o.segment == seg.id) {
            self.recycle_open();
        }
        Some(seg)
    }

    /// Seals the open segment and starts a new one.
    pub fn start_segment(&mut self) -> io::Result<()> {
        self.seal_buffer()?;
        self.recycle_open();
        let mut buf = self
            .take_buffer()
            .ok_or_else(|| io::Error::new(io::ErrorKind::WouldBlock, "KV flusher is behind"))?;
        let id = self.next_id;
        self.next_id += 1;
        let path = segment_path(&self.dir, id);
        let opened = open_segment_file(&path, true).and_then(|(f, direct)| {
            let f = Arc::new(f);
            Ok((io_file(&f)?, f, direct))
        });
        let (io, file, direct) = match opened {
            Ok(o) => o,
            Err(e) => {
                self.spare.push(buf);
                let _ = fs::remove_file(&path);
                return Err(e);
            }
        };
        if !direct && self.direct_io {
            tracing::warn!(dir = %self.dir.display(), "O_DIRECT refused by the filesystem; KV segments use buffered I/O");
        }
        self.direct_io &= direct;
        buf.extend_from_slice(&segment_header(id, self.segment_bytes));
        let len = buf.len();
        buf.spare_mut()[..SEGMENT_HEADER_BYTES as usize - len].fill(0);
        buf.set_len(SEGMENT_HEADER_BYTES as usize);
        self.segments.push_back(Segment {
            id,
            path,
            io,
            file,
            keys: Vec::new(),
        });
        self.open = Some(Open {
            segment: id,
            buf_offset: 0,
            buf,
        });
        Ok(())
    }

    /// Closes the open segment for appends; its (sealed, so empty or unsent)
    /// buffer goes back to the spares. Buffers are counted: dropping one
    /// without returning it would shrink the write pipeline for good.
    fn recycle_open(&mut self) {
        if let Some(o) = self.open.take() {
            self.spare.push(o.buf);
        }
    }

    fn take_buffer(&mut self) -> Option<AlignedBuf> {
        if let Some(mut b) = self.spare.pop() {
            b.clear();
            return Some(b);
        }
        if self.buffers_allocated < self.buffers_max {
            self.buffers_allocated += 1;
            return Some(AlignedBuf::with_capacity(self.write_buffer_bytes));
        }
        None
    }

    /// Hands the open buffer to the flusher and starts the next one.
    pub fn seal_buffer(&mut self) -> io::Result<()> {
        let Some(open) = self.open.as_mut() else {
            return Ok(());
        };
        if open.buf.is_empty() {
            return Ok(());
        }
        let segment = open.segment;
        let Some(next) = self.take_buffer() else {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "KV flusher is behind",
            ));
        };
        let open = self.open.as_mut().expect("checked above");
        let buf = Arc::new(std::mem::replace(&mut open.buf, next));
        let offset = open.buf_offset;
        open.buf_offset += buf.len() as u64;
        let file = self
            .segments
            .iter()
            .find(|s| s.id == segment)
            .map(|s| s.file.clone())
            .ok_or_else(|| io::Error::other("open segment missing"))?;
        self.pending.push(Pending {
            segment,
            offset,
            buf: buf.clone(),
        });
        if let Some(tx) = &self.flush_tx {
            let _ = tx.send(FlushJob {
                file,
                segment,
                offset,
                buf,
            });
        }
        Ok(())
    }

    /// Appends a record to the open segment (which must have room: see
    /// [`needs_new_segment`]). `None` when the flusher is too far behind:
    /// the caller drops the block rather than wait.
    pub fn append(
        &mut self,
        kind: RecordKind,
        namespace: &[u8],
        digest: &Digest,
        value: &[u8],
        value_crc: u32,
    ) -> Option<DiskLoc> {
        let len = record_len(namespace.len(), value.len() as u64) as usize;
        let open = self.open.as_ref()?;
        if open.buf.remaining() < len {
            self.seal_buffer().ok()?;
        }
        let open = self.open.as_mut()?;
        let loc = DiskLoc {
            segment: open.segment,
            offset: open.buf_offset + open.buf.len() as u64,
        };
        encode_record(&mut open.buf, kind, namespace, digest, value, value_crc);
        Some(loc)
    }

    /// Where to read the record at `loc`: a buffer still in memory (the open one
    /// is sealed first) or the file.
    /// None only when the record's segment is gone.
    pub fn source(&mut self, loc: DiskLoc, record_len: usize) -> Option<RecordSource> {
        if let Some(o) = &self.open {
            if o.segment == loc.segment && loc.offset >= o.buf_offset && self.seal_buffer().is_err()
            {
                // The flusher is behind and no buffer is free to swap in:
                // copy the record out of the open buffer instead.
                let o = self.open.as_ref()?;
                let start = (loc.offset - o.buf_offset) as usize;
                let bytes = o.buf.get(start..start + record_len)?;
                let mut copy = AlignedBuf::with_capacity(record_len);
                copy.extend_from_slice(bytes);
                return Some(RecordSource::Memory(Arc::new(copy), 0));
            }
        }
        for p in &self.pending {
            if p.segment == loc.segment
                && loc.offset >= p.offset
                && loc.offset < p.offset + p.buf.len() as u64
            {
                return Some(RecordSource::Memory(
                    p.buf.clone(),
                    (loc.offset - p.offset) as usize,
                ));
            }
        }
        let seg = self.segments.iter().find(|s| s.id == loc.segment)?;
        Some(RecordSource::File(seg.io.clone(), loc.offset))
    }

    /// Whether buffers handed to the flusher are not written yet.
    pub fn writes_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// A flush finished: the buffer's records are now read from the file.
    pub fn flushed(&mut self, f: &Flushed) {
        if let Some(i) = self
            .pending
            .iter()
            .position(|p| p.segment == f.segment && p.offset == f.offset)
        {
            let p = self.pending.swap_remove(i);
            if let Ok(buf) = Arc::try_unwrap(p.buf) {
                self.spare.push(buf);
                return;
            }
        }
        // The buffer is still shared with a reader (or its segment is gone):
        // allow a fresh allocation in its place.
        self.buffers_allocated = self.buffers_allocated.saturating_sub(1);
    }

    /// Pins the segment's file so it can be read synchronously after
    /// [`pop_oldest`] (relocating pinned records).
    pub fn read_record_sync(
        seg: &Segment,
        loc: DiskLoc,
        namespace_len: usize,
        value_len: u64,
    ) -> io::Result<AlignedBuf> {
        let len = record_len(namespace_len, value_len) as usize;
        let mut buf = AlignedBuf::with_capacity(len);
        let n = {
            let spare = &mut buf.spare_mut()[..len];
            seg.file.read_at(spare, loc.offset)?
        };
        if n != len {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "short record"));
        }
        buf.set_len(len);
        Ok(buf)
    }

    pub fn delete_segment(seg: Segment) {
        if let Err(error) = fs::remove_file(&seg.path) {
            tracing::warn!(path = %seg.path.display(), %error, "could not delete a KV segment");
        }
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        // Write what is buffered (a clean shutdown keeps it), then stop the flusher.
        let _ = self.seal_buffer();
        self.flush_tx.take();
        if let Some(t) = self.flusher.take() {
            let _ = t.join();
        }
    }
}

fn io_file(file: &Arc<fs::File>) -> io::Result<tarn_io::File> {
    let fd: OwnedFd = file.try_clone()?.into();
    Ok(tarn_io::File::from_fd(fd))
}

/// A sliding read window over a segment file (aligned for O_DIRECT).
struct Window {
    buf: AlignedBuf,
    at: u64,
}

impl Window {
    /// Makes the 4 KiB block at `at` available in the window; false at EOF.
    fn cover(&mut self, file: &fs::File, len: u64, at: u64) -> io::Result<bool> {
        if self.at != u64::MAX
            && at >= self.at
            && at + RECORD_ALIGN <= self.at + self.buf.len() as u64
        {
            return Ok(true);
        }
        if at >= len {
            return Ok(false);
        }
        let want = ((SCAN_WINDOW_BYTES as u64).min(len - at) as usize)
            .next_multiple_of(RECORD_ALIGN as usize);
        self.buf.clear();
        let n = file.read_at(&mut self.buf.spare_mut()[..want], at)?;
        self.buf.set_len(n);
        self.at = at;
        Ok(n as u64 >= RECORD_ALIGN)
    }
}

/// Reads record headers of one segment into `report`. A damaged header skips
/// to the next 4 KiB boundary that holds an intact one.
fn scan_segment(
    file: &fs::File,
    id: u64,
    value_max_bytes: u64,
    report: &mut ScanReport,
) -> io::Result<()> {
    let len = file.metadata()?.len();
    let mut w = Window {
        buf: AlignedBuf::with_capacity(SCAN_WINDOW_BYTES),
        at: u64::MAX,
    };
    if !w.cover(file, len, 0)? || !check_segment_header(&w.buf[..], id) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "bad segment header",
        ));
    }
    let mut at = SEGMENT_HEADER_BYTES;
    while at < len {
        if !w.cover(file, len, at)? {
            break;
        }
        let rel = (at - w.at) as usize;
        match decode_record_header(&w.buf[rel..], value_max_bytes) {
            Some(h) => {
                let rl = h.record_len();
                report.records.push(Scanned {
                    header: h,
                    loc: DiskLoc {
                        segment: id,
                        offset: at,
                    },
                });
                at += rl;
            }
            None => {
                report.blocks_skipped += 1;
                at += RECORD_ALIGN;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_roundtrip_and_damage() {
        let mut buf = AlignedBuf::with_capacity(1 << 20);
        let value: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let d = [7u8; 32];
        encode_record(
            &mut buf,
            RecordKind::Block,
            b"model-a",
            &d,
            &value,
            crc32c(&value),
        );
        assert_eq!(buf.len() as u64, record_len(7, value.len() as u64));
        assert_eq!(buf.len() % 4096, 0);
        let h = decode_record_header(&buf, 1 << 20).unwrap();
        assert_eq!(h.namespace, b"model-a");
        assert_eq!(h.digest, d);
        assert_eq!(h.value_len, value.len() as u64);
        let v = &buf[h.value_offset()..h.value_offset() + value.len()];
        assert_eq!(v, &value[..]);
        // Any flipped header bit is detected.
        for byte in 0..record_header_len(7) {
            let mut b = buf[..4096].to_vec();
            b[byte] ^= 0x10;
            assert!(decode_record_header(&b, 1 << 20).is_none(), "byte {byte}");
        }
        // A value longer than allowed is refused.
        assert!(decode_record_header(&buf, 100).is_none());
    }
}
