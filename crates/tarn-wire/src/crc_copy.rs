//! Copy and CRC32C in one pass over the bytes, for CPUs with AVX-512 and
//! VPCLMULQDQ: each 64-byte load is stored to the destination and folded
//! into the checksum from the same register, so the checksum describes
//! exactly the bytes that landed and nothing is read twice.
//!
//! The fold is the carry-less-multiply CRC reduction (Intel, "Fast CRC
//! Computation for Generic Polynomials Using PCLMULQDQ"), in the bit-reflected
//! form CRC32C uses: four 512-bit accumulators each advance 256 bytes per
//! step; at the end they are folded into one, and that one's 64 bytes (plus
//! any tail) go through the SSE4.2 `crc32` instruction, which finishes the
//! reduction exactly. The fold constants are computed at compile time from
//! the polynomial, and the tests compare against `crc-fast` on every length
//! and alignment that exercises a different path.

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// The CRC32C (Castagnoli) polynomial with its x^32 term.
    const POLY: u64 = 0x1_1EDC_6F41;

    /// x^n mod POLY.
    const fn x_pow_mod(n: u32) -> u64 {
        let mut r: u64 = 1;
        let mut i = 0;
        while i < n {
            r <<= 1;
            if r & (1 << 32) != 0 {
                r ^= POLY;
            }
            i += 1;
        }
        r
    }

    /// Constants that move a 128-bit lane `bits` forward. In reflected form a
    /// lane's low half holds the higher-degree 64 coefficients, which move by
    /// x^(bits+64), its high half by x^bits; a carry-less product of reflected
    /// operands carries one extra factor of x, hence the -1.
    const fn fold_keys(bits: u32) -> (u64, u64) {
        (
            x_pow_mod(bits + 64 - 1).reverse_bits(),
            x_pow_mod(bits - 1).reverse_bits(),
        )
    }

    const FOLD_256_BYTES: (u64, u64) = fold_keys(256 * 8);
    const FOLD_192_BYTES: (u64, u64) = fold_keys(192 * 8);
    const FOLD_128_BYTES: (u64, u64) = fold_keys(128 * 8);
    const FOLD_64_BYTES: (u64, u64) = fold_keys(64 * 8);

    pub fn available() -> bool {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("vpclmulqdq")
            && is_x86_feature_detected!("sse4.2")
    }

    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn keys(k: (u64, u64)) -> __m512i {
        let (lo, hi) = (k.0 as i64, k.1 as i64);
        _mm512_set_epi64(hi, lo, hi, lo, hi, lo, hi, lo)
    }

    /// `acc` moved forward by the distance `k` was made for, plus `data`.
    #[inline]
    #[target_feature(enable = "avx512f,vpclmulqdq")]
    fn fold(acc: __m512i, k: __m512i, data: __m512i) -> __m512i {
        let lo = _mm512_clmulepi64_epi128(acc, k, 0x00);
        let hi = _mm512_clmulepi64_epi128(acc, k, 0x11);
        _mm512_ternarylogic_epi64(lo, hi, data, 0x96)
    }

    /// # Safety
    /// The CPU must have AVX-512F, VPCLMULQDQ and SSE4.2 ([`available`]), and
    /// `dst` and `src` must have the same length; with `STREAM`, `dst` must
    /// start on a 64-byte boundary.
    #[target_feature(enable = "avx512f,vpclmulqdq,sse4.2")]
    pub unsafe fn copy_with_crc<const STREAM: bool>(dst: &mut [u8], src: &[u8]) -> u32 {
        let len = src.len();
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        // The register form of the CRC before the final inversion.
        let mut crc: u64 = 0xFFFF_FFFF;
        let mut at = 0;
        if len >= 256 {
            // SAFETY: every offset below is < len - 63, for both slices;
            // streamed stores go to 64-byte aligned addresses (the caller's
            // promise, and every offset is a multiple of 64).
            let load = |i: usize| unsafe { _mm512_loadu_si512(s.add(i).cast()) };
            let store = |i: usize, v: __m512i| unsafe {
                if STREAM {
                    _mm512_stream_si512(d.add(i).cast(), v)
                } else {
                    _mm512_storeu_si512(d.add(i).cast(), v)
                }
            };
            let (v0, v1, v2, v3) = (load(0), load(64), load(128), load(192));
            store(0, v0);
            store(64, v1);
            store(128, v2);
            store(192, v3);
            // The initial register value enters as an XOR into the first 32 bits.
            let mut x0 = _mm512_xor_si512(v0, _mm512_set_epi64(0, 0, 0, 0, 0, 0, 0, 0xFFFF_FFFF));
            let (mut x1, mut x2, mut x3) = (v1, v2, v3);
            let k = keys(FOLD_256_BYTES);
            at = 256;
            while at + 256 <= len {
                let (v0, v1, v2, v3) = (load(at), load(at + 64), load(at + 128), load(at + 192));
                store(at, v0);
                store(at + 64, v1);
                store(at + 128, v2);
                store(at + 192, v3);
                x0 = fold(x0, k, v0);
                x1 = fold(x1, k, v1);
                x2 = fold(x2, k, v2);
                x3 = fold(x3, k, v3);
                at += 256;
            }
            let mut x = fold(
                x0,
                keys(FOLD_192_BYTES),
                fold(x1, keys(FOLD_128_BYTES), fold(x2, keys(FOLD_64_BYTES), x3)),
            );
            let k = keys(FOLD_64_BYTES);
            while at + 64 <= len {
                let v = load(at);
                store(at, v);
                x = fold(x, k, v);
                at += 64;
            }
            // The folded 64 bytes stand for everything so far; the crc32
            // instruction reduces them, starting from a zero register.
            if STREAM {
                // Streamed stores are weakly ordered: they land before
                // anything the caller does next (publishing the block).
                _mm_sfence();
            }
            let mut lanes = [0u64; 8];
            // SAFETY: 64 bytes into a 64-byte array.
            unsafe { _mm512_storeu_si512(lanes.as_mut_ptr().cast(), x) };
            crc = 0;
            for lane in lanes {
                crc = _mm_crc32_u64(crc, lane);
            }
        }
        dst[at..].copy_from_slice(&src[at..]);
        let mut words = dst[at..].chunks_exact(8);
        for w in &mut words {
            crc = _mm_crc32_u64(crc, u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let mut c = crc as u32;
        for &b in words.remainder() {
            c = _mm_crc32_u8(c, b);
        }
        !c
    }
}

/// One-pass copy with CRC32C when the CPU has the instructions for it; None
/// otherwise (the caller copies and checksums in cache-sized chunks).
#[inline]
pub fn copy_with_crc(dst: &mut [u8], src: &[u8]) -> Option<u32> {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *AVAILABLE.get_or_init(x86::available) {
            // SAFETY: features checked above; lengths equal (asserted).
            return Some(unsafe { x86::copy_with_crc::<false>(dst, src) });
        }
    }
    None
}

