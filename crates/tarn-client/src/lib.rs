//! `tarn-client`: Rust clients for Tarn. Today the KV-cache client ([`kv`]);
//! the S3 fast paths come later. It speaks the wire protocol defined once in
//! `tarn_kv::proto` and never touches the engine.

pub mod kv;

pub use kv::{
    AnyTransport, BlockingKvClient, ConnectOptions, Error, GetInto, GetOutcome, KvClient, PutFrom,
    ReadIo, RegisteredBuffer, ShmTransport, TcpTransport, Transport, TransportChoice,
    TransportKind, WriteIo,
};
pub use tarn_kv::auth::Credentials;
pub use tarn_kv::proto::{Digest, ExistsReply, Status};
