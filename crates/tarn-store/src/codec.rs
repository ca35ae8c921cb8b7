//! Erasure codecs behind one trait, and the stripe geometry they work on.
//!
//! A part of `size` bytes is cut into stripes of `stripe_size` data bytes (the last
//! one shorter). Each stripe is split into `k` data shards of equal, even length
//! (the last data shard zero-padded) and `m` parity shards of the same length.

use crate::format::CodecId;

#[derive(Debug, thiserror::Error)]
pub enum CodecError {
    #[error("not enough shards to reconstruct: have {have}, need {need}")]
    NotEnoughShards { have: usize, need: usize },
    #[error("codec failure: {0}")]
    Internal(String),
}

pub trait Codec: Send + Sync {
    fn data_shards(&self) -> usize;
    fn parity_shards(&self) -> usize;
    /// Computes parity from `data` (k equal-length shards) into `parity` (m shards).
    fn encode(&self, data: &[&[u8]], parity: &mut [&mut [u8]]) -> Result<(), CodecError>;
    /// Fills the shards listed in `wanted` (indices into the k+m shards), given at
    /// least k present shards. `present[i]` is `Some` for shards that verified.
    fn reconstruct(
        &self,
        present: &[Option<&[u8]>],
        wanted: &mut [(usize, &mut [u8])],
    ) -> Result<(), CodecError>;
}

pub fn codec_for(id: CodecId, k: usize, m: usize) -> Box<dyn Codec> {
    match id {
        CodecId::Replicate => Box::new(Replicate { copies: 1 + m }),
        CodecId::ReedSolomonSimd => Box::new(ReedSolomon { k, m }),
    }
}

/// k = 1: every shard is a copy of the data.
pub struct Replicate {
    copies: usize,
}

impl Codec for Replicate {
    fn data_shards(&self) -> usize {
        1
    }
    fn parity_shards(&self) -> usize {
        self.copies - 1
    }
    fn encode(&self, data: &[&[u8]], parity: &mut [&mut [u8]]) -> Result<(), CodecError> {
        for p in parity.iter_mut() {
            p.copy_from_slice(data[0]);
        }
        Ok(())
    }
    fn reconstruct(
        &self,
        present: &[Option<&[u8]>],
        wanted: &mut [(usize, &mut [u8])],
    ) -> Result<(), CodecError> {
        let Some(src) = present.iter().flatten().next() else {
            return Err(CodecError::NotEnoughShards { have: 0, need: 1 });
        };
        for (_, out) in wanted.iter_mut() {
            out.copy_from_slice(src);
        }
        Ok(())
    }
}

thread_local! {
    static ENCODER: std::cell::RefCell<Option<reed_solomon_simd::ReedSolomonEncoder>> = const { std::cell::RefCell::new(None) };
}

/// Reed-Solomon over GF(2^16) from `reed-solomon-simd`: encodes at ~14 GB/s for
/// 4+2 on this machine (DESIGN.md). Reconstruction of lost data shards is slower
/// (~1.6 GB/s) but only runs on failure.
pub struct ReedSolomon {
    k: usize,
    m: usize,
}

impl Codec for ReedSolomon {
    fn data_shards(&self) -> usize {
        self.k
    }
    fn parity_shards(&self) -> usize {
        self.m
    }
    fn encode(&self, data: &[&[u8]], parity: &mut [&mut [u8]]) -> Result<(), CodecError> {
        if self.m == 0 {
            return Ok(());
        }
        let shard_bytes = data[0].len();
        let internal = |e: reed_solomon_simd::Error| CodecError::Internal(e.to_string());
        // The encoder's work area is as large as the stripe: keep one per thread
        // and reset it, instead of allocating and zeroing it for every stripe.
        ENCODER.with(|cell| {
            let mut slot = cell.borrow_mut();
            let enc = match slot.as_mut() {
                Some(enc) => {
                    enc.reset(self.k, self.m, shard_bytes).map_err(internal)?;
                    enc
                }
                None => slot.insert(
                    reed_solomon_simd::ReedSolomonEncoder::new(self.k, self.m, shard_bytes)
                        .map_err(internal)?,
                ),
            };
            for d in data {
                enc.add_original_shard(d).map_err(internal)?;
            }
            let result = enc.encode().map_err(internal)?;
            for (out, rec) in parity.iter_mut().zip(result.recovery_iter()) {
                out.copy_from_slice(rec);
            }
            Ok(())
        })
    }

