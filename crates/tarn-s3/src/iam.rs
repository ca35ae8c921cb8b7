//! Users and their access keys. The bootstrap credentials (`--access-key`,
//! `--secret-key`) are the user `root`, as before; every other user is a
//! JSON document in the system bucket (`iam/users/<name>.json`), written
//! through the object engine with its quorum and healing, and read back at
//! start. One document per user is also the form a cluster moves to etcd.
//!
//! SigV4 needs each secret key itself (it is an HMAC key), so secrets are
//! stored encrypted, not hashed: ChaCha20-Poly1305 under a key derived from
//! the root secret key, with the access key as associated data (a secret
//! cannot be moved to another key id). Secrets are returned once, when a key
//! is made, and never logged. Changes take effect at once: the table the
//! S3 front authenticates against is swapped when the document is written.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Nonce};
use hmac::{Hmac, KeyInit as _, Mac};
use s3s::auth::SecretKey;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tarn_store::{Store, StoreError};

use crate::sysdoc;

/// The bootstrap credentials' user.
pub const ROOT_USER: &str = "root";
const USERS_PREFIX: &str = "iam/users/";
/// Longest user name (AWS IAM's limit).
pub const USER_NAME_MAX_CHARS: usize = 64;
const DOC_FORMAT: u32 = 1;
const ACCESS_KEY_PREFIX: &str = "TK";
const ACCESS_KEY_CHARS: usize = 20;
const SECRET_KEY_CHARS: usize = 40;

#[derive(Debug, thiserror::Error)]
pub enum IamError {
    #[error("invalid user name {0:?}: 1 to 64 characters of A-Z a-z 0-9 + = , . @ _ -")]
    InvalidName(String),
    #[error("the user name {0:?} is reserved for the bootstrap credentials")]
    Reserved(String),
    #[error("user {0} already exists")]
    UserExists(String),
    #[error("no such user {0}")]
    NoSuchUser(String),
    #[error("user {user} has no access key {access_key}")]
    NoSuchKey { user: String, access_key: String },
    #[error("invalid imported key: {0}")]
    InvalidKey(String),
    #[error("the access key {0} is taken")]
    KeyTaken(String),
    #[error("stored user record {what} is unreadable: {reason}")]
    Corrupt { what: String, reason: String },
    #[error("the users are not loaded yet (the drives holding them lack a read quorum)")]
    NotLoaded,
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct UserDoc {
    format: u32,
    name: String,
    created_ns: u64,
    keys: Vec<KeyDoc>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct KeyDoc {
    access_key: String,
    /// `v1:` and base64 of nonce (12 bytes) || ciphertext || tag.
    secret: String,
    created_ns: u64,
}

/// A key given to the store rather than made by it (`POST
/// /admin/users/NAME` with a body): an access key of 16 to 128 characters
/// of A-Z and 0-9, a secret of 30 to 128 printable ASCII characters
/// without spaces.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Imported {
    pub access_key: String,
    pub secret_key: String,
}

impl Imported {
    fn check(&self) -> Result<(), IamError> {
        let a = &self.access_key;
        if !(16..=128).contains(&a.len())
            || !a
                .bytes()
                .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit())
        {
            return Err(IamError::InvalidKey(
                "an access key is 16 to 128 characters of A-Z and 0-9".into(),
            ));
        }
        let s = &self.secret_key;
        if !(30..=128).contains(&s.len()) || !s.bytes().all(|c| c.is_ascii_graphic()) {
            return Err(IamError::InvalidKey(
                "a secret key is 30 to 128 printable ASCII characters without spaces".into(),
            ));
        }
        Ok(())
    }
}

/// A key just made: the only time its secret is shown.
#[derive(Debug, Clone)]
pub struct NewKey {
    pub user: String,
    pub access_key: String,
    pub secret_key: String,
}

#[derive(Debug, Clone)]
pub struct UserSummary {
    pub name: String,
    pub created_ns: u64,
    pub access_keys: Vec<String>,
}

#[derive(Default)]
struct Table {
    users: BTreeMap<String, UserDoc>,
    /// access key -> (user, secret key)
    keys: HashMap<String, (Arc<str>, SecretKey)>,
}

