//! `tarn-store` is the object engine on one node's drives: erasure sets, the
//! write path (stripes → parity → shard files → metadata commit on a quorum),
//! the verified read path with on-the-fly reconstruction, listing from per-drive
//! ordered indexes, multipart uploads, and healing.
//!
//! It must never know about HTTP or S3 wire details (the S3 layer turns requests
//! into calls here), and must never block a runtime thread. It may call only
//! `tarn-io` among Tarn crates.

pub mod catalog;
pub mod checksum;
pub mod codec;
pub mod config;
pub mod drive;
pub mod drive_io;
pub mod error;
pub mod format;
pub mod lock;
pub mod seal;
pub mod shard;
pub mod store;
pub mod types;

pub use config::{EtagMode, StoreConfig};
pub use error::StoreError;
pub use format::{Durability, Versioning};
pub use store::drain::DrainReport;
pub use store::get::GetResult;
pub use store::{
    check_erasure, claim_drive, claim_drive_in_place_of, formatted_drive_id, parse_version,
    validate_bucket_name, BackfillStatus, ClusterDrive, ClusterLayout, DriveChange, ObjectStream,
    PoolLayout, Resumed, Store, UnderReplicated, KEY_MAX_BYTES, SYSTEM_BUCKET,
};
pub use types::*;
