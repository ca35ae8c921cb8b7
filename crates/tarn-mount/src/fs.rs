//! The file system: FUSE operations on a bucket (or a prefix of one) through
//! the object client. Semantics in docs/mount.md.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use fuser::{
    Errno as FuseErrno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, InitFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, TimeOrNow, WriteFlags,
};
use tarn_client::object::{Buffer, ObjectClient, PutOptions};

use crate::cache::Cache;
use crate::errno::{from_client, Errno};
use crate::inode::{Kind, Table, Version, ROOT};
use crate::pool::Pool;
use crate::reader::Reader;
use crate::time::{parse_http_date, parse_iso8601};
use crate::writer::Writer;

/// What the mount was asked for.
#[derive(Debug, Clone)]
pub struct Options {
    pub bucket: String,
    /// Empty, or ending in `/`.
    pub prefix: String,
    pub read_only: bool,
    /// How long what the bucket said of a name (it is there, it is that
    /// version, it is not there) is trusted before asking again.
    pub metadata_ttl: Duration,
    pub uid: u32,
    pub gid: u32,
    pub file_mode: u16,
    pub dir_mode: u16,
    /// Read-ahead segments in flight at most per open file.
    pub read_ahead_segments: u64,
    /// `mkdir` writes an empty `name/` object (else a new directory lives
    /// here until a file is written in it).
    pub dir_markers: bool,
    /// Files opened for reading bypass the kernel's page cache.
    pub direct_io: bool,
    /// Threads answering the kernel.
    pub threads: usize,
    /// The cache directory and the bytes it may hold.
    pub cache: Option<(std::path::PathBuf, u64)>,
}

enum Handle {
    Read { ino: u64, reader: Arc<Reader> },
    Write { ino: u64, writer: Arc<Writer> },
    Dir(Arc<Vec<(u64, Kind, String)>>),
}

pub struct TarnFs {
    opts: Options,
    client: ObjectClient,
    pool: Arc<Pool>,
    cache: Option<Arc<Cache>>,
    table: Mutex<Table>,
    handles: Mutex<HashMap<u64, Handle>>,
    next_fh: AtomicU64,
    started: SystemTime,
}

fn fe(e: Errno) -> FuseErrno {
    FuseErrno::from_i32(e)
}

impl TarnFs {
    pub fn new(opts: Options, client: ObjectClient, cache: Option<Arc<Cache>>) -> TarnFs {
        let started = SystemTime::now();
        let pool = Pool::new((opts.read_ahead_segments as usize * 2).clamp(4, 64));
        TarnFs {
            table: Mutex::new(Table::new(opts.prefix.clone(), started)),
            opts,
            client,
            pool,
            cache,
            handles: Mutex::new(HashMap::new()),
            next_fh: AtomicU64::new(1),
            started,
        }
    }

    fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn handles(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Handle>> {
        self.handles.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add_handle(&self, h: Handle) -> u64 {
        let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
        self.handles().insert(fh, h);
        fh
    }

    fn fresh(&self) -> Instant {
        Instant::now() + self.opts.metadata_ttl
    }

    fn attr(&self, ino: u64, kind: Kind, v: &Version) -> FileAttr {
        let write_bits = if self.opts.read_only { 0o222 } else { 0 };
        let (kind, perm, nlink) = match kind {
            Kind::File => (FileType::RegularFile, self.opts.file_mode & !write_bits, 1),
            Kind::Dir => (FileType::Directory, self.opts.dir_mode & !write_bits, 2),
        };
        FileAttr {
            ino: INodeNo(ino),
            size: v.size,
            blocks: v.size.div_ceil(512),
            atime: v.mtime,
            mtime: v.mtime,
            ctime: v.mtime,
            crtime: v.mtime,
            kind,
            perm,
            nlink,
            uid: self.opts.uid,
            gid: self.opts.gid,
            rdev: 0,
            // What cp, tar and friends size their buffers by.
            blksize: 1 << 20,
            flags: 0,
        }
    }

    fn node_attr(&self, ino: u64) -> Option<FileAttr> {
        let t = self.table();
        let n = t.get(ino)?;
        Some(self.attr(ino, n.kind, &n.version))
    }

    /// The key (files) or prefix (directories, with `/`) `name` in
    /// `parent` would have.
    fn child_key(&self, parent: u64, name: &str) -> Result<String, Errno> {
        let t = self.table();
        let p = t.get(parent).ok_or(libc::ENOENT)?;
        if p.kind != Kind::Dir {
            return Err(libc::ENOTDIR);
        }
        Ok(format!("{}{name}", p.key))
    }

    /// What `name` in `parent` is: from the table while fresh, else from the
    /// bucket (a HEAD of the key and a one-entry listing under `key/`, at
    /// once; a directory hides a file of the same name). The inode, not yet
    /// counted as looked up.
    fn resolve(&self, parent: u64, name: &str) -> Result<u64, Errno> {
        {
            let t = self.table();
            if let Some(ino) = t.child(parent, name) {
                let n = t.get(ino).expect("named inodes exist");
                if n.local || n.fresh_until > Instant::now() {
                    return Ok(ino);
                }
            }
        }
        let key = self.child_key(parent, name)?;
        let dir_prefix = format!("{key}/");
        let (head, dir) = std::thread::scope(|s| {
            let listing = s.spawn(|| {
                self.client
                    .list_dir(&self.opts.bucket, &dir_prefix, Some(1))
            });
            let head = self.client.head(&self.opts.bucket, &key);
            (head, listing.join().expect("listing thread"))
        });
        let dir = dir.map_err(|e| from_client(&e, &self.opts.bucket, &dir_prefix))?;
        let mut t = self.table();
        if !dir.objects.is_empty() || !dir.prefixes.is_empty() {
            let v = Version {
                size: 0,
                etag: String::new(),
                mtime: self.started,
            };
            return Ok(t.bind(parent, name, Kind::Dir, v, self.fresh()));
        }
        match head {
            Ok(info) => {
                let v = Version {
                    size: info.size,
                    mtime: parse_http_date(&info.last_modified).unwrap_or(self.started),
                    etag: info.etag,
                };
                Ok(t.bind(parent, name, Kind::File, v, self.fresh()))
            }
            Err(e) => {
                let errno = from_client(&e, &self.opts.bucket, &key);
                if errno == libc::ENOENT {
                    // A local name (a new directory, a file being written)
                    // the bucket does not know yet stays.
                    if let Some(ino) = t.child(parent, name) {
                        if t.get(ino).is_some_and(|n| n.local) {
                            return Ok(ino);
                        }
                    }
                    t.unbind(parent, name);
                }
                Err(errno)
            }
        }
    }

    fn entry(&self, reply: ReplyEntry, r: Result<u64, Errno>) {
        match r {
            Ok(ino) => {
                let attr = {
                    let mut t = self.table();
                    t.looked_up(ino);
                    let n = t.get(ino).expect("resolved");
                    self.attr(ino, n.kind, &n.version)
                };
                reply.entry(&self.opts.metadata_ttl, &attr, Generation(0));
            }
            Err(e) => reply.error(fe(e)),
        }
    }

    /// Lists a directory whole and binds what it holds.
    fn list(&self, ino: u64) -> Result<Vec<(u64, Kind, String)>, Errno> {
        let prefix = {
            let t = self.table();
            let n = t.get(ino).ok_or(libc::ENOENT)?;
            if n.kind != Kind::Dir {
                return Err(libc::ENOTDIR);
            }
            n.key.clone()
        };
        let listing = self
            .client
            .list_dir(&self.opts.bucket, &prefix, None)
            .map_err(|e| from_client(&e, &self.opts.bucket, &prefix))?;
        let fresh = self.fresh();
        let mut t = self.table();
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for p in &listing.prefixes {
            let name = p[prefix.len()..].trim_end_matches('/');
            if !usable_name(name) || p[prefix.len()..].matches('/').count() != 1 {
                continue;
            }
            if seen.insert(name.to_string()) {
                let v = Version {
                    size: 0,
                    etag: String::new(),
                    mtime: self.started,
                };
                out.push((
                    t.bind(ino, name, Kind::Dir, v, fresh),
                    Kind::Dir,
                    name.to_string(),
                ));
            }
        }
        for o in &listing.objects {
            let name = &o.key[prefix.len()..];
            // The directory's own marker, and names a directory hides.
            if !usable_name(name) || seen.contains(name) {
                continue;
            }
            seen.insert(name.to_string());
            let v = Version {
                size: o.size,
                etag: o.etag.clone(),
                mtime: parse_iso8601(&o.last_modified).unwrap_or(self.started),
            };
            out.push((
                t.bind(ino, name, Kind::File, v, fresh),
                Kind::File,
                name.to_string(),
            ));
        }
        t.unbind_missing(ino, &seen);
        for (name, child) in t.children(ino) {
            if !seen.contains(&name) {
                let kind = t.get(child).expect("named").kind;
                out.push((child, kind, name));
            }
        }
        out.sort_by(|a, b| a.2.cmp(&b.2));
        Ok(out)
    }

    /// Ends a write handle's upload (`last`: its release; else a flush) and
    /// makes its inode the version it wrote.
    fn finish_write(&self, ino: u64, writer: &Writer, last: bool) -> Result<(), Errno> {
        let v = if last {
            writer.finish()?
        } else {
            writer.flush()?
        };
        let mut t = self.table();
        if let Some(n) = t.get_mut(ino) {
            n.version = v;
            n.local = false;
            n.fresh_until = Instant::now() + self.opts.metadata_ttl;
        }
        Ok(())
    }

    /// A name to make in `parent` (a writable mount, a usable name) and
    /// what it stands for now, if anything.
    fn new_name<'n>(&self, parent: u64, name: &'n OsStr) -> Result<(&'n str, Option<u64>), Errno> {
        self.writable()?;
        let name = utf8(name)?;
        if !usable_name(name) {
            return Err(libc::EINVAL);
        }
        match self.resolve(parent, name) {
            Ok(ino) => Ok((name, Some(ino))),
            Err(libc::ENOENT) => Ok((name, None)),
            Err(e) => Err(e),
        }
    }

    fn writable(&self) -> Result<(), Errno> {
        if self.opts.read_only {
            Err(libc::EROFS)
        } else {
            Ok(())
        }
    }

    /// A handle still writes it (not closed yet: its release may come
    /// after the close returned).
    fn is_being_written(&self, ino: u64) -> bool {
        self.handles().values().any(
            |h| matches!(h, Handle::Write { ino: i, writer } if *i == ino && !writer.is_done()),
        )
    }
}

/// A name a key can stand for here: not empty, no `/`, not `.` or `..`.
fn usable_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains('/')
}

