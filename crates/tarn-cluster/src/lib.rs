//! Tarn as a cluster (DESIGN.md, "Cluster"): what is small and global lives in
//! etcd under `/tarn/<cluster>/` (`keys`), read and changed through etcd's v3
//! JSON gateway (`etcd`, on the HTTP client Tarn already has); the cluster map
//! (`map`) names pools of erasure sets whose drives `placement` spreads so that
//! no node holds more than m shards of any set.

pub mod catalog;
pub mod etcd;
pub mod jobs;
pub mod keys;
pub mod map;
pub mod membership;
pub mod node;
pub mod placement;
pub mod remote;
pub mod rpc;
