//! `tarn-client`: Rust clients for Tarn. The KV-cache client ([`kv`]) speaks
//! the wire protocol defined once in `tarn_wire::proto`; the object client
//! ([`object`]) speaks S3 to Tarn or any S3 endpoint. Neither compiles the
//! server.

pub mod kv;
pub mod object;
pub mod route;
pub mod sigv4;

pub use kv::{
    AnyTransport, BlockingKvClient, ConnectOptions, Error, GetInto, GetOutcome, KvClient, Located,
    PutFrom, ReadIo, RegisteredBuffer, ShmTransport, TcpTransport, Transport, TransportChoice,
    TransportKind, WriteIo,
};
pub use object::{ObjectClient, ObjectError};
pub use tarn_io::tls;
pub use tarn_wire::auth::Credentials;
pub use tarn_wire::proto::{
    ClusterView, Digest, ExistsReply, Part, Route, Status, ViewMember, BATCH_COPY, BATCH_FALLBACK,
};
