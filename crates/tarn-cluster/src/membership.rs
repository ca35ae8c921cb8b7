//! A node's membership: `members/<id>` on an etcd lease of a few seconds,
//! renewed on a dedicated OS thread with its own small runtime, so that a
//! busy serving runtime can never starve the renewal (a node that is alive
//! but looks dead is taken out of service by its peers).
//!
//! A node whose lease lapses stops counting itself a member (`is_member`)
//! until it has registered again on a new lease.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::etcd::Etcd;

/// The renewal thread of one node's membership.
pub struct Membership {
    stop: Arc<AtomicBool>,
    lease: Arc<Held>,
    value: Arc<Value>,
    thread: Option<JoinHandle<()>>,
}

/// When the lease was last known good, as milliseconds after `base` (0:
/// no lease). Read by whoever asks, so that a renewal stuck on an etcd that
/// does not answer cannot keep the node a member past its TTL.
/// The record's value, and whether it changed since it was last written.
#[derive(Default)]
struct Value(Mutex<(Vec<u8>, bool)>);

impl Value {
    fn get(&self) -> Vec<u8> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).0.clone()
    }

    /// The new value if it was not written yet (marked written).
    fn take_changed(&self) -> Option<Vec<u8>> {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut v.1).then(|| v.0.clone())
    }

    fn set(&self, value: Vec<u8>, changed: bool) {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        v.0 = value;
        v.1 |= changed;
    }
}

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
        let held_value = Arc::new(Value::default());
        held_value.set(value, false);
        let (s, m, v) = (stop.clone(), lease.clone(), held_value.clone());
        let thread = std::thread::Builder::new()
            .name("tarn-membership".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("membership runtime");
                rt.block_on(hold(etcd, key, v, ttl, s, m));
            })?;
        Ok(Membership {
            stop,
            lease,
            value: held_value,
            thread: Some(thread),
        })
    }

    /// Changes the record's value: written on the lease held (within a
    /// renewal tick), or with the next registration.
    pub fn update(&self, value: Vec<u8>) {
        self.value.set(value, true);
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
    value: Arc<Value>,
    ttl: i64,
    stop: Arc<AtomicBool>,
    held: Arc<Held>,
) {
    let every = Duration::from_millis(ttl as u64 * 1000 / 3);
    let tick = Duration::from_millis(100);
    let mut lease: Option<i64> = None;
    let mut next = Instant::now();
    let mut update_at = Instant::now();
    while !stop.load(Ordering::Acquire) {
        let changed = match lease {
            Some(_) if Instant::now() >= update_at => value.take_changed(),
            _ => None,
        };
        if let (Some(id), Some(v)) = (lease, changed) {
            if let Err(e) = etcd.put(&key, &v, Some(id)).await {
                tracing::warn!(key = %key, error = %e, "cannot update the membership record");
                // Tried again in a second, or written by the next registration.
                value.set(v, true);
                update_at = Instant::now() + Duration::from_secs(1);
            }
        }
        if Instant::now() >= next {
            next = Instant::now() + every;
            let asked = Instant::now();
            match lease {
                None => match register(&etcd, &key, &value.get(), ttl).await {
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
