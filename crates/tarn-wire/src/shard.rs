//! Where the bytes of a part lie in its shard files: the geometry of the
//! erasure stripes and the shard file layout (`docs/format.md`, "Shard
//! files"). The engine writes and reads shard files by it, and a local
//! reader (short-circuit reads, [`crate::local`]) reads the files a node
//! passed it by the same arithmetic.
//!
//! ```text
//! [block 0][block 1]…[block n-1]   shard blocks, lengths from StripeGeometry;
//!                                  format 2: each padded with zeros to a
//!                                  multiple of 4 KiB (written with O_DIRECT)
//! [crc32c u32 LE × n]              checksum of each block (its bytes, not the padding)
//! footer, 32 bytes:
//!   0  4  magic "TRNS"
//!   4  2  shard format version, u16 LE (1 or 2)
//!   6  1  shard index in the layout
//!   7  1  reserved, 0
//!   8  8  block count n, u64 LE
//!   16 4  full block length, u32 LE
//!   20 4  last block length, u32 LE
//!   24 4  CRC32C of the checksum table
//!   28 4  CRC32C of footer bytes [0, 28)
//! ```
//!
//! Readers tell the formats apart by the file's length (which the geometry
//! gives for each); when both lengths agree (blocks already a multiple of
//! 4 KiB) the two layouts are the same bytes, and the footer says which.

pub const SHARD_MAGIC: [u8; 4] = *b"TRNS";
/// What new shard files are written as.
pub const SHARD_FORMAT_VERSION: u16 = 2;
pub const FOOTER_BYTES: u64 = 32;
/// Format 2 pads every block to a multiple of this.
pub const BLOCK_ALIGN: u64 = 4096;

/// Where each stripe of a part lands in its shard files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StripeGeometry {
    pub part_size: u64,
    pub stripe_size: u64,
    pub data_shards: u64,
}

impl StripeGeometry {
    pub fn new(part_size: u64, stripe_size: u32, data_shards: u8) -> Self {
        StripeGeometry {
            part_size,
            stripe_size: stripe_size as u64,
            data_shards: data_shards as u64,
        }
    }

    pub fn stripe_count(&self) -> u64 {
        self.part_size.div_ceil(self.stripe_size)
    }

    /// Data bytes in stripe `j`.
    pub fn stripe_data_len(&self, j: u64) -> u64 {
        (self.part_size - j * self.stripe_size).min(self.stripe_size)
    }

    /// Bytes of each shard block of a stripe holding `data_len` bytes: even, so
    /// that GF(2^16) codecs can work on it.
    pub fn shard_len_for(&self, data_len: u64) -> u64 {
        data_len.div_ceil(self.data_shards).next_multiple_of(2)
    }

    pub fn shard_len(&self, j: u64) -> u64 {
        self.shard_len_for(self.stripe_data_len(j))
    }
}

/// Where blocks lie in a shard file of a given format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardLayout {
    pub version: u16,
    geometry: StripeGeometry,
}

impl ShardLayout {
    pub fn new(geometry: StripeGeometry, version: u16) -> ShardLayout {
        ShardLayout { version, geometry }
    }

    /// The layout of a file of `len` bytes, if it is one of the formats'.
    pub fn for_file_len(geometry: StripeGeometry, len: u64) -> Option<ShardLayout> {
        [SHARD_FORMAT_VERSION, 1]
            .into_iter()
            .map(|v| ShardLayout::new(geometry, v))
            .find(|l| l.file_len() == len)
    }

    pub fn geometry(&self) -> StripeGeometry {
        self.geometry
    }

    /// Bytes block of `len` bytes takes in the file.
    pub fn padded(&self, len: u64) -> u64 {
        if self.version >= 2 {
            len.next_multiple_of(BLOCK_ALIGN)
        } else {
            len
        }
    }

    /// Offset of block `j` (every earlier block is full).
    pub fn block_offset(&self, j: u64) -> u64 {
        j * self.padded(self.geometry.shard_len_for(self.geometry.stripe_size))
    }

    /// Bytes of the blocks, padding included: where the checksum table starts.
    pub fn blocks_len(&self) -> u64 {
        match self.geometry.stripe_count() {
            0 => 0,
            n => self.block_offset(n - 1) + self.padded(self.geometry.shard_len(n - 1)),
        }
    }

    pub fn file_len(&self) -> u64 {
        self.blocks_len() + 4 * self.geometry.stripe_count() + FOOTER_BYTES
    }
}

/// Length of a shard file as written now (format 2).
pub fn shard_file_len(g: &StripeGeometry) -> u64 {
    ShardLayout::new(*g, SHARD_FORMAT_VERSION).file_len()
}
