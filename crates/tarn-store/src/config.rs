//! Engine configuration with defaults that need no file.

use std::path::PathBuf;

/// How single-part ETags are computed (docs/decisions.md, "ETag").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EtagMode {
    /// MD5 of the body when the client sent Content-MD5 or the body is at most
    /// `etag_md5_max_bytes`; otherwise a fast 128-bit xxh3 digest in the
    /// multipart form `<hex>-1`, which MD5-comparing clients know to skip.
    Auto,
    /// Always MD5 (S3's behaviour; caps PUT at MD5 speed, ~0.6 GB/s per core).
    Md5,
    /// Never MD5 unless Content-MD5 must be verified.
    Fast,
}

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub drives: Vec<PathBuf>,
    /// Drives per erasure set; None = all drives in one set when at most 16.
    pub set_drive_count: Option<usize>,
    /// Data/parity shards; None = derived from the set size (4 → 2+2, 1 → 1+0).
    pub data_shards: Option<usize>,
    pub parity_shards: Option<usize>,
    pub stripe_size_bytes: usize,
    pub inline_threshold_bytes: usize,
    pub etag_mode: EtagMode,
    pub etag_md5_max_bytes: u64,
    /// Cores (per-core buffer pools) and buffers per core.
    pub core_count: usize,
    pub buffers_per_core: usize,
    /// How long a request waits for a buffer before SlowDown.
    pub buffer_wait_ms: u64,
    pub object_size_max_bytes: u64,
    pub part_size_min_bytes: u64,
    pub part_count_max: u32,
    /// Free space kept on every drive: below it a drive takes no new shard
    /// data (it still serves reads and takes metadata, so DELETEs can free
    /// space). None: 2% of the drive, at most 1 GiB.
    pub drive_reserve_bytes: Option<u64>,
    /// Background work (backfill of a drive that joined) visits at most
    /// this many bytes of objects per second; 0: no limit.
    pub heal_rate_bytes: u64,
    /// Objects a backfill heals at once.
    pub heal_concurrency: usize,
    /// GET data read ahead of its clients, in all (each GET at most 2 MiB):
    /// past it a GET's next stripe waits for clients to take what is
    /// queued (`response_buffer_max_bytes`).
    pub read_ahead_max_bytes: usize,
    /// How long a GET's next stripe waits for room in that budget before
    /// the response is cut off (longer than the minimum-rate window, so
    /// slow readers are gone first).
    pub read_ahead_wait_ms: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            drives: vec![PathBuf::from("./data")],
            set_drive_count: None,
            data_shards: None,
            parity_shards: None,
            stripe_size_bytes: 1 << 20,
            inline_threshold_bytes: 128 << 10,
            etag_mode: EtagMode::Auto,
            etag_md5_max_bytes: 1 << 20,
            core_count: 1,
            buffers_per_core: 256,
            buffer_wait_ms: 2000,
            object_size_max_bytes: 5 << 40,
            part_size_min_bytes: 5 << 20,
            part_count_max: 10_000,
            drive_reserve_bytes: None,
            heal_rate_bytes: 0,
            heal_concurrency: 4,
            read_ahead_max_bytes: 256 << 20,
            read_ahead_wait_ms: 30_000,
        }
    }
}

/// Largest set we form by default; bigger node counts split into several sets.
pub const SET_DRIVE_COUNT_MAX: usize = 16;

pub fn default_set_drive_count(drive_count: usize) -> usize {
    if drive_count <= SET_DRIVE_COUNT_MAX {
        return drive_count;
    }
    (4..=SET_DRIVE_COUNT_MAX)
        .rev()
        .find(|s| drive_count.is_multiple_of(*s))
        .unwrap_or(drive_count)
}

pub fn default_parity_shards(set_drive_count: usize) -> usize {
    match set_drive_count {
        0 | 1 => 0,
        2 | 3 => 1,
        4..=7 => 2,
        n => n / 4,
    }
}
