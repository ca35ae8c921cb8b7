//! The records a cluster keeps in etcd, as JSON documents with a format
//! number (docs/format.md, "etcd"): a node's permanent record, its
//! membership while it is up, and the one versioned cluster map.

use serde::{Deserialize, Serialize};

use crate::placement::{place, NodeDrives, PlacementError};

/// The format of every document below; a reader refuses another one.
pub const FORMAT: u32 = 1;

/// One drive of one node, as a set names it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct DriveRef {
    pub node: String,
    /// The drive's id (its format record's drive id, in hex).
    pub drive: String,
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
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolState {
    /// Takes new objects and serves them.
    Active,
    /// Serves its objects while they are moved elsewhere; takes no new ones.
    Draining,
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
        Some(f) if f == u64::from(FORMAT) => {}
        Some(f) => {
            return Err(format!(
                "{what}: format {f} (this binary reads format {FORMAT})"
            ))
        }
        None => return Err(format!("{what}: no format number")),
    }
    serde_json::from_value(v).map_err(|e| format!("{what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn node_record_json_names() {
        let j = serde_json::to_value(node("a", 1)).unwrap();
        assert_eq!(j["state"], "active");
        assert_eq!(j["drives"][0], "a-0");
    }
}