/// The same, with the stores going around the caches (non-temporal) when
/// `dst` is 64-byte aligned: for large copies into memory read later by
/// someone else (the daemon filling an arena slot from a put window), which
/// then skip reading each destination line before writing it.
#[inline]
pub fn copy_with_crc_streaming(dst: &mut [u8], src: &[u8]) -> Option<u32> {
    assert_eq!(dst.len(), src.len());
    #[cfg(target_arch = "x86_64")]
    {
        static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *AVAILABLE.get_or_init(x86::available) {
            // SAFETY: features checked above; lengths equal (asserted);
            // streamed only to an aligned destination.
            return Some(unsafe {
                if dst.as_ptr().align_offset(64) == 0 {
                    x86::copy_with_crc::<true>(dst, src)
                } else {
                    x86::copy_with_crc::<false>(dst, src)
                }
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::crc32c;

    #[test]
    fn matches_crc32c_on_every_path() {
        let mut x = 0x1234_5678_9abc_def1u64;
        let src: Vec<u8> = (0..300_100)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        let lens = (0..1100).chain([4095, 4096, 65_536, 65_536 + 191, 262_144 + 255, 299_990]);
        for len in lens {
            for shift in [0usize, 1, 13, 64] {
                let s = &src[shift..shift + len];
                let mut dst = vec![0u8; len + 3];
                match copy_with_crc(&mut dst[3..], s) {
                    Some(c) => assert_eq!(c, crc32c(s), "len {len} shift {shift}"),
                    None => return, // no AVX-512 here: the chunked path serves
                }
                assert_eq!(&dst[3..], s);
                // Streamed, to an aligned destination and not.
                let mut aligned = vec![0u8; len + 128];
                let off = aligned.as_ptr().align_offset(64);
                let c = copy_with_crc_streaming(&mut aligned[off..off + len], s).expect("checked");
                assert_eq!(c, crc32c(s), "streamed len {len} shift {shift}");
                assert_eq!(&aligned[off..off + len], s);
                let c = copy_with_crc_streaming(&mut dst[3..], s).expect("checked");
                assert_eq!(c, crc32c(s));
            }
        }
    }
}
