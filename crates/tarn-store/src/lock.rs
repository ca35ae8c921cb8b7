//! Per-key locks: striped async read/write locks keyed by a hash of bucket/key.
//!
//! Readers hold a read lock only while they read metadata and pin the shards of
//! the version they will stream (see `Store::pin_data`); writers hold the write
//! lock around their metadata commit and the retirement of superseded shards,
//! never while receiving a body. A slow reader therefore never delays a writer,
//! and a writer never deletes shards a reader still streams.

use std::sync::Arc;

use tokio::sync::{OwnedRwLockReadGuard, OwnedRwLockWriteGuard, RwLock};

const LOCK_STRIPES: usize = 4096;

pub struct LockTable {
    stripes: Vec<Arc<RwLock<()>>>,
    seed: u64,
}

pub enum KeyGuard {
    Read(#[allow(dead_code)] OwnedRwLockReadGuard<()>),
    Write(#[allow(dead_code)] OwnedRwLockWriteGuard<()>),
}

impl LockTable {
    pub fn new(seed: u64) -> Self {
        LockTable {
            stripes: (0..LOCK_STRIPES)
                .map(|_| Arc::new(RwLock::new(())))
                .collect(),
            seed,
        }
    }

    pub fn stripe(&self, bucket: &str, key: &str) -> usize {
        let mut h = xxhash_rust::xxh3::Xxh3::with_seed(self.seed);
        h.update(bucket.as_bytes());
        h.update(&[0]);
        h.update(key.as_bytes());
        (h.digest() % LOCK_STRIPES as u64) as usize
    }

    pub async fn read(&self, bucket: &str, key: &str) -> KeyGuard {
        KeyGuard::Read(
            self.stripes[self.stripe(bucket, key)]
                .clone()
                .read_owned()
                .await,
        )
    }

    pub async fn write(&self, bucket: &str, key: &str) -> KeyGuard {
        KeyGuard::Write(
            self.stripes[self.stripe(bucket, key)]
                .clone()
                .write_owned()
                .await,
        )
    }
}
