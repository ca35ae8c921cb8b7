//! Erasure sets from the drives of a cluster's nodes.
//!
//! A set of k+m shards survives the loss of any m of them, so a set may put
//! at most m shards on one node: then a whole node can fail and every set
//! still has k shards. Within that bound shards are spread as widely as the
//! nodes allow (one per node before any node gets a second).
//!
//! Placement is a pure function of the nodes and their drives (sorted first,
//! so the order they are given in does not matter): the same cluster always
//! gets the same sets.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;

use crate::map::DriveRef;

/// The drives one node offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeDrives {
    pub node: String,
    pub drives: Vec<String>,
}

/// Why a pool cannot be formed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacementError(pub String);

impl fmt::Display for PlacementError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PlacementError {}

/// Forms erasure sets of `data + parity` drives out of all the given drives,
/// no node holding more than `parity` shards of any set. Refused, saying why,
/// when that is impossible (too few nodes, one node with too many drives, a
/// drive count the set size does not divide) or when `parity` is 0.
pub fn place(
    nodes: &[NodeDrives],
    data: usize,
    parity: usize,
) -> Result<Vec<Vec<DriveRef>>, PlacementError> {
    let width = data + parity;
    if data == 0 {
        return Err(PlacementError("data shards must be at least 1".into()));
    }
    if parity == 0 {
        return Err(PlacementError(
            "parity shards must be at least 1: without parity a cluster cannot lose a node".into(),
        ));
    }
    if width > 256 {
        return Err(PlacementError(format!(
            "{data}+{parity} is {width} shards per set; at most 256"
        )));
    }
    // Sorted and deduplicated: the input order never changes the result.
    let mut by_node: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for n in nodes {
        let drives = by_node.entry(n.node.as_str()).or_default();
        drives.extend(n.drives.iter().map(String::as_str));
    }
    for (node, drives) in &mut by_node {
        drives.sort_unstable();
        let before = drives.len();
        drives.dedup();
        if drives.len() != before {
            return Err(PlacementError(format!("node {node} lists a drive twice")));
        }
    }
    by_node.retain(|_, d| !d.is_empty());
    let total: usize = by_node.values().map(Vec::len).sum();
    if total == 0 {
        return Err(PlacementError("no node has drives".into()));
    }
    if !total.is_multiple_of(width) {
        return Err(PlacementError(format!(
            "{total} drives do not divide into sets of {width} ({data}+{parity}): \
             use a set size that divides {total}, or add or remove drives"
        )));
    }
    let sets = total / width;
    // Each node can put at most `parity` shards into each set.
    if let Some((node, d)) = by_node.iter().find(|(_, d)| d.len() > sets * parity) {
        return Err(PlacementError(format!(
            "node {node} has {} drives but {sets} set(s) of {data}+{parity} can take at most \
             {} from one node (at most {parity} per set, so that losing the node loses at \
             most {parity} shards of any set): add nodes, spread drives more evenly, or \
             raise the parity",
            d.len(),
            sets * parity
        )));
    }
    let mut left: Left<'_> = by_node
        .into_iter()
        .map(|(n, d)| (n, d.into_iter().collect()))
        .collect();
    let mut out = Vec::with_capacity(sets);
    for s in 0..sets {
        let mut set: Vec<DriveRef> = Vec::with_capacity(width);
        let mut taken = vec![0usize; left.len()];
        // First what a node must give now: the later sets can take at most
        // `parity` each from it.
        let later = (sets - s - 1) * parity;
        for i in 0..left.len() {
            for _ in 0..left[i].1.len().saturating_sub(later) {
                take(&mut left, i, &mut taken, &mut set);
            }
        }
        // Then round r takes at most one more drive from each node that has
        // given fewer than r: one per node first, a second only when the
        // nodes run out, never more than `parity`. Within a round the nodes
        // with the most drives left go first, which keeps the remaining
        // drives spread so that the later sets can be formed too.
        'rounds: for round in 1..=parity {
            let mut order: Vec<usize> = (0..left.len())
                .filter(|&i| !left[i].1.is_empty() && taken[i] < round)
                .collect();
            order.sort_by(|&a, &b| left[b].1.len().cmp(&left[a].1.len()).then(a.cmp(&b)));
            for i in order {
                if set.len() >= width {
                    break 'rounds;
                }
                take(&mut left, i, &mut taken, &mut set);
            }
        }
        if set.len() != width {
            return Err(PlacementError(format!(
                "set {s} can only be given {} of {width} drives with at most {parity} per \
                 node: the drives are on too few nodes for {data}+{parity}",
                set.len().min(width)
            )));
        }
        out.push(set);
    }
    Ok(out)
}

type Left<'a> = Vec<(&'a str, VecDeque<&'a str>)>;

