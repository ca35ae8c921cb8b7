//! The local cache directory (`--cache-dir DIR --cache-size BYTES`): whole
//! segments of the versions read, kept as files so that a second read of
//! them, in this mount or a later one, comes from the local drive. Bounded
//! in size: the least recently used go first. A segment is named by its
//! version (bucket, key, ETag) and offset, so a replaced object is never
//! served from here; each file carries its identity and the CRC32C of its
//! bytes, checked on every read, and a file that fails is removed and read
//! from the bucket again. Layout in docs/format.md ("Mount cache files").

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::SystemTime;

use crc_fast::CrcAlgorithm;
use tarn_client::object::Buffer;

/// The first bytes of every cache file.
const MAGIC: &[u8; 8] = b"TARNMC01";
/// Magic, header length, data length, offset, data CRC32C, header CRC32C.
const FIXED: usize = 8 + 4 + 8 + 8 + 4 + 4;

pub struct Cache {
    dir: PathBuf,
    limit: u64,
    /// Held (flock) while mounted: one mount per cache directory.
    _lock: File,
    state: Mutex<State>,
    tmp_seq: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
}

#[derive(Default)]
struct State {
    /// File name → its size on disk and its place in the use order.
    entries: HashMap<String, (u64, u64)>,
    order: BTreeMap<u64, String>,
    /// Files being written: their bytes count in `used` already.
    writing: HashSet<String>,
    tick: u64,
    used: u64,
}

impl State {
    fn touch(&mut self, name: &str) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(name) {
            self.order.remove(&e.1);
            e.1 = tick;
            self.order.insert(tick, name.to_string());
        }
    }

    /// Takes the least recently used out until `incoming` more bytes fit
    /// under `limit`; their files are the caller's to remove.
    fn evict(&mut self, incoming: u64, limit: u64) -> Vec<String> {
        let mut gone = Vec::new();
        while self.used + incoming > limit {
            let Some((_, name)) = self.order.pop_first() else {
                break;
            };
            if let Some((size, _)) = self.entries.remove(&name) {
                self.used -= size;
            }
            gone.push(name);
        }
        gone
    }

    fn remove(&mut self, name: &str) -> bool {
        match self.entries.remove(name) {
            Some((size, tick)) => {
                self.order.remove(&tick);
                self.used -= size;
                true
            }
            None => false,
        }
    }
}

/// What names one cached segment.
fn identity(bucket: &str, key: &str, etag: &str) -> Vec<u8> {
    let mut id = Vec::with_capacity(bucket.len() + key.len() + etag.len() + 2);
    id.extend_from_slice(bucket.as_bytes());
    id.push(0);
    id.extend_from_slice(key.as_bytes());
    id.push(0);
    id.extend_from_slice(etag.as_bytes());
    id
}

fn crc32c(b: &[u8]) -> u32 {
    crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, b) as u32
}

fn file_name(id: &[u8], offset: u64) -> String {
    let mut named = id.to_vec();
    named.extend_from_slice(&offset.to_le_bytes());
    format!(
        "{:016x}{:08x}",
        crc_fast::checksum(CrcAlgorithm::Crc64Nvme, &named),
        crc32c(&named)
    )
}

fn is_entry_name(n: &str) -> bool {
    n.len() == 24 && n.bytes().all(|b| b.is_ascii_hexdigit())
}

