//! `tarn-wire`: what the KV daemon (`tarn-kv`) and its clients (`tarn-client`,
//! the Python package) agree on byte for byte, and nothing else: the wire
//! protocol ([`proto`]), the shared-memory mailbox ([`mailbox`], [`park`]) and
//! arena ([`arena`]) layouts, descriptor passing ([`fdpass`]) and the
//! credential handshake ([`auth`]). It has no engine, no runtime and no I/O
//! layer, so a client built on it never compiles the server.

pub mod arena;
pub mod auth;
pub mod checksum;
mod crc_copy;
pub mod fdpass;
pub mod local;
pub mod mailbox;
pub mod park;
pub mod proto;
pub mod shard;

pub use auth::Credentials;

/// The atomics `park.rs` is written against: std's here, loom's in the
/// model-checking test that compiles the same file.
mod sync {
    pub use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
}
