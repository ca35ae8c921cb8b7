//! Inodes: one per directory (a prefix) and one per version of a file (a
//! key and its ETag). A name whose object changed gets a new inode, so an
//! inode's attributes and the kernel's page cache of it never change under
//! a reader that opened it; the old inode lives until the kernel forgets it.

use std::collections::HashMap;
use std::time::{Instant, SystemTime};

pub const ROOT: u64 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    File,
    Dir,
}

/// What a file inode is a version of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Version {
    pub size: u64,
    pub etag: String,
    pub mtime: SystemTime,
}

#[derive(Debug, Clone)]
pub struct Node {
    pub parent: u64,
    pub name: String,
    pub kind: Kind,
    /// A file's key, or a directory's prefix (ending in `/`, or empty for
    /// the root of a whole bucket).
    pub key: String,
    /// Files: the version. Directories: size 0, no ETag, the mount's time.
    pub version: Version,
    /// Until when the name → inode binding is trusted without asking the
    /// bucket again.
    pub fresh_until: Instant,
    /// Lookups the kernel holds (FUSE's nlookup).
    pub lookups: u64,
    /// Made here and not in the bucket (yet): a directory from `mkdir`, a
    /// file being written. Never expires; goes with `forget` or removal.
    pub local: bool,
}

#[derive(Default)]
pub struct Table {
    nodes: HashMap<u64, Node>,
    /// (parent, name) → the inode the name stands for now.
    names: HashMap<(u64, String), u64>,
    next: u64,
}

impl Table {
    pub fn new(root_key: String, now: SystemTime) -> Table {
        let mut t = Table {
            nodes: HashMap::new(),
            names: HashMap::new(),
            next: ROOT + 1,
        };
        t.nodes.insert(
            ROOT,
            Node {
                parent: ROOT,
                name: String::new(),
                kind: Kind::Dir,
                key: root_key,
                version: dir_version(now),
                fresh_until: far_future(),
                lookups: 1,
                local: true,
            },
        );
        t
    }

    pub fn get(&self, ino: u64) -> Option<&Node> {
        self.nodes.get(&ino)
    }

    pub fn get_mut(&mut self, ino: u64) -> Option<&mut Node> {
        self.nodes.get_mut(&ino)
    }

    /// The inode `name` in `parent` stands for now, if known.
    pub fn child(&self, parent: u64, name: &str) -> Option<u64> {
        self.names.get(&(parent, name.to_string())).copied()
    }

    /// Names known under `parent` (local ones included).
    pub fn children(&self, parent: u64) -> Vec<(String, u64)> {
        self.names
            .iter()
            .filter(|((p, _), _)| *p == parent)
            .map(|((_, n), &i)| (n.clone(), i))
            .collect()
    }

    /// Binds `name` in `parent` to what the bucket says it is: the same
    /// inode when it is the same directory or the same version of a file,
    /// else a new one (the old inode stays for whoever holds it). Returns
    /// the inode.
    pub fn bind(
        &mut self,
        parent: u64,
        name: &str,
        kind: Kind,
        version: Version,
        fresh_until: Instant,
    ) -> u64 {
        if let Some(&ino) = self.names.get(&(parent, name.to_string())) {
            let n = self.nodes.get_mut(&ino).expect("named inodes exist");
            if n.local && n.kind == kind {
                // A file being written stays what the name is until it is
                // closed; a directory made here now exists in the bucket.
                if kind == Kind::Dir {
                    n.local = false;
                    n.fresh_until = fresh_until;
                }
                return ino;
            }
            let same = n.kind == kind
                && (kind == Kind::Dir || (n.version.etag == version.etag && !n.local));
            if same {
                n.fresh_until = fresh_until;
                if kind == Kind::File {
                    n.version = version;
                }
                return ino;
            }
        }
        let ino = self.next;
        self.next += 1;
        let key = self.key_in(parent, name, kind);
        let version = match kind {
            Kind::Dir => dir_version(version.mtime),
            Kind::File => version,
        };
        self.nodes.insert(
            ino,
            Node {
                parent,
                name: name.to_string(),
                kind,
                key,
                version,
                fresh_until,
                lookups: 0,
                local: false,
            },
        );
        self.names.insert((parent, name.to_string()), ino);
        ino
    }

    /// The object key (a directory's: its prefix) of `name` in `parent`.
    fn key_in(&self, parent: u64, name: &str, kind: Kind) -> String {
        let base = &self.nodes[&parent].key;
        match kind {
            Kind::File => format!("{base}{name}"),
            Kind::Dir => format!("{base}{name}/"),
        }
    }

    /// A local inode for `name` (mkdir, a file being created), bound now.
    pub fn bind_local(&mut self, parent: u64, name: &str, kind: Kind, now: SystemTime) -> u64 {
        let ino = self.bind(
            parent,
            name,
            kind,
            Version {
                size: 0,
                etag: String::new(),
                mtime: now,
            },
            far_future(),
        );
        let n = self.nodes.get_mut(&ino).expect("just bound");
        n.local = true;
        n.fresh_until = far_future();
        n.version = Version {
            size: 0,
            etag: String::new(),
            mtime: now,
        };
        ino
    }

    /// `name` in `parent` is no longer there (as the bucket says, or
    /// removed here). Its inode stays until forgotten.
    pub fn unbind(&mut self, parent: u64, name: &str) -> Option<u64> {
        self.names.remove(&(parent, name.to_string()))
    }

