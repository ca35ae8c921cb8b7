//! A node's membership: `members/<id>` on an etcd lease of a few seconds,
//! renewed on a dedicated OS thread with its own small runtime, so that a
//! busy serving runtime can never starve the renewal (a node that is alive
//! but looks dead is taken out of service by its peers).
//!
//! A node whose lease lapses stops counting itself a member (`is_member`)
//! until it has registered again on a new lease.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::etcd::Etcd;

/// The renewal thread of one node's membership.
pub struct Membership {
    stop: Arc<AtomicBool>,
    lease: Arc<Held>,
    thread: Option<JoinHandle<()>>,
}

/// When the lease was last known good, as milliseconds after `base` (0:
/// no lease). Read by whoever asks, so that a renewal stuck on an etcd that
/// does not answer cannot keep the node a member past its TTL.
struct Held {
    base: Instant,
    since_ms: AtomicU64,
    ttl: Duration,
}

impl Held {
    /// Marks the lease good as of `at` (taken before the request that
    /// proved it, so the node's view never outlasts etcd's).
    fn renewed(&self, at: Instant) {
        let ms = at.duration_since(self.base).as_millis() as u64;
        self.since_ms.store(ms.max(1), Ordering::Release);
    }

    fn lost(&self) {
        self.since_ms.store(0, Ordering::Release);
    }

    fn live(&self) -> bool {
        match self.since_ms.load(Ordering::Acquire) {
            0 => false,
            ms => self.base.elapsed() < Duration::from_millis(ms) + self.ttl,
        }
    }
}

impl Membership {
    /// Holds `key` = `value` on a lease of `ttl` seconds (at least 2),
    /// renewed three times per TTL.
    pub fn start(etcd: Etcd, key: String, value: Vec<u8>, ttl: i64) -> std::io::Result<Self> {
        let ttl = ttl.max(2);
        let stop = Arc::new(AtomicBool::new(false));
        let lease = Arc::new(Held {
            base: Instant::now(),
            since_ms: AtomicU64::new(0),
            ttl: Duration::from_secs(ttl as u64),
        });
        let (s, m) = (stop.clone(), lease.clone());
        let thread = std::thread::Builder::new()
            .name("tarn-membership".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("membership runtime");
                rt.block_on(hold(etcd, key, value, ttl, s, m));
            })?;
        Ok(Membership {
            stop,
            lease,
            thread: Some(thread),
        })
    }

    /// Whether the node holds a live lease now.
    pub fn is_member(&self) -> bool {
        self.lease.live()
    }

    /// Ends the membership: the lease is revoked, so peers see the node gone
    /// at once rather than after its TTL.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Membership {
    fn drop(&mut self) {
        self.shutdown();
    }
}

async fn hold(
    etcd: Etcd,
    key: String,
    value: Vec<u8>,
    ttl: i64,
    stop: Arc<AtomicBool>,
    held: Arc<Held>,
) {
    let every = Duration::from_millis(ttl as u64 * 1000 / 3);
    let tick = Duration::from_millis(100);
    let mut lease: Option<i64> = None;
    let mut next = Instant::now();
    while !stop.load(Ordering::Acquire) {
        if Instant::now() >= next {
            next = Instant::now() + every;
            let asked = Instant::now();
            match lease {
                None => match register(&etcd, &key, &value, ttl).await {
                    Ok(id) => {
                        tracing::info!(key = %key, lease = id, "joined as a member");
                        held.renewed(asked);
                        lease = Some(id);
                    }
                    Err(e) => {
                        tracing::warn!(key = %key, error = %e, "cannot register as a member")
                    }
                },
                Some(id) => match etcd.lease_keep_alive(id).await {
                    Ok(left) if left > 0 => held.renewed(asked),
                    Ok(_) => {
                        tracing::warn!(key = %key, "membership lease expired; registering again");
                        held.lost();
                        lease = None;
                        next = Instant::now();
                    }
                    Err(e) => {
                        tracing::warn!(key = %key, error = %e, "cannot renew the membership lease");
                        // Past its TTL the lease is gone whatever etcd says
                        // later: register anew once etcd answers.
                        if !held.live() {
                            lease = None;
                        }
                    }
                },
            }
        }
        tokio::time::sleep(tick).await;
    }
    held.lost();
    if let Some(id) = lease {
        if let Err(e) = etcd.lease_revoke(id).await {
            tracing::warn!(key = %key, error = %e, "cannot revoke the membership lease");
        }
    }
}

async fn register(etcd: &Etcd, key: &str, value: &[u8], ttl: i64) -> Result<i64, String> {
    let (id, _) = etcd.lease_grant(ttl).await.map_err(|e| e.to_string())?;
    if let Err(e) = etcd.put(key, value, Some(id)).await {
        let _ = etcd.lease_revoke(id).await;
        return Err(e.to_string());
    }
    Ok(id)
}
