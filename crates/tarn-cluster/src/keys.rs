//! The etcd key layout (layout version 1; docs/format.md, "etcd"). Every
//! key of a cluster is under `/tarn/<cluster>/`:
//!
//! ```text
//! layout            "2": the layout version; a node refuses another
//!                   (every value is sealed, etcd::Seal; "1" was unsealed)
//! nodes/<id>        NodeRecord: permanent, kept while the node is down
//! members/<id>      Member: on the node's lease, gone when it lapses
//! map               ClusterMap: changed only by compare-and-swap
//! maps/<epoch>      earlier maps, the most recent few kept
//! leader/<role>     the elected holder of a background role; the key's
//!                   create revision is its fencing token
//! progress/<id>     a node's background jobs under way (backfill): JSON,
//!                   on a short lease, for `cluster status`
//! jobs/<role>/<id>  a job's checkpoint (a pool's drain): JSON, written
//!                   only under the leader's fencing token
//! space/<id>        a node's drives' free and total bytes: JSON, on a
//!                   short lease, for placing new objects by free space
//! buckets/<name>    a bucket's record (format.md's bucket record bytes)
//! sys/<key>         a system document (users and their keys, buckets'
//!                   owners, ACLs and policies: JSON, as on one node)
//! ```

/// The layout these functions build.
pub const LAYOUT_VERSION: &str = "2";
/// The layout before values were sealed (issue 40): a node seals such a
/// cluster's records only when told to (`--seal-etcd-records`).
pub const LAYOUT_UNSEALED: &str = "1";

/// The keys of one cluster.
#[derive(Debug, Clone)]
pub struct Keys {
    root: String,
}

impl Keys {
    /// Cluster names are what a DNS label allows, so that keys need no
    /// escaping.
    pub fn new(cluster: &str) -> Result<Keys, String> {
        valid_name("cluster", cluster)?;
        Ok(Keys {
            root: format!("/tarn/{cluster}/"),
        })
    }

    pub fn root(&self) -> &str {
        &self.root
    }

    pub fn layout(&self) -> String {
        format!("{}layout", self.root)
    }

    pub fn nodes(&self) -> String {
        format!("{}nodes/", self.root)
    }

    pub fn node(&self, id: &str) -> String {
        format!("{}nodes/{id}", self.root)
    }

    pub fn members(&self) -> String {
        format!("{}members/", self.root)
    }

    pub fn member(&self, id: &str) -> String {
        format!("{}members/{id}", self.root)
    }

    pub fn map(&self) -> String {
        format!("{}map", self.root)
    }

    pub fn old_map(&self, epoch: u64) -> String {
        format!("{}maps/{epoch:020}", self.root)
    }

    pub fn buckets(&self) -> String {
        format!("{}buckets/", self.root)
    }

    pub fn bucket(&self, name: &str) -> String {
        format!("{}buckets/{name}", self.root)
    }

    pub fn docs(&self) -> String {
        format!("{}sys/", self.root)
    }

    pub fn doc(&self, key: &str) -> String {
        format!("{}sys/{key}", self.root)
    }

    pub fn progress_all(&self) -> String {
        format!("{}progress/", self.root)
    }

    pub fn progress(&self, id: &str) -> String {
        format!("{}progress/{id}", self.root)
    }

    pub fn job(&self, role: &str, id: &str) -> String {
        format!("{}jobs/{role}/{id}", self.root)
    }

    pub fn space_all(&self) -> String {
        format!("{}space/", self.root)
    }

    pub fn space(&self, id: &str) -> String {
        format!("{}space/{id}", self.root)
    }

    pub fn leader(&self, role: &str) -> String {
        format!("{}leader/{role}", self.root)
    }
}

/// Node ids and cluster names: 1–63 of `a-z 0-9 -`, not starting or ending
/// with `-`.
pub fn valid_name(what: &str, name: &str) -> Result<(), String> {
    let ok = (1..=63).contains(&name.len())
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{what} name {name:?} must be 1-63 of a-z, 0-9 and '-', not starting or ending with '-'"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        let k = Keys::new("prod-1").unwrap();
        assert_eq!(k.node("n1"), "/tarn/prod-1/nodes/n1");
        assert_eq!(k.member("n1"), "/tarn/prod-1/members/n1");
        assert_eq!(k.map(), "/tarn/prod-1/map");
        assert_eq!(k.old_map(7), "/tarn/prod-1/maps/00000000000000000007");
        assert!(k.node("n1").starts_with(&k.nodes()));
        for bad in ["", "A", "a/b", "-a", "a-", &"x".repeat(64)] {
            assert!(Keys::new(bad).is_err(), "{bad:?}");
        }
    }
}
