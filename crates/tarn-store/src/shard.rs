//! Shard files: one per drive per part, holding that drive's shard of every stripe.
//!
//! The layout (block geometry, table, footer) is `tarn_wire::shard`'s, which
//! local readers share.

use std::io;
use std::path::Path;

use tarn_io::{AlignedBuf, File};

use crate::checksum::crc32c;
use crate::codec::StripeGeometry;

pub use tarn_wire::shard::{
    shard_file_len, ShardLayout, BLOCK_ALIGN, FOOTER_BYTES, SHARD_FORMAT_VERSION, SHARD_MAGIC,
};
const _: () = assert!(BLOCK_ALIGN == tarn_io::ALIGNMENT_BYTES as u64);

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

/// Writes one shard file block by block, in format 2: each block padded to
/// a multiple of 4 KiB and written with O_DIRECT (straight from the pool
/// buffer to the device) where the filesystem allows it.
pub struct ShardWriter {
    file: File,
    direct: bool,
    offset: u64,
    crcs: Vec<u32>,
    shard_index: u8,
    full_block_len: u32,
    last_block_len: u32,
}

impl ShardWriter {
    pub async fn create(path: &Path, shard_index: u8) -> io::Result<Self> {
        let (file, direct) = File::create_direct(path).await?;
        Ok(ShardWriter {
            file,
            direct,
            offset: 0,
            crcs: Vec::new(),
            shard_index,
            full_block_len: 0,
            last_block_len: 0,
        })
    }

    /// Appends a block (padded with zeros to a multiple of 4 KiB on disk;
    /// the buffer comes back with its own length).
    pub async fn write_block(&mut self, mut buf: AlignedBuf) -> (io::Result<()>, AlignedBuf) {
        let crc = crc32c(&buf);
        let len = buf.len();
        // Fits: an AlignedBuf's capacity is a whole number of 4 KiB blocks.
        let padded = (len as u64).next_multiple_of(BLOCK_ALIGN) as usize;
        buf.set_len(padded);
        buf[len..].fill(0);
        let (res, mut buf) = self.file.write_all_at(buf, self.offset).await;
        buf.set_len(len);
        if res.is_ok() {
            if self.crcs.is_empty() {
                self.full_block_len = len as u32;
            }
            self.last_block_len = len as u32;
            self.crcs.push(crc);
            self.offset += padded as u64;
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
        if self.direct {
            // The tail is not a whole number of blocks: a buffered write,
            // made durable by the fsync with the rest.
            self.file.set_direct(false)?;
        }
        let (res, _) = self.file.write_all_at(tail, self.offset).await;
        res?;
        self.file.sync_all().await
    }
}

/// Reads verified blocks of one shard file (format 1 or 2).
pub struct ShardReader {
    file: File,
    geometry: StripeGeometry,
    layout: ShardLayout,
    /// Checksums of blocks `table_first..table_first + table.len()`.
    table: Vec<u32>,
    table_first: u64,
}

impl ShardReader {
    /// Opens and checks the length, so a truncated file is caught before
    /// any read; the length says the format.
    pub async fn open(path: &Path, geometry: StripeGeometry) -> Result<Self, ShardError> {
        let file = match File::open(path).await {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(ShardError::Missing),
            Err(e) => return Err(e.into()),
        };
        let actual = file.len().await?;
        let layout =
            ShardLayout::for_file_len(geometry, actual).ok_or(ShardError::WrongLength {
                expected: shard_file_len(&geometry),
                actual,
            })?;
        Ok(ShardReader {
            file,
            geometry,
            layout,
            table: Vec::new(),
            table_first: 0,
        })
    }

