//! How a batch of reads becomes ranged GETs: reads of one object that lie
//! close together are merged into one request (the bytes between them are
//! read and dropped), and long runs are cut into chunks at multiples of the
//! chunk size, so that each request covers whole erasure stripes and many
//! connections share a large read.
//!
//! Pure functions over offsets: the property tests check that executing a
//! plan against an object gives every read the bytes a naive read would.

/// One read as the planner sees it: which object (an index the caller
/// assigns, equal for reads of the same object version), where, how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub object: usize,
    pub offset: u64,
    pub len: u64,
}

/// The part of read `read` that one request carries: object bytes
/// `[offset, offset + len)`, which go to the read's destination at
/// `offset - reads[read].offset`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub read: usize,
    pub offset: u64,
    pub len: u64,
}

/// One ranged GET: object bytes `[start, end)`, and the pieces of reads it
/// carries, in offset order, never overlapping; bytes between pieces are
/// read and dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub object: usize,
    pub start: u64,
    pub end: u64,
    pub pieces: Vec<Piece>,
}

impl Request {
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// Plans the requests for `reads`. Reads closer than `merge_gap` bytes
/// merge; a run longer than `chunk` is cut at multiples of `chunk` (which
/// the caller keeps a multiple of the stripe size). Reads that overlap an
/// earlier read of the same object go in requests of their own (each byte
/// of a response lands in one place). Empty reads get no request.
pub fn plan(reads: &[Span], merge_gap: u64, chunk: u64) -> Vec<Request> {
    assert!(chunk > 0, "chunk size must be positive");
    let mut order: Vec<usize> = (0..reads.len()).filter(|&i| reads[i].len > 0).collect();
    order.sort_by_key(|&i| (reads[i].object, reads[i].offset, reads[i].len, i));
    let mut out = Vec::new();
    while !order.is_empty() {
        let mut later = Vec::new();
        // A run: reads of one object, each starting at or after the end of
        // the one before and at most `merge_gap` past it.
        let mut run: Vec<usize> = Vec::new();
        let mut run_end = 0u64;
        for &i in &order {
            let r = reads[i];
            if let Some(&first) = run.first() {
                let same = reads[first].object == r.object;
                if same && r.offset < run_end {
                    later.push(i);
                    continue;
                }
                if same && r.offset - run_end <= merge_gap {
                    run.push(i);
                    run_end = r.offset + r.len;
                    continue;
                }
                cut(reads, &run, chunk, &mut out);
                run.clear();
            }
            run.push(i);
            run_end = r.offset + r.len;
        }
        if !run.is_empty() {
            cut(reads, &run, chunk, &mut out);
        }
        order = later;
    }
    out
}

/// Cuts one run into requests at multiples of `chunk`, each trimmed to the
/// pieces it carries.
fn cut(reads: &[Span], run: &[usize], chunk: u64, out: &mut Vec<Request>) {
    let object = reads[run[0]].object;
    let start = reads[run[0]].offset;
    let end = run
        .iter()
        .map(|&i| reads[i].offset + reads[i].len)
        .max()
        .unwrap_or(start);
    let mut pieces: Vec<Piece> = Vec::new();
    let mut at = start;
    let mut next = 0; // first read of the run that may still have bytes at or after `at`
    while at < end {
        let limit = if end - start <= chunk {
            end
        } else {
            // The next multiple of `chunk` after `at`, or the run's end.
            (at / chunk + 1).saturating_mul(chunk).min(end)
        };
        pieces.clear();
        let mut i = next;
        while i < run.len() {
            let r = reads[run[i]];
            if r.offset >= limit {
                break;
            }
            let from = r.offset.max(at);
            let to = (r.offset + r.len).min(limit);
            if from < to {
                pieces.push(Piece {
                    read: run[i],
                    offset: from,
                    len: to - from,
                });
            }
            if r.offset + r.len <= limit {
                next = i + 1;
            }
            i += 1;
        }
        if let (Some(first), Some(last)) = (pieces.first(), pieces.last()) {
            out.push(Request {
                object,
                start: first.offset,
                end: last.offset + last.len,
                pieces: pieces.clone(),
            });
        }
        at = limit;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    fn span(object: usize, offset: u64, len: u64) -> Span {
        Span {
            object,
            offset,
            len,
        }
    }

    #[test]
    fn close_reads_merge_and_far_ones_do_not() {
        let reads = [span(0, 0, 100), span(0, 150, 50), span(0, 10_000, 10)];
        let p = plan(&reads, 64, 8 * MIB);
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].start, p[0].end, p[0].pieces.len()), (0, 200, 2));
        assert_eq!((p[1].start, p[1].end), (10_000, 10_010));
    }

    #[test]
    fn large_reads_split_at_chunk_multiples() {
        let reads = [span(0, MIB / 2, 20 * MIB)];
        let p = plan(&reads, 0, 8 * MIB);
        let ranges: Vec<(u64, u64)> = p.iter().map(|r| (r.start, r.end)).collect();
        assert_eq!(
            ranges,
            vec![
                (MIB / 2, 8 * MIB),
                (8 * MIB, 16 * MIB),
                (16 * MIB, 20 * MIB + MIB / 2)
            ]
        );
    }

    #[test]
    fn overlapping_reads_get_their_own_requests() {
        let reads = [
            span(0, 0, 100),
            span(0, 50, 100),
            span(1, 0, 10),
            span(0, 0, 0),
        ];
        let p = plan(&reads, 1 << 20, 8 * MIB);
        assert_eq!(p.len(), 3);
        for r in &p {
            for w in r.pieces.windows(2) {
                assert!(w[0].offset + w[0].len <= w[1].offset);
            }
        }
    }

    /// Executes a plan against synthetic objects: every byte of every read
    /// must equal what a naive read gives, and each read byte is written
    /// exactly once.
    fn check(reads: &[Span], gap: u64, chunk: u64) -> Result<(), TestCaseError> {
        let byte = |object: usize, at: u64| (at.wrapping_mul(31) ^ (object as u64 * 7)) as u8;
        let p = plan(reads, gap, chunk);
        let mut got: Vec<Vec<Option<u8>>> =
            reads.iter().map(|r| vec![None; r.len as usize]).collect();
        for req in &p {
            prop_assert!(req.len() <= chunk, "a request longer than a chunk");
            prop_assert!(req.start < req.end);
            let mut at = req.start;
            for piece in &req.pieces {
                prop_assert!(piece.offset >= at, "pieces in order, not overlapping");
                prop_assert_eq!(reads[piece.read].object, req.object);
                // The response body, read in order; gaps dropped.
                for o in piece.offset..piece.offset + piece.len {
                    let slot = &mut got[piece.read][(o - reads[piece.read].offset) as usize];
                    prop_assert!(slot.is_none(), "a byte written twice");
                    *slot = Some(byte(req.object, o));
                }
                at = piece.offset + piece.len;
            }
            prop_assert!(at == req.end);
        }
        for (r, g) in reads.iter().zip(&got) {
            for (k, b) in g.iter().enumerate() {
                prop_assert_eq!(*b, Some(byte(r.object, r.offset + k as u64)));
            }
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn merged_and_split_reads_return_the_bytes_of_naive_reads(
            reads in prop::collection::vec((0usize..3, 0u64..4000, 0u64..900), 0..40),
            gap in 0u64..300,
            chunk in 1u64..1200,
        ) {
            let reads: Vec<Span> = reads.into_iter().map(|(o, a, l)| span(o, a, l)).collect();
            check(&reads, gap, chunk)?;
        }

        #[test]
        fn a_long_read_is_cut_on_chunk_boundaries(
            offset in 0u64..100_000,
            len in 1u64..50_000,
            chunk in 64u64..4096,
        ) {
            let p = plan(&[span(0, offset, len)], 0, chunk);
            prop_assert_eq!(p.first().map(|r| r.start), Some(offset));
            prop_assert_eq!(p.last().map(|r| r.end), Some(offset + len));
            for (k, r) in p.iter().enumerate() {
                prop_assert!(r.len() <= chunk);
                if len > chunk {
                    prop_assert!(k == 0 || r.start % chunk == 0);
                    prop_assert!(k + 1 == p.len() || r.end % chunk == 0);
                }
            }
        }
    }
}
