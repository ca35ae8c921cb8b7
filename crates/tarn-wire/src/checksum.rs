//! CRC32C of many values at once, on several threads: what a client that
//! copies blocks out of the daemon's arena with a DMA engine (a GPU's copy
//! engine) runs while the copies are in flight. One core checksums from
//! memory at about a fifth of the rate a host-to-device copy reads it (11
//! GB/s against 55 on an H100 host), so a single-threaded check, not the
//! copy, would set the pace of a get into GPU memory.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

use crate::proto::crc32c;

/// Values are checksummed in pieces of at most this many bytes, each on
/// whichever thread takes it next, and the pieces' CRCs combined: a batch of
/// one large value spreads over the threads like a batch of many small ones.
pub const CRC_PIECE_BYTES: usize = 1 << 20;

/// Below this many bytes per thread a thread costs more to start than it
/// saves (starting one is ~10-20 us; 1 MiB is ~50-100 us of checksumming).
pub const CRC_THREAD_MIN_BYTES: usize = 1 << 20;

/// Most threads one call uses: past this the memory bus, not the cores,
/// sets the rate, and the copies in flight need their share of it.
pub const CRC_THREADS_MAX: usize = 8;

/// The CRC32C of each value, computed on up to `threads` threads (the
/// caller's among them). Equal to `values.iter().map(crc32c)`.
pub fn crc32c_many(values: &[&[u8]], threads: usize) -> Vec<u32> {
    let total: usize = values.iter().map(|v| v.len()).sum();
    let threads = threads
        .min(CRC_THREADS_MAX)
        .min(total / CRC_THREAD_MIN_BYTES)
        .max(1);
    if threads == 1 {
        return values.iter().map(|v| crc32c(v)).collect();
    }
    // Pieces in value order: (value, start, end).
    let mut pieces = Vec::with_capacity(total / CRC_PIECE_BYTES + values.len());
    for (i, v) in values.iter().enumerate() {
        let mut start = 0;
        loop {
            let end = (start + CRC_PIECE_BYTES).min(v.len());
            pieces.push((i, start, end));
            if end == v.len() {
                break;
            }
            start = end;
        }
    }
    let crcs: Vec<AtomicU32> = pieces.iter().map(|_| AtomicU32::new(0)).collect();
    let next = AtomicUsize::new(0);
    let work = || loop {
        let p = next.fetch_add(1, Ordering::Relaxed);
        let Some(&(i, start, end)) = pieces.get(p) else {
            return;
        };
        crcs[p].store(crc32c(&values[i][start..end]), Ordering::Relaxed);
    };
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(work);
        }
        work();
    });
    // The scope joined every thread: their stores are visible here.
    let mut out = vec![0u32; values.len()];
    for (p, &(i, start, end)) in pieces.iter().enumerate() {
        let crc = crcs[p].load(Ordering::Relaxed);
        out[i] = if start == 0 {
            crc
        } else {
            crc_fast::checksum_combine(
                crc_fast::CrcAlgorithm::Crc32Iscsi,
                out[i] as u64,
                crc as u64,
                (end - start) as u64,
            ) as u32
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(n: usize, seed: u8) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn many_values_on_threads_equal_one_at_a_time() {
        // Values of a piece, under a piece, over several pieces, empty.
        let vals: Vec<Vec<u8>> = [
            2 << 20,
            1,
            0,
            CRC_PIECE_BYTES,
            3 * CRC_PIECE_BYTES + 17,
            4096,
        ]
        .iter()
        .enumerate()
        .map(|(i, &n)| bytes(n, i as u8))
        .collect();
        let refs: Vec<&[u8]> = vals.iter().map(|v| v.as_slice()).collect();
        let want: Vec<u32> = refs.iter().map(|v| crc32c(v)).collect();
        for threads in [1, 2, 3, 8, 64] {
            assert_eq!(crc32c_many(&refs, threads), want, "{threads} threads");
        }
        assert!(crc32c_many(&[], 4).is_empty());
    }

    #[test]
    fn a_changed_byte_in_any_piece_changes_its_value_only() {
        let mut vals: Vec<Vec<u8>> = (0..4).map(|i| bytes(3 << 20, i)).collect();
        let before = crc32c_many(&vals.iter().map(|v| v.as_slice()).collect::<Vec<_>>(), 4);
        vals[2][(2 << 20) + 5] ^= 1;
        let after = crc32c_many(&vals.iter().map(|v| v.as_slice()).collect::<Vec<_>>(), 4);
        assert_eq!(before[..2], after[..2]);
        assert_ne!(before[2], after[2]);
        assert_eq!(before[3], after[3]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(16))]
        #[test]
        fn any_lengths(lens in proptest::collection::vec(0usize..(3 << 20), 0..6), threads in 1usize..6) {
            let vals: Vec<Vec<u8>> = lens.iter().enumerate().map(|(i, &n)| bytes(n, i as u8)).collect();
            let refs: Vec<&[u8]> = vals.iter().map(|v| v.as_slice()).collect();
            let want: Vec<u32> = refs.iter().map(|v| crc32c(v)).collect();
            prop_assert_eq!(crc32c_many(&refs, threads), want);
        }
    }
}