fn utf8(name: &OsStr) -> Result<&str, Errno> {
    name.to_str().ok_or(libc::EINVAL)
}

impl Filesystem for TarnFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        let _ = config.add_capabilities(
            InitFlags::FUSE_ATOMIC_O_TRUNC
                | InitFlags::FUSE_ASYNC_READ
                | InitFlags::FUSE_PARALLEL_DIROPS
                | InitFlags::FUSE_BIG_WRITES
                | InitFlags::FUSE_MAX_PAGES,
        );
        if self.opts.direct_io {
            // mmap of a file opened with direct I/O (6.6+ kernels; older
            // ones refuse shared mappings of such files).
            let _ = config.add_capabilities(InitFlags::FUSE_DIRECT_IO_ALLOW_MMAP);
        }
        let _ = config.set_max_write(1 << 20);
        let _ = config.set_max_readahead(1 << 20);
        let _ = config.set_max_background(64);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = utf8(name)
            .map_err(|_| libc::ENOENT)
            .and_then(|n| {
                if usable_name(n) {
                    Ok(n)
                } else {
                    Err(libc::ENOENT)
                }
            })
            .and_then(|n| self.resolve(parent.0, n));
        match r {
            // Not there: the kernel keeps that for the TTL too (a negative
            // entry, inode 0), so the many stats of names that do not
            // exist (an import's search path, a loader's probing) cost one
            // lookup each.
            Err(libc::ENOENT) if !self.opts.metadata_ttl.is_zero() => {
                let none = Version {
                    size: 0,
                    etag: String::new(),
                    mtime: self.started,
                };
                let attr = self.attr(0, Kind::File, &none);
                reply.entry(&self.opts.metadata_ttl, &attr, Generation(0));
            }
            r => self.entry(reply, r),
        }
    }

    fn forget(&self, _req: &Request, ino: INodeNo, nlookup: u64) {
        self.table().forget(ino.0, nlookup);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.node_attr(ino.0) {
            // An inode is one version: its attributes do not change (a
            // file being written grows, and says so).
            Some(a) => reply.attr(&self.opts.metadata_ttl, &a),
            None => reply.error(FuseErrno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let Some(attr) = self.node_attr(ino.0) else {
            return reply.error(FuseErrno::ENOENT);
        };
        let writing = self.is_being_written(ino.0);
        let unchanged_mode = mode.is_none_or(|m| (m & 0o7777) as u16 == attr.perm);
        let unchanged_owner =
            uid.is_none_or(|u| u == attr.uid) && gid.is_none_or(|g| g == attr.gid);
        // A size is kept, or cut to 0 on a file being written and still
        // empty (O_TRUNC without atomic truncation).
        let size_ok = size.is_none_or(|s| {
            s == attr.size
                || (s == 0 && writing && {
                    let h = self.handles();
                    h.values().any(|h| {
                        matches!(h, Handle::Write { ino: i, writer } if *i == ino.0 && writer.written() == 0)
                    })
                })
        });
        // Times: "now" on a file being written is what it will be anyway.
        let times_ok = [atime, mtime]
            .iter()
            .all(|t| t.is_none() || (writing && matches!(t, Some(TimeOrNow::Now))));
        if !(unchanged_mode && unchanged_owner && size_ok && times_ok) {
            tracing::debug!(
                "setattr refused on inode {}: objects keep their mode, owner, size and times",
                ino.0
            );
            return reply.error(FuseErrno::EPERM);
        }
        reply.attr(&self.opts.metadata_ttl, &attr);
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(FuseErrno::EPERM);
    }

    fn mkdir(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        let r = (|| {
            let (name, existing) = self.new_name(parent.0, name)?;
            if existing.is_some() {
                return Err(libc::EEXIST);
            }
            let prefix = format!("{}/", self.child_key(parent.0, name)?);
            if self.opts.dir_markers {
                let empty = Buffer::zeroed(0);
                self.client
                    .put(
                        &self.opts.bucket,
                        &prefix,
                        &empty,
                        0,
                        0,
                        &PutOptions::default(),
                    )
                    .map_err(|e| from_client(&e, &self.opts.bucket, &prefix))?;
                let v = Version {
                    size: 0,
                    etag: String::new(),
                    mtime: SystemTime::now(),
                };
                let fresh = self.fresh();
                return Ok(self.table().bind(parent.0, name, Kind::Dir, v, fresh));
            }
            Ok(self
                .table()
                .bind_local(parent.0, name, Kind::Dir, SystemTime::now()))
        })();
        self.entry(reply, r);
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            self.writable()?;
            let name = utf8(name).map_err(|_| libc::ENOENT)?;
            let ino = self.resolve(parent.0, name)?;
            let (kind, key) = {
                let t = self.table();
                let n = t.get(ino).expect("resolved");
                (n.kind, n.key.clone())
            };
            if kind == Kind::Dir {
                return Err(libc::EISDIR);
            }
            if self.is_being_written(ino) {
                tracing::warn!(
                    "s3://{}/{key}: unlink of a file still being written",
                    self.opts.bucket
                );
                return Err(libc::EBUSY);
            }
            self.client
                .delete(&self.opts.bucket, &key)
                .map_err(|e| from_client(&e, &self.opts.bucket, &key))?;
            self.table().unbind(parent.0, name);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(fe(e)),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        let r = (|| {
            self.writable()?;
            let name = utf8(name).map_err(|_| libc::ENOENT)?;
            let ino = self.resolve(parent.0, name)?;
            let (kind, prefix, local) = {
                let t = self.table();
                let n = t.get(ino).expect("resolved");
                (n.kind, n.key.clone(), n.local)
            };
            if kind != Kind::Dir {
                return Err(libc::ENOTDIR);
            }
            {
                let t = self.table();
                if t.children(ino)
                    .iter()
                    .any(|(_, c)| t.get(*c).is_some_and(|n| n.local))
                {
                    return Err(libc::ENOTEMPTY);
                }
            }
            // A directory made here may hold files written since.
            let l = self
                .client
                .list_dir(&self.opts.bucket, &prefix, Some(2))
                .map_err(|e| from_client(&e, &self.opts.bucket, &prefix))?;
            let others = l.prefixes.len() + l.objects.iter().filter(|o| o.key != prefix).count();
            if others > 0 {
                return Err(libc::ENOTEMPTY);
            }
            if !local && l.objects.iter().any(|o| o.key == prefix) {
                self.client
                    .delete(&self.opts.bucket, &prefix)
                    .map_err(|e| from_client(&e, &self.opts.bucket, &prefix))?;
            }
            self.table().unbind(parent.0, name);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(fe(e)),
        }
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &std::path::Path,
        reply: ReplyEntry,
    ) {
        reply.error(FuseErrno::EPERM);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        let r = (|| {
            self.writable()?;
            if !flags.is_empty() {
                return Err(libc::EINVAL);
            }
            let name = utf8(name).map_err(|_| libc::ENOENT)?;
            let newname = utf8(newname)?;
            if !usable_name(newname) {
                return Err(libc::EINVAL);
            }
            let ino = self.resolve(parent.0, name)?;
            let (kind, src, etag, size) = {
                let t = self.table();
                let n = t.get(ino).expect("resolved");
                (
                    n.kind,
                    n.key.clone(),
                    n.version.etag.clone(),
                    n.version.size,
                )
            };
            if kind == Kind::Dir {
                // mv copies a directory's files itself on EXDEV.
                return Err(libc::EXDEV);
            }
            if self.is_being_written(ino) {
                return Err(libc::EBUSY);
            }
            match self.resolve(newparent.0, newname) {
                Ok(d) if self.table().get(d).is_some_and(|n| n.kind == Kind::Dir) => {
                    return Err(libc::EISDIR)
                }
                Ok(_) | Err(libc::ENOENT) => {}
                Err(e) => return Err(e),
            }
            let dst = self.child_key(newparent.0, newname)?;
            if dst == src {
                return Ok(());
            }
            let new_etag = self
                .client
                .copy(
                    &self.opts.bucket,
                    &src,
                    &dst,
                    (!etag.is_empty()).then_some(etag.as_str()),
                )
                .map_err(|e| from_client(&e, &self.opts.bucket, &dst))?;
            self.client
                .delete(&self.opts.bucket, &src)
                .map_err(|e| from_client(&e, &self.opts.bucket, &src))?;
            let fresh = self.fresh();
            let v = Version {
                size,
                etag: new_etag,
                mtime: SystemTime::now(),
            };
            // The kernel moves its dentry with the inode it holds: the same
            // inode is now the new name, and the copy's version.
            self.table().rename(ino, newparent.0, newname, v, fresh);
            Ok(())
        })();
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(fe(e)),
        }
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(FuseErrno::EPERM);
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        let node = self.table().get(ino.0).cloned();
        let Some(node) = node else {
            return reply.error(FuseErrno::ENOENT);
        };
        if node.kind == Kind::Dir {
            return reply.error(FuseErrno::EISDIR);
        }
        let trunc = flags.0 & libc::O_TRUNC != 0;
        let r = match flags.acc_mode() {
            OpenAccMode::O_RDONLY => {
                if node.local || self.is_being_written(ino.0) {
                    tracing::warn!(
                        "s3://{}/{}: opened for reading while it is being written: \
                         it is visible when closed",
                        self.opts.bucket,
                        node.key
                    );
                    Err(libc::EBUSY)
                } else {
                    match Reader::open(
                        &self.client,
                        &self.pool,
                        self.cache.as_ref(),
                        &self.opts.bucket,
                        &node.key,
                        &node.version.etag,
                        node.version.size,
                        self.opts.read_ahead_segments,
                    ) {
                        Ok(reader) => Ok(self.add_handle(Handle::Read { ino: ino.0, reader })),
                        // The version this inode is has gone (replaced or
                        // deleted): the kernel looks the name up again and
                        // opens what it is now.
                        Err(libc::ESTALE) => {
                            self.table().unbind(node.parent, &node.name);
                            Err(libc::ESTALE)
                        }
                        Err(e) => Err(e),
                    }
                }
            }
            OpenAccMode::O_WRONLY | OpenAccMode::O_RDWR => (|| {
                self.writable()?;
                if flags.0 & libc::O_APPEND != 0 && node.version.size > 0 {
                    tracing::warn!(
                        "s3://{}/{}: appends are not supported",
                        self.opts.bucket,
                        node.key
                    );
                    return Err(libc::EOPNOTSUPP);
                }
                if !trunc && node.version.size > 0 {
                    tracing::warn!(
                        "s3://{}/{}: opened for writing without O_TRUNC: files are \
                         replaced whole, never changed in place",
                        self.opts.bucket,
                        node.key
                    );
                    return Err(libc::EPERM);
                }
                if self.is_being_written(ino.0) {
                    return Err(libc::EBUSY);
                }
                // The kernel truncated this inode's page cache: readers
                // that have it open here see what is written, and what
                // they read past it must not be the old version's bytes,
                // which would stay in the page cache for the new one.
                for h in self.handles().values() {
                    if let Handle::Read { ino: i, reader } = h {
                        if *i == ino.0 {
                            reader.supersede();
                        }
                    }
                }
                let writer = Writer::new(&self.client, &self.opts.bucket, &node.key);
                Ok(self.add_handle(Handle::Write { ino: ino.0, writer }))
            })(),
        };
        // `--direct-io`: the kernel hands reads to the mount as they come
        // and copies the reply straight into the reader's buffer, not into
        // its page cache first.
        let direct = self.opts.direct_io && flags.acc_mode() == OpenAccMode::O_RDONLY;
        match r {
            Ok(fh) if direct => reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO),
            // An inode is one version: what the kernel has cached of it
            // stays good.
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
            Err(e) => reply.error(fe(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let reader = match self.handles().get(&fh.0) {
            Some(Handle::Read { reader, .. }) => reader.clone(),
            _ => return reply.error(FuseErrno::EBADF),
        };
        match reader.read(offset, size) {
            Ok(d) => reply.data(d.as_slice()),
            Err(e) => reply.error(fe(e)),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let writer = match self.handles().get(&fh.0) {
            Some(Handle::Write { writer, .. }) => writer.clone(),
            _ => return reply.error(FuseErrno::EBADF),
        };
        match writer.write(offset, data) {
            Ok(n) => {
                if let Some(node) = self.table().get_mut(ino.0) {
                    node.version.size = writer.written();
                }
                reply.written(n as u32)
            }
            Err(e) => reply.error(fe(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let w = match self.handles().get(&fh.0) {
            Some(Handle::Write { ino, writer }) => Some((*ino, writer.clone())),
            _ => None,
        };
        match w.map(|(ino, w)| self.finish_write(ino, &w, false)) {
            None | Some(Ok(())) => reply.ok(),
            Some(Err(e)) => reply.error(fe(e)),
        }
    }

    fn fsync(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        self.flush(req, ino, fh, LockOwner(0), reply);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        let h = self.handles().remove(&fh.0);
        if let Some(Handle::Write { ino, writer }) = h {
            if let Err(e) = self.finish_write(ino, &writer, true) {
                tracing::error!(
                    "s3://{}/{}: not uploaded (errno {e})",
                    self.opts.bucket,
                    writer.key
                );
                // A file that never made it is not there.
                let mut t = self.table();
                if let Some(n) = t.get(ino).cloned() {
                    if n.local {
                        t.unbind(n.parent, &n.name);
                    }
                }
            }
        }
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.list(ino.0) {
            Ok(entries) => {
                let fh = self.add_handle(Handle::Dir(Arc::new(entries)));
                reply.opened(FileHandle(fh), FopenFlags::empty());
            }
            Err(e) => reply.error(fe(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let entries = match self.handles().get(&fh.0) {
            Some(Handle::Dir(e)) => e.clone(),
            _ => return reply.error(FuseErrno::EBADF),
        };
        let parent = self.table().get(ino.0).map(|n| n.parent).unwrap_or(ROOT);
        let dots = [(ino.0, Kind::Dir, "."), (parent, Kind::Dir, "..")];
        let all = dots
            .iter()
            .map(|(i, k, n)| (*i, *k, *n))
            .chain(entries.iter().map(|(i, k, n)| (*i, *k, n.as_str())));
        for (i, (child, kind, name)) in all.enumerate().skip(offset as usize) {
            let kind = match kind {
                Kind::File => FileType::RegularFile,
                Kind::Dir => FileType::Directory,
            };
            if reply.add(INodeNo(child), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.handles().remove(&fh.0);
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // A bucket has no size: a petabyte free, as far as tools that check
        // for room can tell.
        let blocks = 1u64 << 38;
        reply.statfs(blocks, blocks, blocks, 1 << 32, 1 << 32, 4096, 1024, 4096);
    }

    fn create(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        _mode: u32,
        _umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        let r = (|| {
            let (name, existing) = self.new_name(parent.0, name)?;
            if let Some(existing) = existing {
                let n = self.table().get(existing).cloned().expect("resolved");
                if n.kind == Kind::Dir {
                    return Err(libc::EISDIR);
                }
                if flags & libc::O_EXCL != 0 {
                    return Err(libc::EEXIST);
                }
                if flags & libc::O_TRUNC == 0 && n.version.size > 0 {
                    return Err(libc::EPERM);
                }
            }
            if let Some(i) = self.table().child(parent.0, name) {
                if self.is_being_written(i) {
                    return Err(libc::EBUSY);
                }
            }
            let ino = self
                .table()
                .bind_local(parent.0, name, Kind::File, SystemTime::now());
            let key = self.table().get(ino).expect("bound").key.clone();
            let writer = Writer::new(&self.client, &self.opts.bucket, &key);
            let fh = self.add_handle(Handle::Write { ino, writer });
            Ok((ino, fh))
        })();
        match r {
            Ok((ino, fh)) => {
                let attr = {
                    let mut t = self.table();
                    t.looked_up(ino);
                    let n = t.get(ino).expect("bound");
                    self.attr(ino, n.kind, &n.version)
                };
                reply.created(
                    &self.opts.metadata_ttl,
                    &attr,
                    Generation(0),
                    FileHandle(fh),
                    FopenFlags::empty(),
                );
            }
            Err(e) => reply.error(fe(e)),
        }
    }

    fn destroy(&mut self) {
        if let Some(c) = &self.cache {
            tracing::info!(
                "cache dir: {} segment reads from it, {} from the bucket, {} bytes kept",
                c.hits.load(Ordering::Relaxed),
                c.misses.load(Ordering::Relaxed),
                c.used()
            );
        }
        // Files still open for writing at unmount never appear.
        for (_, h) in self.handles().drain() {
            if let Handle::Write { writer, .. } = h {
                tracing::warn!(
                    "s3://{}/{}: still open for writing at unmount: not uploaded",
                    self.opts.bucket,
                    writer.key
                );
                writer.abandon();
            }
        }
    }
}
