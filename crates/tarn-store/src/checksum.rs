//! Checksums computed on buffers in flight.

use crc_fast::CrcAlgorithm;

/// CRC32C (Castagnoli), the bitrot checksum of every shard block and record.
pub fn crc32c(data: &[u8]) -> u32 {
    crc_fast::checksum(CrcAlgorithm::Crc32Iscsi, data) as u32
}

#[cfg(test)]
mod tests {
    #[test]
    fn crc32c_known_vector() {
        // RFC 3720 test vector: 32 bytes of zeros.
        assert_eq!(super::crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(super::crc32c(b"123456789"), 0xe306_9283);
    }
}