impl Cache {
    /// Opens (making it, mode 0700) the cache directory. Refused: a
    /// directory another user owns or others may write, and one another
    /// mount is using. What an earlier mount left is kept (and trimmed to
    /// `limit`), its half-written files removed.
    pub fn open(dir: &Path, limit: u64) -> io::Result<Cache> {
        let ctx = |e: io::Error, what: &str| {
            io::Error::new(
                e.kind(),
                format!("cache dir {}: {what}: {e}", dir.display()),
            )
        };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| ctx(e, "cannot create"))?;
        let meta = fs::metadata(dir).map_err(|e| ctx(e, "cannot stat"))?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "cache dir {}: must be a directory of this user's that no one else may write \
                     (owner {}, mode {:o})",
                    dir.display(),
                    meta.uid(),
                    meta.mode() & 0o7777
                ),
            ));
        }
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .mode(0o600)
            .open(dir.join(".lock"))
            .map_err(|e| ctx(e, "cannot open its lock"))?;
        // SAFETY: flock on a file this function owns.
        if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                format!(
                    "cache dir {}: another tarn mount is using it",
                    dir.display()
                ),
            ));
        }
        let tmp = dir.join("tmp");
        let _ = fs::remove_dir_all(&tmp);
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&tmp)
            .map_err(|e| ctx(e, "cannot create tmp"))?;
        let cache = Cache {
            dir: dir.to_path_buf(),
            limit,
            _lock: lock,
            state: Mutex::new(State::default()),
            tmp_seq: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        };
        // What is here, oldest use (modification time: a hit touches it)
        // first.
        let mut found = Vec::new();
        for sub in fs::read_dir(dir).map_err(|e| ctx(e, "cannot list"))? {
            let sub = sub?;
            let n = sub.file_name();
            let n = n.to_string_lossy();
            if n.len() != 2 || !sub.file_type()?.is_dir() {
                continue;
            }
            for f in fs::read_dir(sub.path())? {
                let f = f?;
                let name = f.file_name().to_string_lossy().into_owned();
                if !is_entry_name(&name) {
                    continue;
                }
                let m = f.metadata()?;
                found.push((
                    m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    name,
                    m.len(),
                ));
            }
        }
        found.sort();
        {
            let mut st = cache.lock();
            for (_, name, size) in found {
                st.tick += 1;
                let tick = st.tick;
                st.entries.insert(name.clone(), (size, tick));
                st.order.insert(tick, name);
                st.used += size;
            }
        }
        cache.trim(0);
        Ok(cache)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(&name[..2]).join(name)
    }

    /// Bytes on the drive now.
    pub fn used(&self) -> u64 {
        self.lock().used
    }

    /// Removes the least recently used until `incoming` more bytes fit.
    fn trim(&self, incoming: u64) {
        let gone = self.lock().evict(incoming, self.limit);
        self.remove_files(gone);
    }

    fn remove_files(&self, names: Vec<String>) {
        for name in names {
            let _ = fs::remove_file(self.path(&name));
        }
    }

    /// The segment at `offset` of this version, `len` bytes, if it is here
    /// and whole.
    pub fn get(
        &self,
        bucket: &str,
        key: &str,
        etag: &str,
        offset: u64,
        len: u64,
    ) -> Option<Buffer> {
        if etag.is_empty() {
            return None;
        }
        let id = identity(bucket, key, etag);
        let name = file_name(&id, offset);
        if !self.lock().entries.contains_key(&name) {
            self.misses.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        let path = self.path(&name);
        match read_entry(&path, &id, offset, len) {
            Ok(buf) => {
                self.lock().touch(&name);
                // Its use, for the order a later mount starts from.
                if let Ok(f) = File::open(&path) {
                    let _ = f.set_modified(SystemTime::now());
                }
                self.hits.fetch_add(1, Ordering::Relaxed);
                Some(buf)
            }
            Err(e) => {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!("cache file {}: {e}: removed", path.display());
                }
                self.lock().remove(&name);
                let _ = fs::remove_file(&path);
                self.misses.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    /// Whether the segment at `offset` of this version is here.
    pub fn has(&self, bucket: &str, key: &str, etag: &str, offset: u64) -> bool {
        !etag.is_empty()
            && self
                .lock()
                .entries
                .contains_key(&file_name(&identity(bucket, key, etag), offset))
    }

    /// Keeps `data`, the segment at `offset` of this version. Failures to
    /// write (a full drive) are logged and leave the cache as it was.
    pub fn put(&self, bucket: &str, key: &str, etag: &str, offset: u64, data: &[u8]) {
        if etag.is_empty() {
            return;
        }
        let id = identity(bucket, key, etag);
        let name = file_name(&id, offset);
        let header = header(&id, offset, data);
        let size = (header.len() + data.len()) as u64;
        if size > self.limit {
            return;
        }
        // Room is made and taken at once, so that segments written at the
        // same time never add up past the bound.
        let gone = {
            let mut st = self.lock();
            if st.entries.contains_key(&name) || !st.writing.insert(name.clone()) {
                return;
            }
            let gone = st.evict(size, self.limit);
            if st.used + size > self.limit {
                // The rest is being written: this one is not kept.
                st.writing.remove(&name);
                drop(st);
                self.remove_files(gone);
                return;
            }
            st.used += size;
            gone
        };
        self.remove_files(gone);
        let tmp = self.dir.join("tmp").join(format!(
            "{name}.{}",
            self.tmp_seq.fetch_add(1, Ordering::Relaxed)
        ));
        let done = (|| -> io::Result<()> {
            let mut f = OpenOptions::new()
                .create_new(true)
                .write(true)
                .mode(0o600)
                .open(&tmp)?;
            f.write_all(&header)?;
            f.write_all(data)?;
            drop(f);
            let at = self.path(&name);
            match fs::rename(&tmp, &at) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    fs::DirBuilder::new()
                        .mode(0o700)
                        .create(at.parent().expect("in a subdirectory"))?;
                    fs::rename(&tmp, &at)
                }
                r => r,
            }
        })();
        match done {
            Ok(()) => {
                let mut st = self.lock();
                st.writing.remove(&name);
                st.tick += 1;
                let tick = st.tick;
                if let Some(old) = st.entries.insert(name.clone(), (size, tick)) {
                    st.order.remove(&old.1);
                    st.used -= old.0;
                }
                st.order.insert(tick, name);
            }
            Err(e) => {
                {
                    let mut st = self.lock();
                    st.writing.remove(&name);
                    st.used -= size;
                }
                let _ = fs::remove_file(&tmp);
                tracing::warn!(
                    "cache dir {}: cannot keep a segment of s3://{bucket}/{key}: {e}",
                    self.dir.display()
                );
            }
        }
    }
}

