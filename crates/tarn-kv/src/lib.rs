//! `tarn-kv` owns the KV-cache store: the engine (a RAM tier in a shared-memory
//! arena with slab classes and SIEVE eviction, an NVMe tier of O_DIRECT log
//! segments), its wire protocol ([`proto`], defined in `tarn-wire` and shared
//! with `tarn-client`) and its server (TCP for any client, a Unix socket plus
//! the mapped arena for clients on the same host).
//!
//! Inference engines write the KV blocks of prompt prefixes once and read them
//! back instead of recomputing prefill. Loss is allowed (a missing block is a
//! miss); wrong bytes never are: every value carries a CRC32C checked on every
//! read. It must never know about S3 or objects; it calls only `tarn-io`.

pub mod auth;
pub mod disk;
pub mod engine;
pub mod fuzz;
pub mod server;

/// The layouts and protocol the clients share, defined once in `tarn-wire`.
pub use tarn_wire::{arena, fdpass, mailbox, park, proto};

pub use arena::HugePages;
pub use auth::{Credentials, Grants, Tenant, Tenants};
pub use engine::{Engine, KvConfig};
pub use server::{Server, ServerOptions};

/// Errors of the KV layer outside the per-key statuses of the protocol.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error("KV configuration: {0}")]
    Config(String),
    #[error("{0}: {1}")]
    Io(&'static str, std::io::Error),
}
