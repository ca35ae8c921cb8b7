//! The records a cluster keeps in etcd, as JSON documents with a format
//! number (docs/format.md, "etcd"): a node's permanent record, its
//! membership while it is up, and the one versioned cluster map.

use serde::{Deserialize, Serialize};

use crate::placement::{place, NodeDrives, PlacementError};

/// The format of every document below this build writes.
pub const FORMAT: u32 = 1;
/// The formats this build reads. A rolling upgrade needs the nodes of two
/// adjacent releases to read each other's records, so a release that
/// changes a document first reads the new format while still writing the
/// old one, and only the next release writes it (docs/format.md, "etcd").
/// Fields a document gains are optional and readers ignore fields they do
/// not know, so an added field needs no new format.
pub const FORMATS_READ: std::ops::RangeInclusive<u32> = 1..=1;

/// One drive of one node, as a set names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DriveRef {
    pub node: String,
    /// The drive's id (its format record's drive id, in hex).
    pub drive: String,
    /// The drive whose place it took (`node replace`): it joined a set
    /// holding data, so it is backfilled before it serves reads. Absent for
    /// a drive placed when its pool was formed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replaces: Option<String>,
}

/// A node's lifecycle, apart from whether it is up (Ceph's in/up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    Active,
    Draining,
    Retired,
}

/// `nodes/<id>`: what a node is, kept while it is down.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRecord {
    pub format: u32,
    pub id: String,
    /// Where peers reach its RPC (`--advertise`).
    pub address: String,
    /// Its S3 and admin endpoints, for tools (`cluster status`).
    pub s3: String,
    pub admin: String,
    /// Its drives' ids, in hex.
    pub drives: Vec<String>,
    pub zone: Option<String>,
    pub state: NodeState,
}

/// `members/<id>`: a node that is up, on a lease that lapses when it is not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    pub format: u32,
    pub address: String,
    /// Changes each time the node starts: a restarted node is a new member.
    pub incarnation: u64,
    /// The binary's version.
    pub version: String,
    /// Its KV-cache store, when it runs one (`--kv`): clients route keys
    /// over the members that have one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv: Option<KvMember>,
    /// The cluster RPC protocol versions it speaks, oldest and newest
    /// (absent from nodes built before issue 43): `cluster status` shows
    /// them during a rolling upgrade.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<(u16, u16)>,
}

/// A member's KV endpoint and its weight in rendezvous hashing (per mille
/// of a full share; a node that starts with an empty store ramps up).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvMember {
    pub endpoint: String,
    pub weight: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolState {
    /// Takes new objects and serves them.
    Active,
    /// Serves its objects while they are moved elsewhere; takes no new ones.
    Draining,
    /// Drained: holds nothing; kept in the map so that set numbers keep
    /// their meaning, its drives no longer used.
    Retired,
}

/// A pool: erasure sets of one geometry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    pub id: u32,
    pub state: PoolState,
    pub data_shards: u32,
    pub parity_shards: u32,
    /// Each set's drives, shard index order.
    pub sets: Vec<Vec<DriveRef>>,
}

/// `map`: the one cluster map, changed only by compare-and-swap on its etcd
/// revision; `epoch` counts its versions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMap {
    pub format: u32,
    pub cluster: String,
    pub epoch: u64,
    /// A random id fixed when the cluster is formed: drives formatted for it
    /// carry it, so a drive of another cluster is never taken for one of
    /// this.
    pub deployment_id: String,
    pub pools: Vec<Pool>,
}

impl ClusterMap {
    /// The first map of a cluster: one pool over the registered nodes'
    /// drives (`cluster init`).
    pub fn initial(
        cluster: &str,
        deployment_id: &str,
        nodes: &[NodeRecord],
        data: usize,
        parity: usize,
    ) -> Result<ClusterMap, PlacementError> {
        let offered: Vec<NodeDrives> = nodes
            .iter()
            .filter(|n| n.state == NodeState::Active)
            .map(|n| NodeDrives {
                node: n.id.clone(),
                drives: n.drives.clone(),
            })
            .collect();
        let sets = place(&offered, data, parity)?;
        Ok(ClusterMap {
            format: FORMAT,
            cluster: cluster.to_string(),
            epoch: 1,
            deployment_id: deployment_id.to_string(),
            pools: vec![Pool {
                id: 0,
                state: PoolState::Active,
                data_shards: data as u32,
                parity_shards: parity as u32,
                sets,
            }],
        })
    }