/// A cache file's header: magic, header length (u32), data length (u64),
/// offset in the object (u64), data CRC32C (u32), the identity's length
/// (u32) and the identity (bucket NUL key NUL ETag), then the CRC32C (u32)
/// of all that came before; little-endian.
fn header(id: &[u8], offset: u64, data: &[u8]) -> Vec<u8> {
    let total = FIXED + 4 + id.len();
    let mut h = Vec::with_capacity(total);
    h.extend_from_slice(MAGIC);
    h.extend_from_slice(&(total as u32).to_le_bytes());
    h.extend_from_slice(&(data.len() as u64).to_le_bytes());
    h.extend_from_slice(&offset.to_le_bytes());
    h.extend_from_slice(&crc32c(data).to_le_bytes());
    h.extend_from_slice(&(id.len() as u32).to_le_bytes());
    h.extend_from_slice(id);
    let c = crc32c(&h);
    h.extend_from_slice(&c.to_le_bytes());
    h
}

fn bad(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

fn read_entry(path: &Path, id: &[u8], offset: u64, len: u64) -> io::Result<Buffer> {
    let f = File::open(path)?;
    let total = FIXED + 4 + id.len();
    let mut h = vec![0u8; total];
    f.read_exact_at(&mut h, 0)?;
    let u32_at = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    let u64_at = |i: usize| u64::from_le_bytes(h[i..i + 8].try_into().expect("8 bytes"));
    if &h[..8] != MAGIC {
        return Err(bad("not a cache file"));
    }
    if u32_at(total - 4) != crc32c(&h[..total - 4]) || u32_at(8) as usize != total {
        return Err(bad("header checksum mismatch"));
    }
    if u32_at(32) as usize != id.len() || &h[36..36 + id.len()] != id || u64_at(20) != offset {
        return Err(bad("another segment's file (name collision)"));
    }
    if u64_at(12) != len || f.metadata()?.len() != total as u64 + len {
        return Err(bad("wrong length"));
    }
    let buf = crate::reader::buffer(len as usize);
    // SAFETY: a fresh buffer nobody else holds yet.
    let dst = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), len as usize) };
    f.read_exact_at(dst, total as u64)?;
    if crc32c(dst) != u32_at(28) {
        return Err(bad("data checksum mismatch"));
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("tarn-mount-cache-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn read(c: &Cache, etag: &str, off: u64, len: u64) -> Option<Vec<u8>> {
        c.get("b", "k", etag, off, len)
            .map(|b| unsafe { b.as_slice() }.to_vec())
    }

    #[test]
    fn keeps_checks_and_bounds() {
        let d = tmpdir("bounds");
        let seg = vec![7u8; 1000];
        let c = Cache::open(&d, 3500).unwrap();
        c.put("b", "k", "e1", 0, &seg);
        c.put("b", "k", "e1", 1000, &seg);
        c.put("b", "k", "e1", 2000, &seg);
        assert_eq!(read(&c, "e1", 0, 1000).as_deref(), Some(&seg[..]));
        // Another version or offset is not this entry.
        assert!(read(&c, "e2", 0, 1000).is_none());
        assert!(read(&c, "e1", 1, 1000).is_none());
        assert!(c.has("b", "k", "e1", 1000));
        // A fourth does not fit: the least recently used (1000) goes.
        c.put("b", "k", "e1", 3000, &seg);
        assert!(c.used() <= 3500);
        assert!(!c.has("b", "k", "e1", 1000) && c.has("b", "k", "e1", 0));
        assert!(c.has("b", "k", "e1", 3000));
        // A second mount on the same directory is refused.
        assert!(Cache::open(&d, 3500).is_err());
        drop(c);
        // A later mount finds what was kept.
        let c = Cache::open(&d, 3500).unwrap();
        assert_eq!(read(&c, "e1", 3000, 1000).as_deref(), Some(&seg[..]));
        // A file of another length than the version's segment is not
        // served, and goes.
        assert!(read(&c, "e1", 3000, 999).is_none());
        assert!(!c.has("b", "k", "e1", 3000));
        // A smaller bound trims at open.
        drop(c);
        let c = Cache::open(&d, 1100).unwrap();
        assert!(c.used() <= 1100);
        drop(c);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn segments_written_at_once_stay_under_the_bound() {
        let d = tmpdir("race");
        let c = std::sync::Arc::new(Cache::open(&d, 5 * 1100).unwrap());
        let seg = vec![1u8; 1000];
        std::thread::scope(|s| {
            for t in 0..8u64 {
                let (c, seg) = (c.clone(), &seg);
                s.spawn(move || {
                    for i in 0..50u64 {
                        c.put("b", "k", "e", (t * 1000 + i) * 1000, seg);
                        assert!(c.used() <= 5 * 1100);
                    }
                });
            }
        });
        let on_disk: u64 = fs::read_dir(&d)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().len() == 2)
            .flat_map(|e| fs::read_dir(e.path()).unwrap().flatten())
            .map(|f| f.metadata().unwrap().len())
            .sum();
        assert!(
            on_disk <= 5 * 1100 && on_disk == c.used(),
            "{on_disk} {}",
            c.used()
        );
        drop(c);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_corrupt_file_is_removed_not_served() {
        let d = tmpdir("corrupt");
        let c = Cache::open(&d, 1 << 20).unwrap();
        let seg: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        c.put("b", "k", "e", 0, &seg);
        let name = file_name(&identity("b", "k", "e"), 0);
        let path = c.path(&name);
        let mut bytes = fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 10] ^= 1;
        fs::write(&path, &bytes).unwrap();
        assert!(read(&c, "e", 0, 5000).is_none());
        assert!(!path.exists() && !c.has("b", "k", "e", 0));
        // Written again, it serves again.
        c.put("b", "k", "e", 0, &seg);
        assert_eq!(read(&c, "e", 0, 5000).as_deref(), Some(&seg[..]));
        // Truncated: removed.
        fs::write(&path, &fs::read(&path).unwrap()[..100]).unwrap();
        assert!(read(&c, "e", 0, 5000).is_none());
        drop(c);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn refuses_a_directory_others_may_write() {
        use std::os::unix::fs::PermissionsExt;
        let d = tmpdir("perm");
        fs::create_dir_all(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o777)).unwrap();
        let e = Cache::open(&d, 1 << 20).err().expect("refused");
        assert!(e.to_string().contains("no one else may write"), "{e}");
        fs::remove_dir_all(&d).unwrap();
    }
}
