//! Background jobs of a cluster that one node runs at a time (a pool's
//! drain): a leader per role, elected through etcd, and fenced.
//!
//! `leader/<role>` is created only if absent, on a lease the leader renews;
//! its create revision is the leadership's fencing token. A leader that
//! stops renewing (killed, paused, cut off) loses the key when the lease
//! lapses, and another node creates it anew, with a larger token. Every
//! write a job makes to etcd (its checkpoint, the map change that ends it)
//! is a transaction conditional on the leader key still carrying the
//! writer's token, and the leader asks before each step whether its lease
//! was renewed recently enough: an old leader that wakes up finds out at
//! its next step and stops, and its writes are refused.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::etcd::{Etcd, EtcdError};
use crate::keys::Keys;

/// Seconds of a leader's lease.
pub const LEADER_TTL_SECS: i64 = 6;

/// This node's leadership of one role.
pub struct Leadership {
    etcd: Etcd,
    key: String,
    lease: i64,
    /// The leader key's create revision: the fencing token.
    pub token: i64,
    /// When the lease was last renewed (measured before the call).
    renewed: Mutex<Instant>,
    lost: AtomicBool,
}

impl Leadership {
    /// Becomes the leader of `role` if nobody is: Some with the token, or
    /// None when another node holds it.
    pub async fn campaign(
        etcd: &Etcd,
        keys: &Keys,
        role: &str,
        node: &str,
    ) -> Result<Option<Arc<Leadership>>, EtcdError> {
        let key = keys.leader(role);
        let (lease, _) = etcd.lease_grant(LEADER_TTL_SECS).await?;
        let at = Instant::now();
        if !etcd
            .compare_and_swap(&key, 0, node.as_bytes(), Some(lease))
            .await?
        {
            etcd.lease_revoke(lease).await?;
            return Ok(None);
        }
        let (kv, _) = etcd.get(&key).await?;
        let Some(kv) = kv.filter(|kv| kv.lease == lease) else {
            etcd.lease_revoke(lease).await?;
            return Ok(None);
        };
        let lead = Arc::new(Leadership {
            etcd: etcd.clone(),
            key,
            lease,
            token: kv.create_revision,
            renewed: Mutex::new(at),
            lost: AtomicBool::new(false),
        });
        // Renewed every second while the leadership is held by anyone (the
        // task holds it only during a renewal) and not lost.
        let weak = Arc::downgrade(&lead);
        tokio::spawn(async move {
            while let Some(l) = weak.upgrade() {
                if !l.renew().await {
                    return;
                }
                drop(l);
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        });
        Ok(Some(lead))
    }

    /// Renews the lease; false (for good) once it has lapsed.
    pub async fn renew(&self) -> bool {
        if self.lost.load(Ordering::Acquire) {
            return false;
        }
        let at = Instant::now();
        match self.etcd.lease_keep_alive(self.lease).await {
            Ok(ttl) if ttl > 0 => {
                *self.renewed.lock().expect("renewed") = at;
                true
            }
            Ok(_) => {
                self.lost.store(true, Ordering::Release);
                false
            }
            // etcd unreachable: still the leader until the lease could have
            // lapsed (`holds`).
            Err(_) => self.holds(),
        }
    }

    /// Whether this node may take another step: the lease was renewed
    /// less than half its time ago. A leader paused past that stops at its
    /// next step, before another could have taken over.
    pub fn holds(&self) -> bool {
        !self.lost.load(Ordering::Acquire)
            && self.renewed.lock().expect("renewed").elapsed()
                < Duration::from_secs(LEADER_TTL_SECS as u64) / 2
    }

    /// Writes `key` only while this leadership holds in etcd (the fence).
    pub async fn put(&self, key: &str, value: &[u8]) -> Result<bool, EtcdError> {
        let ok = self
            .etcd
            .put_fenced(&self.key, self.token, key, value)
            .await?;
        if !ok {
            self.lost.store(true, Ordering::Release);
        }
        Ok(ok)
    }

    /// Swaps the map (read at `revision`) only while this leadership holds.
    pub async fn swap_map(
        &self,
        keys: &Keys,
        revision: i64,
        value: &[u8],
    ) -> Result<bool, EtcdError> {
        let ok = self
            .etcd
            .compare_and_swap_fenced(&keys.map(), revision, value, (&self.key, self.token))
            .await?;
        Ok(ok)
    }

    /// Whether the leader key still carries this leadership's token.
    pub async fn still_leader(&self) -> Result<bool, EtcdError> {
        let (kv, _) = self.etcd.get(&self.key).await?;
        let ok = kv.is_some_and(|kv| kv.create_revision == self.token);
        if !ok {
            self.lost.store(true, Ordering::Release);
        }
        Ok(ok)
    }

    /// Gives the role up now (its key goes with the lease).
    pub async fn resign(&self) {
        self.lost.store(true, Ordering::Release);
        let _ = self.etcd.lease_revoke(self.lease).await;
    }
}