    fn reconstruct(
        &self,
        present: &[Option<&[u8]>],
        wanted: &mut [(usize, &mut [u8])],
    ) -> Result<(), CodecError> {
        let have = present.iter().filter(|p| p.is_some()).count();
        if have < self.k {
            return Err(CodecError::NotEnoughShards { have, need: self.k });
        }
        let shard_bytes = present
            .iter()
            .flatten()
            .next()
            .map(|s| s.len())
            .unwrap_or(0);
        // First restore every missing data shard, then re-encode parity if asked.
        let mut data: Vec<Vec<u8>> = Vec::with_capacity(self.k);
        let missing_data: Vec<usize> = (0..self.k).filter(|&i| present[i].is_none()).collect();
        let mut restored = std::collections::BTreeMap::new();
        if !missing_data.is_empty() {
            let mut dec = reed_solomon_simd::ReedSolomonDecoder::new(self.k, self.m, shard_bytes)
                .map_err(|e| CodecError::Internal(e.to_string()))?;
            for (i, s) in present.iter().enumerate().take(self.k) {
                if let Some(s) = s {
                    dec.add_original_shard(i, s)
                        .map_err(|e| CodecError::Internal(e.to_string()))?;
                }
            }
            for (i, s) in present.iter().enumerate().skip(self.k) {
                if let Some(s) = s {
                    dec.add_recovery_shard(i - self.k, s)
                        .map_err(|e| CodecError::Internal(e.to_string()))?;
                }
            }
            let result = dec
                .decode()
                .map_err(|e| CodecError::Internal(e.to_string()))?;
            for (i, s) in result.restored_original_iter() {
                restored.insert(i, s.to_vec());
            }
        }
        for (i, shard) in present.iter().enumerate().take(self.k) {
            match (*shard, restored.remove(&i)) {
                (Some(s), _) => data.push(s.to_vec()),
                (None, Some(s)) => data.push(s),
                (None, None) => {
                    return Err(CodecError::Internal(format!("data shard {i} not restored")))
                }
            }
        }
        let wants_parity = wanted.iter().any(|(i, _)| *i >= self.k);
        let mut parity = vec![vec![0u8; shard_bytes]; if wants_parity { self.m } else { 0 }];
        if wants_parity {
            let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
            let mut outs: Vec<&mut [u8]> = parity.iter_mut().map(|p| p.as_mut_slice()).collect();
            self.encode(&refs, &mut outs)?;
        }
        for (i, out) in wanted.iter_mut() {
            let src = if *i < self.k {
                &data[*i]
            } else {
                &parity[*i - self.k]
            };
            out.copy_from_slice(src);
        }
        Ok(())
    }
}

pub use tarn_wire::shard::StripeGeometry;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn split(data: &[u8], k: usize) -> Vec<Vec<u8>> {
        let g = StripeGeometry {
            part_size: data.len() as u64,
            stripe_size: data.len().max(1) as u64,
            data_shards: k as u64,
        };
        let s = g.shard_len_for(data.len() as u64) as usize;
        (0..k)
            .map(|i| {
                let mut v = vec![0u8; s];
                let lo = (i * s).min(data.len());
                let hi = ((i + 1) * s).min(data.len());
                v[..hi - lo].copy_from_slice(&data[lo..hi]);
                v
            })
            .collect()
    }

    proptest! {
        #[test]
        fn rs_reconstructs_any_m_losses(k in 1usize..7, m in 1usize..4, data in proptest::collection::vec(any::<u8>(), 1..3000), lost in proptest::collection::vec(any::<usize>(), 0..4)) {
            let codec = codec_for(if k == 1 { CodecId::Replicate } else { CodecId::ReedSolomonSimd }, k, m);
            let shards = split(&data, k);
            let s = shards[0].len();
            let mut parity = vec![vec![0u8; s]; m];
            {
                let refs: Vec<&[u8]> = shards.iter().map(|x| x.as_slice()).collect();
                let mut outs: Vec<&mut [u8]> = parity.iter_mut().map(|p| p.as_mut_slice()).collect();
                codec.encode(&refs, &mut outs).unwrap();
            }
            let all: Vec<Vec<u8>> = shards.into_iter().chain(parity).collect();
            let mut missing: Vec<usize> = lost.iter().map(|l| l % (k + m)).collect();
            missing.sort();
            missing.dedup();
            missing.truncate(m);
            let present: Vec<Option<&[u8]>> = (0..k + m).map(|i| if missing.contains(&i) { None } else { Some(all[i].as_slice()) }).collect();
            let mut outs: Vec<Vec<u8>> = missing.iter().map(|_| vec![0u8; s]).collect();
            let mut wanted: Vec<(usize, &mut [u8])> = missing.iter().copied().zip(outs.iter_mut().map(|o| o.as_mut_slice())).collect();
            codec.reconstruct(&present, &mut wanted).unwrap();
            for (i, o) in missing.iter().zip(&outs) {
                prop_assert_eq!(o, &all[*i]);
            }
        }

        #[test]
        fn geometry_covers_part(size in 0u64..10_000_000, stripe in 1u32..2_000_000, k in 1u8..9) {
            let stripe = stripe * 2;
            let g = StripeGeometry::new(size, stripe, k);
            let total: u64 = (0..g.stripe_count()).map(|j| g.stripe_data_len(j)).sum();
            prop_assert_eq!(total, size);
            for j in 0..g.stripe_count() {
                prop_assert!(g.shard_len(j) * g.data_shards >= g.stripe_data_len(j));
                prop_assert_eq!(g.shard_len(j) % 2, 0);
            }
        }
    }

    #[test]
    fn too_many_losses_is_an_error() {
        let codec = codec_for(CodecId::ReedSolomonSimd, 2, 2);
        let a = vec![1u8; 8];
        let present = [Some(a.as_slice()), None, None, None];
        let mut out = vec![0u8; 8];
        let mut wanted = [(1usize, out.as_mut_slice())];
        assert!(matches!(
            codec.reconstruct(&present, &mut wanted),
            Err(CodecError::NotEnoughShards { .. })
        ));
    }
}