/// Moves node `i`'s next drive into `set`.
fn take(left: &mut Left<'_>, i: usize, taken: &mut [usize], set: &mut Vec<DriveRef>) {
    let drive = left[i].1.pop_front().expect("a node with drives left");
    taken[i] += 1;
    set.push(DriveRef {
        node: left[i].0.to_string(),
        drive: drive.to_string(),
        replaces: None,
    });
}

/// The most shards of one set on one node, over all sets.
pub fn max_per_node(sets: &[Vec<DriveRef>]) -> usize {
    sets.iter()
        .map(|set| {
            let mut count: BTreeMap<&str, usize> = BTreeMap::new();
            for d in set {
                *count.entry(&d.node).or_default() += 1;
            }
            count.into_values().max().unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cluster(drives_per_node: &[usize]) -> Vec<NodeDrives> {
        drives_per_node
            .iter()
            .enumerate()
            .map(|(n, &count)| NodeDrives {
                node: format!("n{n}"),
                drives: (0..count).map(|d| format!("d{n}-{d}")).collect(),
            })
            .collect()
    }

    #[test]
    fn four_nodes_of_four_drives_in_2_plus_2() {
        let sets = place(&cluster(&[4, 4, 4, 4]), 2, 2).unwrap();
        assert_eq!(sets.len(), 4);
        // One shard per node in every set: the widest spread there is.
        assert_eq!(max_per_node(&sets), 1);
        let mut all: Vec<_> = sets.iter().flatten().map(|d| d.drive.clone()).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), 16, "every drive used once");
    }

    #[test]
    fn two_nodes_carry_two_shards_each_of_a_4_set() {
        let sets = place(&cluster(&[4, 4]), 2, 2).unwrap();
        assert_eq!(sets.len(), 2);
        assert_eq!(max_per_node(&sets), 2);
    }

    #[test]
    fn refusals_say_why() {
        let e = place(&cluster(&[8, 4]), 2, 2).unwrap_err().0;
        assert!(e.contains("node n0 has 8 drives"), "{e}");
        let e = place(&cluster(&[4]), 2, 2).unwrap_err().0;
        assert!(e.contains("node n0 has 4 drives"), "{e}");
        let e = place(&cluster(&[3, 3]), 2, 2).unwrap_err().0;
        assert!(e.contains("6 drives do not divide into sets of 4"), "{e}");
        let e = place(&cluster(&[4, 4]), 2, 0).unwrap_err().0;
        assert!(e.contains("parity shards must be at least 1"), "{e}");
        let e = place(&cluster(&[0, 0]), 2, 2).unwrap_err().0;
        assert!(e.contains("no node has drives"), "{e}");
        let mut twice = cluster(&[2, 2]);
        twice[0].drives[1] = twice[0].drives[0].clone();
        let e = place(&twice, 1, 1).unwrap_err().0;
        assert!(e.contains("lists a drive twice"), "{e}");
    }

    proptest! {
        /// Whenever no node has more drives than the sets can take from it,
        /// placement succeeds, uses every drive once and keeps every node at
        /// or under m shards per set; otherwise it is refused.
        #[test]
        fn placement_is_sound_and_complete(
            counts in proptest::collection::vec(0usize..9, 1..9),
            data in 1usize..6,
            parity in 1usize..4,
        ) {
            let nodes = cluster(&counts);
            let width = data + parity;
            let total: usize = counts.iter().sum();
            let feasible = total > 0
                && total.is_multiple_of(width)
                && counts.iter().all(|&c| c <= total / width * parity);
            match place(&nodes, data, parity) {
                Ok(sets) => {
                    prop_assert!(feasible);
                    prop_assert_eq!(sets.len(), total / width);
                    prop_assert!(sets.iter().all(|s| s.len() == width));
                    prop_assert!(max_per_node(&sets) <= parity);
                    let mut all: Vec<_> = sets.iter().flatten().map(|d| d.drive.clone()).collect();
                    all.sort();
                    all.dedup();
                    prop_assert_eq!(all.len(), total);
                }
                Err(e) => prop_assert!(!feasible, "feasible but refused: {}", e),
            }
        }

        /// The same cluster, listed in any order, gets the same sets.
        #[test]
        fn placement_is_stable(
            counts in proptest::collection::vec(1usize..6, 2..7),
            seed in any::<u64>(),
        ) {
            let nodes = cluster(&counts);
            let mut shuffled = nodes.clone();
            let mut x = seed | 1;
            for i in (1..shuffled.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                shuffled.swap(i, (x % (i as u64 + 1)) as usize);
                shuffled[i].drives.reverse();
            }
            prop_assert_eq!(place(&nodes, 2, 1), place(&shuffled, 2, 1));
        }
    }
}