    /// Loads the checksums of blocks `first..=last` with one read.
    pub async fn load_checksums(&mut self, first: u64, last: u64) -> Result<(), ShardError> {
        let n = (last - first + 1) as usize;
        let off = self.layout.blocks_len() + 4 * first;
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

    /// The file and the offset of block `j` in it.
    pub fn block_file(&self, j: u64) -> (std::sync::Arc<std::os::fd::OwnedFd>, u64) {
        (self.file.shared_fd(), self.layout.block_offset(j))
    }

    /// Block `j`'s checksum, when the table's part holding it is loaded.
    pub fn block_crc(&self, j: u64) -> Option<u32> {
        j.checked_sub(self.table_first)
            .and_then(|i| self.table.get(i as usize))
            .copied()
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
            .read_exact_at(buf, len, self.layout.block_offset(j))
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
        let blocks_len = self.layout.blocks_len();
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
        // Format 1 and 2 have the same bytes when no block needed padding.
        let version = u16::from_le_bytes([footer[4], footer[5]]);
        let same_bytes = ShardLayout::new(self.geometry, 1).file_len()
            == ShardLayout::new(self.geometry, 2).file_len();
        if !(version == self.layout.version || same_bytes && (version == 1 || version == 2)) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn data(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    fn blocks(g: &StripeGeometry) -> Vec<Vec<u8>> {
        (0..g.stripe_count())
            .map(|j| data(g.shard_len(j) as usize, j as u8))
            .collect()
    }

    async fn write(path: &Path, g: &StripeGeometry) {
        let mut w = ShardWriter::create(path, 3).await.unwrap();
        for b in blocks(g) {
            let mut buf = AlignedBuf::with_capacity(b.len());
            buf.extend_from_slice(&b);
            let (res, back) = w.write_block(buf).await;
            res.unwrap();
            assert_eq!(
                back.len(),
                b.len(),
                "the buffer comes back with its own length"
            );
        }
        w.finish().await.unwrap();
    }

    /// The format-1 writer as it was: blocks back to back, no padding.
    fn write_v1(path: &Path, g: &StripeGeometry) {
        let mut file = Vec::new();
        let mut table = Vec::new();
        for b in blocks(g) {
            table.extend_from_slice(&crc32c(&b).to_le_bytes());
            file.extend_from_slice(&b);
        }
        file.extend_from_slice(&table);
        let mut footer = Vec::new();
        footer.extend_from_slice(&SHARD_MAGIC);
        footer.extend_from_slice(&1u16.to_le_bytes());
        footer.push(3);
        footer.push(0);
        footer.extend_from_slice(&g.stripe_count().to_le_bytes());
        footer.extend_from_slice(&(g.shard_len(0) as u32).to_le_bytes());
        footer.extend_from_slice(&(g.shard_len(g.stripe_count().max(1) - 1) as u32).to_le_bytes());
        footer.extend_from_slice(&crc32c(&table).to_le_bytes());
        let fcrc = crc32c(&footer);
        footer.extend_from_slice(&fcrc.to_le_bytes());
        file.extend_from_slice(&footer);
        std::fs::write(path, file).unwrap();
    }

    async fn read_all(path: &Path, g: StripeGeometry) -> Vec<Vec<u8>> {
        let mut r = ShardReader::open(path, g).await.unwrap();
        r.verify_all(3).await.unwrap();
        let n = g.stripe_count();
        if n > 0 {
            r.load_checksums(0, n - 1).await.unwrap();
        }
        let mut out = Vec::new();
        for j in 0..n {
            let buf = AlignedBuf::with_capacity(g.shard_len(j) as usize);
            let (res, buf) = r.read_block(j, buf).await;
            res.unwrap();
            out.push(buf.to_vec());
        }
        out
    }

    // Geometries whose blocks are and are not multiples of 4 KiB: 2+2 of
    // 1 MiB stripes, k = 3 (349,526-byte blocks), a part shorter than a
    // stripe, an empty part.
    fn geometries() -> Vec<StripeGeometry> {
        vec![
            StripeGeometry::new(5 << 20, 1 << 20, 2),
            StripeGeometry::new((3 << 20) + 12_345, 1 << 20, 3),
            StripeGeometry::new(1000, 1 << 20, 4),
            StripeGeometry::new(0, 1 << 20, 2),
        ]
    }

    #[tokio::test]
    async fn format_2_pads_blocks_and_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        for (i, g) in geometries().into_iter().enumerate() {
            let path = dir.path().join(format!("v2-{i}"));
            write(&path, &g).await;
            let len = std::fs::metadata(&path).unwrap().len();
            let v2 = ShardLayout::new(g, 2);
            assert_eq!(len, v2.file_len());
            for j in 0..g.stripe_count() {
                assert_eq!(v2.block_offset(j) % BLOCK_ALIGN, 0);
            }
            assert_eq!(v2.blocks_len() % BLOCK_ALIGN, 0);
            assert_eq!(read_all(&path, g).await, blocks(&g));
        }
    }

    #[tokio::test]
    async fn format_1_files_still_read() {
        let dir = tempfile::tempdir().unwrap();
        for (i, g) in geometries().into_iter().enumerate() {
            let path = dir.path().join(format!("v1-{i}"));
            write_v1(&path, &g);
            assert_eq!(read_all(&path, g).await, blocks(&g));
        }
    }

    #[tokio::test]
    async fn corruption_and_wrong_lengths_are_caught_in_both_formats() {
        let dir = tempfile::tempdir().unwrap();
        let g = StripeGeometry::new((3 << 20) + 12_345, 1 << 20, 3);
        let (v1, v2) = (dir.path().join("v1"), dir.path().join("v2"));
        write_v1(&v1, &g);
        write(&v2, &g).await;
        for (path, layout) in [(&v1, ShardLayout::new(g, 1)), (&v2, ShardLayout::new(g, 2))] {
            // A flipped byte in block 2 fails that block only.
            let mut bytes = std::fs::read(path).unwrap();
            let at = (layout.block_offset(2) + 77) as usize;
            bytes[at] ^= 1;
            std::fs::write(path, &bytes).unwrap();
            let mut r = ShardReader::open(path, g).await.unwrap();
            r.load_checksums(0, g.stripe_count() - 1).await.unwrap();
            let (ok, buf) = r.read_block(1, AlignedBuf::with_capacity(1 << 20)).await;
            ok.unwrap();
            let (bad, _) = r.read_block(2, buf).await;
            assert!(
                matches!(bad, Err(ShardError::Corrupt { block: 2 })),
                "{bad:?}"
            );
            assert!(r.verify_all(3).await.is_err());
            // Cut short: refused at open.
            bytes.truncate(bytes.len() - 1);
            std::fs::write(path, &bytes).unwrap();
            assert!(matches!(
                ShardReader::open(path, g).await,
                Err(ShardError::WrongLength { .. })
            ));
        }
    }
}