    /// File `ino` is now `name` in `parent`, as `version` (a rename: the
    /// kernel keeps the inode it holds under the new name). What the new
    /// name stood for before is unbound (its inode stays for its holders).
    pub fn rename(
        &mut self,
        ino: u64,
        parent: u64,
        name: &str,
        version: Version,
        fresh_until: Instant,
    ) {
        let Some(n) = self.nodes.get(&ino) else {
            return;
        };
        let old = (n.parent, n.name.clone());
        if self.names.get(&old) == Some(&ino) {
            self.names.remove(&old);
        }
        let key = self.key_in(parent, name, Kind::File);
        let n = self.nodes.get_mut(&ino).expect("checked above");
        n.parent = parent;
        n.name = name.to_string();
        n.key = key;
        n.version = version;
        n.fresh_until = fresh_until;
        n.local = false;
        self.names.insert((parent, name.to_string()), ino);
    }

    /// The kernel took a reference (a lookup, create or mkdir answered).
    pub fn looked_up(&mut self, ino: u64) {
        if let Some(n) = self.nodes.get_mut(&ino) {
            n.lookups += 1;
        }
    }

    /// The kernel dropped `n` references; an inode nobody holds and no name
    /// points to is gone.
    pub fn forget(&mut self, ino: u64, n: u64) {
        if ino == ROOT {
            return;
        }
        let Some(node) = self.nodes.get_mut(&ino) else {
            return;
        };
        node.lookups = node.lookups.saturating_sub(n);
        if node.lookups > 0 {
            return;
        }
        let key = (node.parent, node.name.clone());
        // Still what its name stands for: it stays (a lookup of that name
        // may be answering with it right now, and the next one gives the
        // same inode back). Unnamed, it is gone.
        if self.names.get(&key) != Some(&ino) {
            self.nodes.remove(&ino);
        }
    }

    /// The names under `parent` whose inodes the bucket did not list: no
    /// longer bound (local ones stay).
    pub fn unbind_missing(&mut self, parent: u64, listed: &std::collections::HashSet<String>) {
        let gone: Vec<String> = self
            .names
            .iter()
            .filter(|((p, n), ino)| *p == parent && !listed.contains(n) && !self.nodes[ino].local)
            .map(|((_, n), _)| n.clone())
            .collect();
        for n in gone {
            self.names.remove(&(parent, n));
        }
    }
}

fn dir_version(mtime: SystemTime) -> Version {
    Version {
        size: 0,
        etag: String::new(),
        mtime,
    }
}

pub fn far_future() -> Instant {
    Instant::now() + std::time::Duration::from_secs(100 * 365 * 86_400)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn v(etag: &str, size: u64) -> Version {
        Version {
            size,
            etag: etag.into(),
            mtime: SystemTime::UNIX_EPOCH,
        }
    }

    #[test]
    fn a_renamed_file_keeps_its_inode_under_the_new_name() {
        let mut t = Table::new(String::new(), SystemTime::UNIX_EPOCH);
        let soon = Instant::now() + Duration::from_secs(60);
        let d = t.bind(ROOT, "d", Kind::Dir, v("", 0), soon);
        let f = t.bind(d, "f", Kind::File, v("e1", 3), soon);
        let other = t.bind(ROOT, "g", Kind::File, v("e0", 9), soon);
        t.rename(f, ROOT, "g", v("e2", 3), soon);
        assert_eq!(t.child(ROOT, "g"), Some(f));
        assert_eq!(t.child(d, "f"), None);
        let n = t.get(f).unwrap();
        assert_eq!(
            (n.key.as_str(), n.version.etag.as_str(), n.parent),
            ("g", "e2", ROOT)
        );
        // What "g" was stays for whoever holds it.
        assert_eq!(t.get(other).unwrap().key, "g");
    }

    #[test]
    fn a_changed_object_gets_a_new_inode_and_the_old_one_stays_until_forgotten() {
        let mut t = Table::new("pre/".into(), SystemTime::UNIX_EPOCH);
        let soon = Instant::now() + Duration::from_secs(1);
        let a = t.bind(ROOT, "f", Kind::File, v("\"1\"", 3), soon);
        t.looked_up(a);
        assert_eq!(t.get(a).unwrap().key, "pre/f");
        // Same version: same inode.
        assert_eq!(t.bind(ROOT, "f", Kind::File, v("\"1\"", 3), soon), a);
        // Changed: a new inode; the old one keeps its version.
        let b = t.bind(ROOT, "f", Kind::File, v("\"2\"", 5), soon);
        assert_ne!(a, b);
        assert_eq!(t.get(a).unwrap().version.size, 3);
        assert_eq!(t.child(ROOT, "f"), Some(b));
        t.forget(a, 1);
        assert!(t.get(a).is_none());
        // A directory keeps its inode; its key ends in '/'.
        let d = t.bind(ROOT, "d", Kind::Dir, v("", 0), soon);
        assert_eq!(t.bind(ROOT, "d", Kind::Dir, v("", 0), soon), d);
        assert_eq!(t.get(d).unwrap().key, "pre/d/");
        let f = t.bind(d, "x", Kind::File, v("\"3\"", 1), soon);
        assert_eq!(t.get(f).unwrap().key, "pre/d/x");
        // A name that became a directory is a new inode.
        assert_ne!(t.bind(ROOT, "f", Kind::Dir, v("", 0), soon), b);
    }

    #[test]
    fn local_names_survive_listings_and_forgets() {
        let mut t = Table::new(String::new(), SystemTime::UNIX_EPOCH);
        let d = t.bind_local(ROOT, "new", Kind::Dir, SystemTime::UNIX_EPOCH);
        t.looked_up(d);
        t.unbind_missing(ROOT, &Default::default());
        assert_eq!(t.child(ROOT, "new"), Some(d));
        t.forget(d, 1);
        assert_eq!(t.child(ROOT, "new"), Some(d));
        assert!(t.get(d).is_some());
    }
}
