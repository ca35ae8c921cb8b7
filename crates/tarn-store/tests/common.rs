#![allow(dead_code)]
//! Helpers shared by the engine's integration tests.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tarn_store::{ByteRange, Durability, ObjectBody, PutOptions, Store, StoreConfig};

/// Deterministic bytes: a seeded xorshift stream.
pub fn data(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Runs `f` on a thread-per-core style runtime with io_uring, like the server.
pub fn run<F: Future<Output = ()> + Send + 'static>(f: F) {
    std::thread::spawn(move || {
        let rt = tarn_io::runtime::build_core_runtime(0, false, true).expect("runtime");
        rt.block_on(f);
    })
    .join()
    .expect("test thread panicked");
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub drives: Vec<PathBuf>,
}

impl Cluster {
    pub fn new(drive_count: usize) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let drives = (0..drive_count)
            .map(|i| dir.path().join(format!("d{i}")))
            .collect();
        Cluster { dir, drives }
    }

    pub fn config(&self) -> StoreConfig {
        StoreConfig {
            drives: self.drives.clone(),
            ..Default::default()
        }
    }

    pub fn open(&self) -> Arc<Store> {
        Store::open(self.config()).expect("open store")
    }

    /// Empties a drive directory, as when a failed disk is replaced.
    pub fn wipe(&self, i: usize) {
        let d = &self.drives[i];
        std::fs::remove_dir_all(d).expect("wipe drive");
        std::fs::create_dir_all(d).expect("recreate empty drive");
    }

    /// Every shard file on drive `i`.
    pub fn shard_files(&self, i: usize) -> Vec<PathBuf> {
        let mut out = Vec::new();
        walk(&self.drives[i].join("data"), &mut out);
        out
    }
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            walk(&p, out);
        } else {
            out.push(p);
        }
    }
}

pub async fn put(
    store: &Arc<Store>,
    bucket: &str,
    key: &str,
    body: &[u8],
) -> tarn_store::ObjectInfo {
    store
        .put_object(
            bucket,
            key,
            ObjectBody::from_bytes(body.to_vec()),
            PutOptions::default(),
        )
        .await
        .expect("put")
}

/// Puts a body in chunks of `chunk` bytes with no declared length.
pub async fn put_chunked(
    store: &Arc<Store>,
    bucket: &str,
    key: &str,
    body: &[u8],
    chunk: usize,
) -> tarn_store::ObjectInfo {
    let chunks: Vec<Result<bytes::Bytes, tarn_store::StoreError>> = body
        .chunks(chunk.max(1))
        .map(|c| Ok(bytes::Bytes::copy_from_slice(c)))
        .collect();
    let body = ObjectBody {
        stream: Box::pin(futures::stream::iter(chunks)),
        declared_len: None,
        finish: None,
    };
    store
        .put_object(bucket, key, body, PutOptions::default())
        .await
        .expect("put")
}

pub async fn get(store: &Arc<Store>, bucket: &str, key: &str) -> Vec<u8> {
    store
        .get_object(bucket, key, None, None, None)
        .await
        .expect("get")
        .stream
        .collect()
        .await
        .expect("read body")
}

/// The bytes of one version of bucket/key.
pub async fn get_version(store: &Arc<Store>, bucket: &str, key: &str, version: &str) -> Vec<u8> {
    store
        .get_object(bucket, key, Some(version), None, None)
        .await
        .expect("get version")
        .stream
        .collect()
        .await
        .expect("read body")
}

pub async fn get_range(store: &Arc<Store>, bucket: &str, key: &str, a: u64, b: u64) -> Vec<u8> {
    store
        .get_object(bucket, key, None, Some(ByteRange::Closed(a, b)), None)
        .await
        .expect("get range")
        .stream
        .collect()
        .await
        .expect("read range")
}

pub async fn bucket(store: &Store, name: &str) {
    store
        .create_bucket(name, Durability::ErasureCoded)
        .await
        .expect("create bucket");
}
