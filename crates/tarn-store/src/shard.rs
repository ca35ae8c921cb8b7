//! Shard files: one per drive per part, holding that drive's shard of every stripe.
//!
//! ```text
//! [block 0][block 1]…[block n-1]   shard blocks, lengths from StripeGeometry
//! [crc32c u32 LE × n]              checksum of each block
//! footer, 32 bytes:
//!   0  4  magic "TRNS"
//!   4  2  shard format version, u16 LE (1)
//!   6  1  shard index in the layout
//!   7  1  reserved, 0
//!   8  8  block count n, u64 LE
//!   16 4  full block length, u32 LE
//!   20 4  last block length, u32 LE
//!   24 4  CRC32C of the checksum table
//!   28 4  CRC32C of footer bytes [0, 28)
//! ```
//!
//! Every block read is checked against its table entry before its bytes are used.

use std::io;
use std::path::Path;

use tarn_io::{AlignedBuf, File};

use crate::checksum::crc32c;
use crate::codec::StripeGeometry;

pub const SHARD_MAGIC: [u8; 4] = *b"TRNS";
pub const SHARD_FORMAT_VERSION: u16 = 1;
pub const FOOTER_BYTES: u64 = 32;

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("shard file missing")]
    Missing,
    #[error("shard file is {actual} bytes, expected {expected}")]
    WrongLength { expected: u64, actual: u64 },
    #[error("shard block {block} failed its checksum")]
    Corrupt { block: u64 },
    #[error("shard footer invalid: {0}")]
    BadFooter(&'static str),
    #[error("shard I/O: {0}")]
    Io(#[from] io::Error),
}

pub fn shard_file_len(g: &StripeGeometry) -> u64 {
    g.shard_blocks_len() + 4 * g.stripe_count() + FOOTER_BYTES
}

/// Writes one shard file block by block; the caller renames it into place.
pub struct ShardWriter {
    file: File,
    offset: u64,
    crcs: Vec<u32>,
    shard_index: u8,
    full_block_len: u32,
    last_block_len: u32,
}

impl ShardWriter {
    pub async fn create(path: &Path, shard_index: u8) -> io::Result<Self> {
        let file = File::create(path).await?;
        Ok(ShardWriter {
            file,
            offset: 0,
            crcs: Vec::new(),
            shard_index,
            full_block_len: 0,
            last_block_len: 0,
        })
    }

    pub async fn write_block(&mut self, buf: AlignedBuf) -> (io::Result<()>, AlignedBuf) {
        let crc = crc32c(&buf);
        let len = buf.len() as u32;
        let (res, buf) = self.file.write_all_at(buf, self.offset).await;
        if res.is_ok() {
            if self.crcs.is_empty() {
                self.full_block_len = len;
            }
            self.last_block_len = len;
            self.crcs.push(crc);
            self.offset += len as u64;
        }
        (res, buf)
    }

    /// Appends the checksum table and footer, then makes the file durable.
    pub async fn finish(self) -> io::Result<()> {
        let mut tail = AlignedBuf::with_capacity(self.crcs.len() * 4 + FOOTER_BYTES as usize);
        let mut table = Vec::with_capacity(self.crcs.len() * 4);
        for c in &self.crcs {
            table.extend_from_slice(&c.to_le_bytes());
        }
        tail.extend_from_slice(&table);
        let mut footer = Vec::with_capacity(32);
        footer.extend_from_slice(&SHARD_MAGIC);
        footer.extend_from_slice(&SHARD_FORMAT_VERSION.to_le_bytes());
        footer.push(self.shard_index);
        footer.push(0);
        footer.extend_from_slice(&(self.crcs.len() as u64).to_le_bytes());
        footer.extend_from_slice(&self.full_block_len.to_le_bytes());
        footer.extend_from_slice(&self.last_block_len.to_le_bytes());
        footer.extend_from_slice(&crc32c(&table).to_le_bytes());
        let fcrc = crc32c(&footer);
        footer.extend_from_slice(&fcrc.to_le_bytes());
        tail.extend_from_slice(&footer);
        let (res, _) = self.file.write_all_at(tail, self.offset).await;
        res?;
        self.file.sync_all().await
    }
}

/// Reads verified blocks of one shard file.
pub struct ShardReader {
    file: File,
    geometry: StripeGeometry,
    /// Checksums of blocks `table_first..table_first + table.len()`.
    table: Vec<u32>,
    table_first: u64,
}

impl ShardReader {
    /// Opens and checks the length, so a truncated file is caught before any read.
    pub async fn open(path: &Path, geometry: StripeGeometry) -> Result<Self, ShardError> {
        let file = match File::open(path).await {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ShardError::Missing),
            Err(e) => return Err(e.into()),
        };
        let actual = file.len().await?;
        let expected = shard_file_len(&geometry);
        if actual != expected {
            return Err(ShardError::WrongLength { expected, actual });
        }
        Ok(ShardReader {
            file,
            geometry,
            table: Vec::new(),
            table_first: 0,
        })
    }

    /// Loads the checksums of blocks `first..=last` with one read.
    pub async fn load_checksums(&mut self, first: u64, last: u64) -> Result<(), ShardError> {
        let n = (last - first + 1) as usize;
        let off = self.geometry.shard_blocks_len() + 4 * first;
        let (res, buf) = self
            .file
            .read_exact_at(AlignedBuf::with_capacity(n * 4), n * 4, off)
            .await;
        res?;
        self.table = buf
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().expect("4")))
            .collect();
        self.table_first = first;
        Ok(())
    }

    /// Reads block `j` into `buf` and verifies it.
    pub async fn read_block(
        &self,
        j: u64,
        buf: AlignedBuf,
    ) -> (Result<(), ShardError>, AlignedBuf) {
        let len = self.geometry.shard_len(j) as usize;
        let (res, buf) = self
            .file
            .read_exact_at(buf, len, self.geometry.shard_offset(j))
            .await;
        if let Err(e) = res {
            return (Err(e.into()), buf);
        }
        let Some(&want) = j
            .checked_sub(self.table_first)
            .and_then(|i| self.table.get(i as usize))
        else {
            return (
                Err(ShardError::BadFooter("checksum for block not loaded")),
                buf,
            );
        };
        if crc32c(&buf) != want {
            return (Err(ShardError::Corrupt { block: j }), buf);
        }
        (Ok(()), buf)
    }

    /// Checks the footer, the table and every block: the heal scanner's deep check.
    pub async fn verify_all(&mut self, shard_index: u8) -> Result<(), ShardError> {
        let blocks_len = self.geometry.shard_blocks_len();
        let n = self.geometry.stripe_count();
        let tail_len = (4 * n + FOOTER_BYTES) as usize;
        let (res, tail) = self
            .file
            .read_exact_at(AlignedBuf::with_capacity(tail_len), tail_len, blocks_len)
            .await;
        res?;
        let (table, footer) = tail.split_at(4 * n as usize);
        if footer[0..4] != SHARD_MAGIC {
            return Err(ShardError::BadFooter("magic"));
        }
        if u32::from_le_bytes(footer[28..32].try_into().expect("4")) != crc32c(&footer[..28]) {
            return Err(ShardError::BadFooter("footer checksum"));
        }
        if u16::from_le_bytes([footer[4], footer[5]]) != SHARD_FORMAT_VERSION {
            return Err(ShardError::BadFooter("version"));
        }
        if footer[6] != shard_index {
            return Err(ShardError::BadFooter("shard index"));
        }
        if u64::from_le_bytes(footer[8..16].try_into().expect("8")) != n {
            return Err(ShardError::BadFooter("block count"));
        }
        if u32::from_le_bytes(footer[24..28].try_into().expect("4")) != crc32c(table) {
            return Err(ShardError::BadFooter("table checksum"));
        }
        if n == 0 {
            return Ok(());
        }
        self.load_checksums(0, n - 1).await?;
        let mut buf = AlignedBuf::with_capacity(self.geometry.shard_len(0) as usize);
        for j in 0..n {
            let (res, b) = self.read_block(j, buf).await;
            res?;
            buf = b;
        }
        Ok(())
    }
}
