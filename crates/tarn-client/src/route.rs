//! Where a KV key lives in a cluster: weighted rendezvous hashing over the
//! cluster's KV members (the view a node answers CLUSTER with).
//!
//! Every member scores every key, `weight / -ln(u)` with `u` a uniform hash
//! of (key, member) in (0, 1); the best score owns the key and the next one
//! is where a miss falls back to and a hot block's second copy lives. The
//! owner of a key changes only when the member that owned it leaves or
//! another member outscores it: a member that joins takes keys from every
//! other in proportion to its weight, a member that leaves hands each of
//! its keys to that key's next-ranked member, where the client's fallback
//! finds them. A member with a small weight (a node that started empty
//! and ramps up) owns a small share.

use tarn_wire::proto::{fnv1a64, ClusterView, Digest};

/// A view ready to rank keys.
#[derive(Debug, Clone)]
pub struct Ring {
    pub view: ClusterView,
    ids: Vec<u64>,
    weights: Vec<f64>,
}

/// A key's hash before it meets a member: the namespace folded into the
/// digest's first word (digests are uniform already).
pub fn key_hash(namespace_hash: u64, digest: &Digest) -> u64 {
    u64::from_le_bytes(digest[..8].try_into().expect("8 bytes")) ^ namespace_hash
}

/// The namespace's part of [`key_hash`], computed once per client.
pub fn namespace_hash(namespace: &[u8]) -> u64 {
    fnv1a64(&[b"ns", namespace])
}

/// splitmix64's finalizer: a bijection that spreads every input bit.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl Ring {
    pub fn new(view: ClusterView) -> Ring {
        let ids = view
            .members
            .iter()
            .map(|m| fnv1a64(&[b"member", m.id.as_bytes()]))
            .collect();
        let weights = view.members.iter().map(|m| m.weight as f64).collect();
        Ring { view, ids, weights }
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    fn score(&self, i: usize, key: u64) -> f64 {
        let h = mix(key ^ self.ids[i]);
        // 53 bits into (0, 1): never 0 or 1, so the logarithm is finite
        // and negative.
        let u = ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
        self.weights[i] / -u.ln()
    }

    /// The two best-ranked members (indexes into `view.members`) for a key
    /// among those `usable` says may take requests, best first. Members of
    /// weight 0 never rank.
    pub fn ranks(&self, key: u64, usable: impl Fn(usize) -> bool) -> [Option<usize>; 2] {
        let mut best: [Option<(f64, usize)>; 2] = [None, None];
        for i in 0..self.ids.len() {
            if self.weights[i] <= 0.0 || !usable(i) {
                continue;
            }
            let s = self.score(i, key);
            match best {
                [None, _] => best[0] = Some((s, i)),
                [Some((b0, _)), _] if s > b0 => {
                    best[1] = best[0];
                    best[0] = Some((s, i));
                }
                [_, None] => best[1] = Some((s, i)),
                [_, Some((b1, _))] if s > b1 => best[1] = Some((s, i)),
                _ => {}
            }
        }
        [best[0].map(|b| b.1), best[1].map(|b| b.1)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tarn_wire::proto::ViewMember;

    fn view(weights: &[(&str, u32)]) -> Ring {
        let members = weights
            .iter()
            .map(|(id, w)| ViewMember {
                id: id.to_string(),
                endpoint: format!("{id}:1"),
                weight: *w,
            })
            .collect();
        Ring::new(ClusterView::new(1, members, "n1"))
    }

    fn keys(n: usize) -> impl Iterator<Item = u64> {
        let ns = namespace_hash(b"model");
        (0..n).map(move |i| {
            let mut d = [0u8; 32];
            d[..8].copy_from_slice(&mix(i as u64 + 1).to_le_bytes());
            key_hash(ns, &d)
        })
    }

    fn owners(r: &Ring, n: usize) -> Vec<usize> {
        keys(n).map(|k| r.ranks(k, |_| true)[0].unwrap()).collect()
    }

    #[test]
    fn shares_follow_weights() {
        let r = view(&[("n1", 1000), ("n2", 1000), ("n3", 100)]);
        let n = 42_000;
        let mut count = [0usize; 3];
        for o in owners(&r, n) {
            count[o] += 1;
        }
        // Expected shares 1000/2100, 1000/2100, 100/2100.
        let share = |c: usize| c as f64 / n as f64;
        assert!((share(count[0]) - 0.476).abs() < 0.02, "{count:?}");
        assert!((share(count[1]) - 0.476).abs() < 0.02, "{count:?}");
        assert!((share(count[2]) - 0.048).abs() < 0.01, "{count:?}");
    }

    #[test]
    fn a_member_leaving_hands_each_key_to_its_next_ranked() {
        let all = view(&[("n1", 1000), ("n2", 1000), ("n3", 1000)]);
        let without = view(&[("n1", 1000), ("n3", 1000)]);
        let mut moved = 0;
        for k in keys(5000) {
            let [first, second] = all.ranks(k, |_| true);
            let now = without.ranks(k, |_| true)[0].map(|i| &without.view.members[i].id);
            let before = &all.view.members[first.unwrap()].id;
            if before == "n2" {
                moved += 1;
                assert_eq!(now, Some(&all.view.members[second.unwrap()].id));
            } else {
                assert_eq!(now, Some(before), "a key of a member still there moved");
            }
            // The same answer from a member marked unusable.
            let skip = all.ranks(k, |i| all.view.members[i].id != "n2")[0];
            assert_eq!(skip.map(|i| &all.view.members[i].id), now);
        }
        assert!(
            (1400..1950).contains(&moved),
            "{moved} of 5000 keys were n2's"
        );
    }

    #[test]
    fn a_ramping_member_takes_keys_only_from_others_as_its_weight_grows() {
        let mut prev = owners(&view(&[("n1", 1000), ("n2", 1000), ("n3", 0)]), 5000);
        assert!(prev.iter().all(|o| *o != 2), "weight 0 owns nothing");
        for w in [100, 250, 500, 1000] {
            let now = owners(&view(&[("n1", 1000), ("n2", 1000), ("n3", w)]), 5000);
            for (a, b) in prev.iter().zip(&now) {
                // Only moves onto the growing member, never between others.
                assert!(a == b || *b == 2, "key moved from {a} to {b} at weight {w}");
            }
            prev = now;
        }
        let third = prev.iter().filter(|o| **o == 2).count();
        assert!((1450..1900).contains(&third), "{third}");
    }

    #[test]
    fn ranks_are_distinct_and_respect_a_single_member() {
        let r = view(&[("solo", 1000)]);
        for k in keys(100) {
            assert_eq!(r.ranks(k, |_| true), [Some(0), None]);
            assert_eq!(r.ranks(k, |_| false), [None, None]);
        }
        let r = view(&[("a", 1000), ("b", 1000), ("c", 1000), ("d", 1000)]);
        for k in keys(1000) {
            let [x, y] = r.ranks(k, |_| true);
            assert_ne!(x, y);
            assert!(x.is_some() && y.is_some());
        }
    }
}