pub struct Iam {
    store: Arc<Store>,
    root_access_key: String,
    /// Root's entry, as the table keeps users' keys.
    root: (Arc<str>, SecretKey),
    cipher: ChaCha20Poly1305,
    table: RwLock<Arc<Table>>,
    /// Set once the stored users were read; until then only root's key
    /// works and other keys are answered 503, never "no such key".
    loaded: AtomicBool,
    /// One change at a time: each rewrites one user's document from the table.
    changes: tokio::sync::Mutex<()>,
}

fn now_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn random_chars(n: usize, alphabet: &[u8]) -> String {
    // Rejection sampling keeps every character equally likely.
    let limit = 256 - 256 % alphabet.len();
    let mut out = String::with_capacity(n);
    let mut buf = [0u8; 64];
    while out.len() < n {
        getrandom::fill(&mut buf).expect("the OS random number source");
        for &b in &buf {
            if (b as usize) < limit && out.len() < n {
                out.push(alphabet[b as usize % alphabet.len()] as char);
            }
        }
    }
    out
}

fn valid_name(name: &str) -> bool {
    (1..=USER_NAME_MAX_CHARS).contains(&name.len())
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"+=,.@_-".contains(&c))
}

fn doc_key(name: &str) -> String {
    format!("{USERS_PREFIX}{name}.json")
}

impl Iam {
    /// The users of `store`, not loaded yet (`load`).
    pub fn new(store: Arc<Store>, root_access_key: &str, root_secret_key: &str) -> Arc<Self> {
        let mut mac = Hmac::<Sha256>::new_from_slice(root_secret_key.as_bytes())
            .expect("HMAC takes any key length");
        mac.update(b"tarn/iam/secret-keys/v1");
        let key: [u8; 32] = mac.finalize().into_bytes().into();
        let iam = Iam {
            store,
            root_access_key: root_access_key.to_string(),
            root: (
                Arc::from(ROOT_USER),
                SecretKey::from(root_secret_key.to_string()),
            ),
            cipher: ChaCha20Poly1305::new(&key.into()),
            table: RwLock::new(Arc::new(Table::default())),
            loaded: AtomicBool::new(false),
            changes: tokio::sync::Mutex::new(()),
        };
        Arc::new(iam)
    }