    /// The map with node `old`'s places given to node `new`'s drives, in
    /// order (sorted ids), one for one, and its epoch advanced. `new` must
    /// have a drive the map does not place for each of `old`'s places; it
    /// then holds exactly the shards `old` held in every set, so no set gets
    /// more than its parity from one node.
    pub fn replace_node(&self, old: &str, new: &NodeRecord) -> Result<ClusterMap, String> {
        if old == new.id {
            return Err(format!("node {old} cannot replace itself"));
        }
        let placed: std::collections::HashSet<&str> =
            self.drives().map(|(_, _, _, d)| d.drive.as_str()).collect();
        if self.drives().any(|(_, _, _, d)| d.node == new.id) {
            return Err(format!(
                "node {} already holds places in the map: a replacement must be a node the map does not use",
                new.id
            ));
        }
        let mut free: Vec<&String> = new
            .drives
            .iter()
            .filter(|d| !placed.contains(d.as_str()))
            .collect();
        free.sort();
        let wanted = self.drives().filter(|(_, _, _, d)| d.node == old).count();
        if wanted == 0 {
            return Err(format!("node {old} holds no place in the cluster map"));
        }
        if free.len() < wanted {
            return Err(format!(
                "node {old} holds {wanted} place(s) in the map; node {} has {} unplaced drive(s)",
                new.id,
                free.len()
            ));
        }
        let mut next = self.clone();
        let mut free = free.into_iter();
        for pool in &mut next.pools {
            for set in &mut pool.sets {
                for d in set.iter_mut().filter(|d| d.node == old) {
                    let drive = free.next().expect("counted above").clone();
                    *d = DriveRef {
                        node: new.id.clone(),
                        replaces: Some(d.drive.clone()),
                        drive,
                    };
                }
            }
        }
        next.epoch += 1;
        Ok(next)
    }

    /// The map with a new pool of `data`+`parity` sets over the drives of
    /// `nodes` that the map places nowhere (expansion), and its epoch
    /// advanced. The pool's id is one past the largest so far; placement
    /// follows the same rule as the first pool's (at most `parity` shards
    /// of a set on one node).
    pub fn add_pool(
        &self,
        nodes: &[NodeRecord],
        data: usize,
        parity: usize,
    ) -> Result<ClusterMap, String> {
        let placed: std::collections::HashSet<&str> =
            self.drives().map(|(_, _, _, d)| d.drive.as_str()).collect();
        let mut offered = Vec::new();
        for n in nodes {
            if n.state != NodeState::Active {
                return Err(format!("node {} is {:?}, not active", n.id, n.state));
            }
            let drives: Vec<String> = n
                .drives
                .iter()
                .filter(|d| !placed.contains(d.as_str()))
                .cloned()
                .collect();
            if drives.is_empty() {
                return Err(format!(
                    "node {} has no drive the map does not place already",
                    n.id
                ));
            }
            offered.push(NodeDrives {
                node: n.id.clone(),
                drives,
            });
        }
        let sets = place(&offered, data, parity).map_err(|e| e.to_string())?;
        let mut next = self.clone();
        next.pools.push(Pool {
            id: self.pools.iter().map(|p| p.id + 1).max().unwrap_or(0),
            state: PoolState::Active,
            data_shards: data as u32,
            parity_shards: parity as u32,
            sets,
        });
        next.epoch += 1;
        Ok(next)
    }

    /// The map with pool `id` draining (`pool drain`): refused for a pool
    /// that is not active, or the last active one.
    pub fn drain_pool(&self, id: u32) -> Result<ClusterMap, String> {
        let state = self.pool(id)?.state;
        if state != PoolState::Active {
            return Err(format!("pool {id} is {state:?} already").to_lowercase());
        }
        if !self
            .pools
            .iter()
            .any(|p| p.id != id && p.state == PoolState::Active)
        {
            return Err(format!(
                "pool {id} is the only active pool: its objects would have nowhere to go (add a pool first)"
            ));
        }
        Ok(self.with_state(id, PoolState::Draining))
    }

    /// The map with draining pool `id` retired (its drain done).
    pub fn retire_pool(&self, id: u32) -> Result<ClusterMap, String> {
        if self.pool(id)?.state != PoolState::Draining {
            return Err(format!("pool {id} is not draining"));
        }
        Ok(self.with_state(id, PoolState::Retired))
    }

    fn pool(&self, id: u32) -> Result<&Pool, String> {
        self.pools
            .iter()
            .find(|p| p.id == id)
            .ok_or_else(|| format!("the cluster map has no pool {id}"))
    }