    pub fn is_loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire)
    }

    /// Reads every user from the store (creating the system bucket on first
    /// use); done once, at start, before or while serving.
    pub async fn load(&self) -> Result<(), IamError> {
        self.read_all(false).await
    }

    /// Reads every user again: another node of a cluster changed them.
    pub async fn reload(&self) -> Result<(), IamError> {
        self.read_all(true).await
    }

    async fn read_all(&self, again: bool) -> Result<(), IamError> {
        let _g = self.changes.lock().await;
        if self.is_loaded() && !again {
            return Ok(());
        }
        self.store.ensure_system_bucket().await?;
        let mut users = BTreeMap::new();
        for key in sysdoc::list(&self.store, USERS_PREFIX).await? {
            let doc = self.read_doc(&key).await?;
            users.insert(doc.name.clone(), doc);
        }
        let table = self.table_of(users)?;
        *self.table.write().expect("iam table") = Arc::new(table);
        self.loaded.store(true, Ordering::Release);
        Ok(())
    }

    async fn read_doc(&self, key: &str) -> Result<UserDoc, IamError> {
        let bytes = sysdoc::read(&self.store, key).await?;
        let corrupt = |reason: String| IamError::Corrupt {
            what: key.to_string(),
            reason,
        };
        let doc: UserDoc = serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
        if doc.format != DOC_FORMAT {
            return Err(corrupt(format!(
                "format {} (this build reads {DOC_FORMAT})",
                doc.format
            )));
        }
        if doc_key(&doc.name) != key {
            return Err(corrupt(format!("names user {:?}", doc.name)));
        }
        Ok(doc)
    }

    /// The lookup table for `users`; a secret that does not decrypt (the
    /// root secret key changed) is an error naming the key, never a guess.
    fn table_of(&self, users: BTreeMap<String, UserDoc>) -> Result<Table, IamError> {
        let mut keys = HashMap::new();
        for u in users.values() {
            for k in &u.keys {
                let secret =
                    self.decrypt(&k.access_key, &k.secret)
                        .ok_or_else(|| IamError::Corrupt {
                            what: format!("access key {} of user {}", k.access_key, u.name),
                            reason: "its secret does not decrypt: was the root secret key changed?"
                                .into(),
                        })?;
                keys.insert(
                    k.access_key.clone(),
                    (Arc::from(u.name.as_str()), SecretKey::from(secret)),
                );
            }
        }
        Ok(Table { users, keys })
    }

    /// Seals `secret` under the key derived from the root secret, bound to
    /// `access_key` (any other label a caller gives it: the cache's
    /// upstream credentials use `cache:<bucket>:<key id>`).
    pub(crate) fn encrypt(&self, access_key: &str, secret: &str) -> String {
        let mut nonce = [0u8; 12];
        getrandom::fill(&mut nonce).expect("the OS random number source");
        let sealed = self
            .cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: secret.as_bytes(),
                    aad: access_key.as_bytes(),
                },
            )
            .expect("ChaCha20-Poly1305 encrypts any short message");
        let mut raw = nonce.to_vec();
        raw.extend_from_slice(&sealed);
        format!("v1:{}", base64_simd::STANDARD.encode_to_string(&raw))
    }

    pub(crate) fn decrypt(&self, access_key: &str, stored: &str) -> Option<String> {
        let raw = base64_simd::STANDARD
            .decode_to_vec(stored.strip_prefix("v1:")?)
            .ok()?;
        if raw.len() < 12 {
            return None;
        }
        let (nonce, sealed) = raw.split_at(12);
        let plain = self
            .cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: access_key.as_bytes(),
                },
            )
            .ok()?;
        String::from_utf8(plain).ok()
    }

    /// The secret of an access key; None for a key no user has.
    pub fn secret_of(&self, access_key: &str) -> Result<Option<SecretKey>, IamError> {
        self.key(access_key, |(_, secret)| secret.clone())
    }

    /// The user an access key belongs to (shared, not copied: the
    /// permission check of every request asks this).
    pub fn user_of(&self, access_key: &str) -> Result<Option<Arc<str>>, IamError> {
        self.key(access_key, |(user, _)| user.clone())
    }

    /// What `pick` takes from an access key's (user, secret) entry; None
    /// for a key no user has. Until the users are loaded only root's key
    /// is known and others are NotLoaded.
    fn key<T>(
        &self,
        access_key: &str,
        pick: impl FnOnce(&(Arc<str>, SecretKey)) -> T,
    ) -> Result<Option<T>, IamError> {
        if access_key == self.root_access_key {
            return Ok(Some(pick(&self.root)));
        }
        if !self.is_loaded() {
            return Err(IamError::NotLoaded);
        }
        Ok(self
            .table
            .read()
            .expect("iam table")
            .keys
            .get(access_key)
            .map(pick))
    }

    /// Whether `name` is a user (root included).
    pub fn user_exists(&self, name: &str) -> bool {
        name == ROOT_USER
            || self
                .table
                .read()
                .expect("iam table")
                .users
                .contains_key(name)
    }

    pub fn list_users(&self) -> Vec<UserSummary> {
        self.table
            .read()
            .expect("iam table")
            .users
            .values()
            .map(|u| UserSummary {
                name: u.name.clone(),
                created_ns: u.created_ns,
                access_keys: u.keys.iter().map(|k| k.access_key.clone()).collect(),
            })
            .collect()
    }

    /// A fresh random key, or `given` (an imported one, checked: its
    /// access key in no one's use).
    fn new_key(&self, given: Option<&Imported>) -> Result<(KeyDoc, String), IamError> {
        let (access_key, secret) = match given {
            Some(k) => {
                k.check()?;
                let taken = k.access_key == self.root_access_key
                    || self
                        .table
                        .read()
                        .expect("iam table")
                        .keys
                        .contains_key(&k.access_key);
                if taken {
                    return Err(IamError::KeyTaken(k.access_key.clone()));
                }
                (k.access_key.clone(), k.secret_key.clone())
            }
            None => {
                let upper = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
                (
                    format!(
                        "{ACCESS_KEY_PREFIX}{}",
                        random_chars(ACCESS_KEY_CHARS - ACCESS_KEY_PREFIX.len(), upper)
                    ),
                    random_chars(
                        SECRET_KEY_CHARS,
                        b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/",
                    ),
                )
            }
        };
        let doc = KeyDoc {
            secret: self.encrypt(&access_key, &secret),
            access_key,
            created_ns: now_ns(),
        };
        Ok((doc, secret))
    }

    /// Writes `doc` (or deletes the user when None) and then swaps the table.
    async fn commit(&self, name: &str, doc: Option<UserDoc>) -> Result<(), IamError> {
        let key = doc_key(name);
        match &doc {
            Some(d) => sysdoc::write(&self.store, &key, d).await?,
            None => sysdoc::delete(&self.store, &key).await?,
        }
        let mut users = self.table.read().expect("iam table").users.clone();
        match doc {
            Some(d) => users.insert(name.to_string(), d),
            None => users.remove(name),
        };
        let table = self.table_of(users)?;
        *self.table.write().expect("iam table") = Arc::new(table);
        Ok(())
    }

    fn user(&self, name: &str) -> Result<UserDoc, IamError> {
        if !self.is_loaded() {
            return Err(IamError::NotLoaded);
        }
        self.table
            .read()
            .expect("iam table")
            .users
            .get(name)
            .cloned()
            .ok_or_else(|| IamError::NoSuchUser(name.to_string()))
    }

    /// Makes a user with one access key: a random one, or `given` (a key
    /// imported from another store, or one a provisioner derives).
    pub async fn add_user(&self, name: &str, given: Option<&Imported>) -> Result<NewKey, IamError> {
        if name == ROOT_USER {
            return Err(IamError::Reserved(name.to_string()));
        }
        if !valid_name(name) {
            return Err(IamError::InvalidName(name.to_string()));
        }
        let _g = self.changes.lock().await;
        match self.user(name) {
            Ok(_) => return Err(IamError::UserExists(name.to_string())),
            Err(IamError::NoSuchUser(_)) => {}
            Err(e) => return Err(e),
        }
        let (key, secret) = self.new_key(given)?;
        let access_key = key.access_key.clone();
        let doc = UserDoc {
            format: DOC_FORMAT,
            name: name.to_string(),
            created_ns: now_ns(),
            keys: vec![key],
        };
        self.commit(name, Some(doc)).await?;
        Ok(NewKey {
            user: name.to_string(),
            access_key,
            secret_key: secret,
        })
    }

    /// Removes a user and all its keys (they stop working at once).
    pub async fn remove_user(&self, name: &str) -> Result<(), IamError> {
        let _g = self.changes.lock().await;
        self.user(name)?;
        self.commit(name, None).await
    }

    pub async fn add_key(&self, name: &str, given: Option<&Imported>) -> Result<NewKey, IamError> {
        let _g = self.changes.lock().await;
        let mut doc = self.user(name)?;
        let (key, secret) = self.new_key(given)?;
        let access_key = key.access_key.clone();
        doc.keys.push(key);
        self.commit(name, Some(doc)).await?;
        Ok(NewKey {
            user: name.to_string(),
            access_key,
            secret_key: secret,
        })
    }

    /// Revokes one key: requests signed with it fail from now on.
    pub async fn remove_key(&self, name: &str, access_key: &str) -> Result<(), IamError> {
        let _g = self.changes.lock().await;
        let mut doc = self.user(name)?;
        let before = doc.keys.len();
        doc.keys.retain(|k| k.access_key != access_key);
        if doc.keys.len() == before {
            return Err(IamError::NoSuchKey {
                user: name.to_string(),
                access_key: access_key.to_string(),
            });
        }
        self.commit(name, Some(doc)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_random_keys() {
        assert!(valid_name("alice"));
        assert!(valid_name("svc.loader@team_1+x=y,z-"));
        assert!(!valid_name(""));
        assert!(!valid_name("a/b"));
        assert!(!valid_name(&"a".repeat(65)));
        let a = random_chars(40, b"ab");
        assert_eq!(a.len(), 40);
        assert!(a.contains('a') && a.contains('b'));
        assert_ne!(
            random_chars(20, b"0123456789"),
            random_chars(20, b"0123456789")
        );
    }
}