    /// The map with pool `id` (which exists) in state `to`, its epoch
    /// advanced.
    fn with_state(&self, id: u32, to: PoolState) -> ClusterMap {
        let mut next = self.clone();
        next.pools
            .iter_mut()
            .find(|p| p.id == id)
            .expect("checked")
            .state = to;
        next.epoch += 1;
        next
    }

    /// Every drive the map places, with its pool, set and shard index.
    pub fn drives(&self) -> impl Iterator<Item = (u32, usize, usize, &DriveRef)> {
        self.pools.iter().flat_map(|p| {
            p.sets
                .iter()
                .enumerate()
                .flat_map(move |(s, set)| set.iter().enumerate().map(move |(i, d)| (p.id, s, i, d)))
        })
    }
}

/// Reads a document of one of the types above, refusing another format.
pub fn decode<T: serde::de::DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, String> {
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| format!("{what}: {e}"))?;
    match v.get("format").and_then(serde_json::Value::as_u64) {
        Some(f) if u32::try_from(f).is_ok_and(|f| FORMATS_READ.contains(&f)) => {}
        Some(f) => {
            return Err(format!(
                "{what}: format {f} (this binary reads formats {} to {}: a node of a release more than one apart)",
                FORMATS_READ.start(),
                FORMATS_READ.end()
            ))
        }
        None => return Err(format!("{what}: no format number")),
    }
    serde_json::from_value(v).map_err(|e| format!("{what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a node of the next release may write: fields this build does
    /// not know are ignored, a format it does not read is refused.
    #[test]
    fn records_of_a_newer_node_are_read_or_refused_never_misread() {
        let newer = br#"{"format":1,"address":"10.0.0.1:7000","incarnation":7,"version":"9.9.9",
            "kv":{"endpoint":"10.0.0.1:9400","weight":1000,"tier":"nvme"},"zone_hint":"a"}"#;
        let m: Member = decode("member", newer).unwrap();
        assert_eq!((m.incarnation, m.version.as_str()), (7, "9.9.9"));
        assert_eq!(m.kv.unwrap().weight, 1000);
        let next = FORMATS_READ.end() + 1;
        let other = format!(r#"{{"format":{next},"address":"a:1","incarnation":1,"version":"x"}}"#);
        let e = decode::<Member>("member", other.as_bytes()).unwrap_err();
        assert!(e.contains("more than one apart"), "{e}");
        assert!(decode::<Member>("member", br#"{"address":"a:1"}"#).is_err());
    }

    fn node(id: &str, drives: usize) -> NodeRecord {
        NodeRecord {
            format: FORMAT,
            id: id.into(),
            address: format!("{id}:7000"),
            s3: format!("http://{id}:9000"),
            admin: format!("http://{id}:9001"),
            drives: (0..drives).map(|d| format!("{id}-{d}")).collect(),
            zone: None,
            state: NodeState::Active,
        }
    }

    #[test]
    fn initial_map_and_round_trip() {
        let nodes: Vec<_> = ["a", "b", "c", "d"].iter().map(|n| node(n, 2)).collect();
        let map = ClusterMap::initial("c1", "dep", &nodes, 2, 2).unwrap();
        assert_eq!(map.epoch, 1);
        assert_eq!(map.pools[0].sets.len(), 2);
        assert_eq!(map.drives().count(), 8);
        let bytes = serde_json::to_vec(&map).unwrap();
        assert_eq!(decode::<ClusterMap>("map", &bytes).unwrap(), map);
        let mut other = serde_json::to_value(&map).unwrap();
        other["format"] = 2.into();
        let e = decode::<ClusterMap>("map", &serde_json::to_vec(&other).unwrap()).unwrap_err();
        assert!(e.contains("format 2"), "{e}");
        // Retired and draining nodes offer no drives to a new pool.
        let mut less = nodes.clone();
        less[3].state = NodeState::Draining;
        assert!(ClusterMap::initial("c1", "dep", &less, 2, 2).is_err());
    }

    #[test]
    fn replacing_a_node_gives_its_places_to_the_new_one() {
        let mut nodes: Vec<_> = ["a", "b", "c", "d"].iter().map(|n| node(n, 2)).collect();
        let map = ClusterMap::initial("c1", "dep", &nodes, 2, 2).unwrap();
        nodes.push(node("e", 2));
        let next = map.replace_node("c", &nodes[4]).unwrap();
        assert_eq!(next.epoch, map.epoch + 1);
        let before: Vec<_> = map.drives().filter(|d| d.3.node == "c").collect();
        let after: Vec<_> = next.drives().filter(|d| d.3.node == "e").collect();
        assert_eq!(before.len(), after.len());
        for (b, a) in before.iter().zip(&after) {
            assert_eq!((b.0, b.1, b.2), (a.0, a.1, a.2), "the same place");
            assert_eq!(a.3.replaces.as_deref(), Some(b.3.drive.as_str()));
        }
        assert!(next.drives().all(|d| d.3.node != "c"));
        // Unchanged places say nothing of a replacement, in JSON either.
        let j = serde_json::to_value(&next).unwrap();
        assert!(j["pools"][0]["sets"][0][0].get("replaces").is_none());
        assert_eq!(
            decode::<ClusterMap>("map", &serde_json::to_vec(&next).unwrap()).unwrap(),
            next
        );
        // Refusals: itself, a node in use, too few drives, a node with no place.
        assert!(map
            .replace_node("c", &nodes[2])
            .unwrap_err()
            .contains("itself"));
        assert!(next
            .replace_node("a", &nodes[4])
            .unwrap_err()
            .contains("already holds"));
        let small = node("f", 1);
        assert!(map
            .replace_node("c", &small)
            .unwrap_err()
            .contains("unplaced drive"));
        assert!(map
            .replace_node("zz", &nodes[4])
            .unwrap_err()
            .contains("holds no place"));
    }

    #[test]
    fn adding_a_pool_places_only_new_drives() {
        let mut nodes: Vec<_> = ["a", "b", "c", "d"].iter().map(|n| node(n, 2)).collect();
        let map = ClusterMap::initial("c1", "dep", &nodes, 2, 2).unwrap();
        let more: Vec<_> = ["e", "f", "g", "h"].iter().map(|n| node(n, 1)).collect();
        let next = map.add_pool(&more, 2, 2).unwrap();
        assert_eq!(next.epoch, map.epoch + 1);
        assert_eq!(next.pools.len(), 2);
        assert_eq!(next.pools[0], map.pools[0], "the first pool is unchanged");
        let p = &next.pools[1];
        assert_eq!((p.id, p.state, p.sets.len()), (1, PoolState::Active, 1));
        assert!(p.sets[0]
            .iter()
            .all(|d| ["e", "f", "g", "h"].contains(&d.node.as_str())));
        // A node of the first pool with a new drive can take part too.
        nodes[0].drives.push("a-new".into());
        let mixed = [
            nodes[0].clone(),
            more[0].clone(),
            more[1].clone(),
            more[2].clone(),
        ];
        let next = map.add_pool(&mixed, 2, 2).unwrap();
        assert!(next.pools[1].sets[0].iter().any(|d| d.drive == "a-new"));
        // Refusals: a node with nothing new, too few nodes for the parity.
        assert!(map
            .add_pool(&nodes[1..2], 1, 1)
            .unwrap_err()
            .contains("no drive"));
        assert!(map.add_pool(&more[..2], 2, 2).is_err());
        let mut retired = more.clone();
        retired[0].state = NodeState::Retired;
        assert!(map
            .add_pool(&retired, 2, 2)
            .unwrap_err()
            .contains("not active"));
    }

    #[test]
    fn draining_and_retiring_a_pool() {
        let nodes: Vec<_> = ["a", "b", "c", "d"].iter().map(|n| node(n, 1)).collect();
        let map = ClusterMap::initial("c1", "dep", &nodes, 2, 2).unwrap();
        assert!(map.drain_pool(0).unwrap_err().contains("only active pool"));
        let more: Vec<_> = ["e", "f", "g", "h"].iter().map(|n| node(n, 1)).collect();
        let two = map.add_pool(&more, 2, 2).unwrap();
        assert!(two.retire_pool(1).unwrap_err().contains("not draining"));
        let d = two.drain_pool(1).unwrap();
        assert_eq!(
            (d.pools[1].state, d.epoch),
            (PoolState::Draining, two.epoch + 1)
        );
        assert!(d.drain_pool(1).unwrap_err().contains("draining already"));
        assert!(d.drain_pool(0).unwrap_err().contains("only active pool"));
        assert!(d.drain_pool(7).unwrap_err().contains("no pool 7"));
        let r = d.retire_pool(1).unwrap();
        assert_eq!(r.pools[1].state, PoolState::Retired);
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["pools"][1]["state"], "retired");
    }

    #[test]
    fn node_record_json_names() {
        let j = serde_json::to_value(node("a", 1)).unwrap();
        assert_eq!(j["state"], "active");
        assert_eq!(j["drives"][0], "a-0");
    }
}
