//! A client of a cluster's KV members: each key goes to the member that
//! ranks first for it in weighted rendezvous hashing (`tarn_client::route`),
//! a batch is split into one batch per member, sent concurrently.
//!
//! - A miss at the first-ranked member is asked of the second (a member
//!   that restarted empty and ramps its weight up owns keys another member
//!   still holds); a hit there is written back to the first.
//! - A block the server reports hot gets a second copy on the second-ranked
//!   member, and later reads of it alternate between the two.
//! - Every batch carries the view it was routed by: a member whose view is
//!   newer answers `NotOwner`, and the client asks it for CLUSTER and routes
//!   again. A member that cannot be reached is left out of the ranking for
//!   a moment, so its keys go to their next-ranked member.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use tarn_client::kv::{not_owner, BlockingKvClient, ConnectOptions, Error, GetInto, PutFrom};
use tarn_client::route::{key_hash, namespace_hash, Ring};
use tarn_client::{ClusterView, Digest, GetOutcome, Part, Status, BATCH_COPY, BATCH_FALLBACK};

use crate::buffers::Region;
use crate::{Failure, Pool};

/// How long a member that could not be reached is left out of the ranking.
const DOWN_FOR: Duration = Duration::from_secs(2);
/// Tries of a call whose routing changed under it (a refreshed view, a
/// member found down) before its error is the caller's.
const ATTEMPTS: usize = 4;
/// How often a call asks a member for its view even without a `NotOwner`
/// (a client talking only to members as stale as itself catches up).
const VIEW_CHECK_EVERY: Duration = Duration::from_secs(5);
/// Hot blocks remembered; the set starts over when full.
const HOT_KEYS_MAX: usize = 65_536;

/// A call on one member's share of the keys (indexes into the call's keys).
pub type Share<'a, T> = dyn Fn(&mut BlockingKvClient, &[usize]) -> Result<T, Error> + Sync + 'a;

/// A view with a connection pool per member, in the view's order.
struct Routing {
    ring: Ring,
    pools: Vec<Arc<Pool>>,
}

/// Counts of what routing did, for `routing_stats()`.
#[derive(Default)]
pub struct Counters {
    pub refreshes: AtomicU64,
    pub fallback_gets: AtomicU64,
    pub fallback_hits: AtomicU64,
    pub copies_written: AtomicU64,
    pub hot_copies: AtomicU64,
    pub member_failures: AtomicU64,
}

pub struct Router {
    opts: ConnectOptions,
    max: usize,
    ns_hash: u64,
    current: RwLock<Arc<Routing>>,
    /// Pools by endpoint, kept across views.
    pools: Mutex<HashMap<String, Arc<Pool>>>,
    down: Mutex<HashMap<String, Instant>>,
    hot: Mutex<HashSet<Digest>>,
    turn: AtomicU64,
    /// When the view was last asked for.
    checked: Mutex<Instant>,
    pub counters: Counters,
}

/// What one member's share of a call came back with.
enum Outcome<T> {
    Done(Vec<(Vec<usize>, T)>),
    /// The routing changed (refreshed, or a member left out): route again.
    Again,
}

/// The gets of keys `idx` into their regions: whole values, or with
/// `offsets` each region's length from its offset.
pub fn get_requests<'a>(
    keys: &[Digest],
    regions: &[Region],
    offsets: Option<&[u64]>,
    idx: &[usize],
) -> Vec<GetInto<'a>> {
    idx.iter()
        .map(|i| {
            let r = regions[*i];
            // SAFETY: each region is caller memory held (buffer view or
            // tensor reference) until the call returns, writable, disjoint
            // from the others (checked by the caller), and each key is in
            // one member's share only.
            let buf = unsafe { std::slice::from_raw_parts_mut(r.0 as *mut u8, r.1) };
            match offsets {
                None => GetInto::whole(keys[*i], buf),
                Some(o) => GetInto {
                    digest: keys[*i],
                    offset: o[*i],
                    len: Some(r.1 as u64),
                    buf,
                },
            }
        })
        .collect()
}

/// The puts of keys `idx` from their whole regions.
pub fn put_items<'a>(keys: &[Digest], regions: &[Region], idx: &[usize]) -> Vec<PutFrom<'a>> {
    put_prefixes(keys, regions, idx, |i| regions[i].1)
}

fn put_prefixes<'a>(
    keys: &[Digest],
    regions: &[Region],
    idx: &[usize],
    len: impl Fn(usize) -> usize,
) -> Vec<PutFrom<'a>> {
    idx.iter()
        .map(|i| PutFrom {
            digest: keys[*i],
            // SAFETY: caller memory held until the call returns; only read.
            data: unsafe { std::slice::from_raw_parts(regions[*i].0 as *const u8, len(*i)) },
        })
        .collect()
}

/// Puts each member's answers back at their keys' places in `out`, through
/// `put(slot, answer, key index)`.
fn scatter<T>(
    out: &mut [T],
    done: Vec<(Vec<usize>, Vec<T>)>,
    mut put: impl FnMut(&mut T, T, usize),
) {
    for (idx, answers) in done {
        for (i, a) in idx.into_iter().zip(answers) {
            put(&mut out[i], a, i);
        }
    }
}

impl Router {
    /// A router over `view` (which has members), connecting with `opts`.
    pub fn new(view: ClusterView, opts: ConnectOptions, max: usize) -> Router {
        let r = Router {
            ns_hash: namespace_hash(&opts.namespace),
            opts,
            max,
            current: RwLock::new(Arc::new(Routing {
                ring: Ring::new(ClusterView::default()),
                pools: Vec::new(),
            })),
            pools: Mutex::default(),
            down: Mutex::default(),
            hot: Mutex::default(),
            turn: AtomicU64::new(0),
            checked: Mutex::new(Instant::now()),
            counters: Counters::default(),
        };
        r.install(view);
        r
    }

    fn routing(&self) -> Arc<Routing> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn view(&self) -> ClusterView {
        self.routing().ring.view.clone()
    }

    fn pool(&self, endpoint: &str) -> Arc<Pool> {
        let mut pools = self.pools.lock().unwrap_or_else(|p| p.into_inner());
        pools
            .entry(endpoint.to_string())
            .or_insert_with(|| Arc::new(Pool::new(endpoint, self.opts.clone(), self.max)))
            .clone()
    }

    /// Routes by `view` from now on, unless the one held is newer.
    fn install(&self, view: ClusterView) {
        if view.members.is_empty() {
            return;
        }
        let pools = view
            .members
            .iter()
            .map(|m| self.pool(&m.endpoint))
            .collect();
        let mut cur = self.current.write().unwrap_or_else(|p| p.into_inner());
        if !cur.ring.is_empty() && view.epoch < cur.ring.view.epoch {
            return;
        }
        *cur = Arc::new(Routing {
            ring: Ring::new(view),
            pools,
        });
    }

    /// Asks `pool`'s member for its view and routes by it.
    fn refresh(&self, pool: &Pool) -> Result<(), Failure> {
        let view = pool.run(|c| c.cluster_view())?;
        self.counters.refreshes.fetch_add(1, Ordering::Relaxed);
        *self.checked.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
        self.install(view);
        Ok(())
    }

    /// Every [`VIEW_CHECK_EVERY`], asks one usable member (in turn) for its
    /// view; a member that does not answer is left to the call to find.
    fn check_view(&self) {
        {
            let mut at = self.checked.lock().unwrap_or_else(|p| p.into_inner());
            if at.elapsed() < VIEW_CHECK_EVERY {
                return;
            }
            *at = Instant::now();
        }
        let r = self.routing();
        let usable = self.usable(&r);
        let n = r.pools.len().max(1);
        let start = self.turn.fetch_add(1, Ordering::Relaxed) as usize % n;
        if let Some(m) = (0..n).map(|i| (start + i) % n).find(|m| usable[*m]) {
            if let Ok(view) = r.pools[m].run(|c| c.cluster_view()) {
                self.install(view);
            }
        }
    }

    fn usable(&self, r: &Routing) -> Vec<bool> {
        let mut down = self.down.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        down.retain(|_, until| *until > now);
        let usable: Vec<bool> = r
            .ring
            .view
            .members
            .iter()
            .map(|m| !down.contains_key(&m.endpoint))
            .collect();
        // With every member left out, try them all: the call's own failure
        // then says why.
        if usable.iter().any(|u| *u) {
            usable
        } else {
            vec![true; usable.len()]
        }
    }

    fn mark_down(&self, endpoint: &str) {
        self.counters
            .member_failures
            .fetch_add(1, Ordering::Relaxed);
        self.down
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(endpoint.to_string(), Instant::now() + DOWN_FOR);
    }

    /// Each key's first- and second-ranked member among the usable ones;
    /// a hot block's two are swapped on every other call, so its reads
    /// alternate between its copies.
    fn ranks(&self, r: &Routing, keys: &[Digest], spread_hot: bool) -> Vec<[Option<usize>; 2]> {
        let usable = self.usable(r);
        let swap = spread_hot && self.turn.fetch_add(1, Ordering::Relaxed) % 2 == 1;
        let hot = self.hot.lock().unwrap_or_else(|p| p.into_inner());
        keys.iter()
            .map(|d| {
                let [a, b] = r.ring.ranks(key_hash(self.ns_hash, d), |i| usable[i]);
                if swap && b.is_some() && hot.contains(d) {
                    [b, a]
                } else {
                    [a, b]
                }
            })
            .collect()
    }

    /// The id of each key's first-ranked member (None: no member usable).
    pub fn owners(&self, keys: &[Digest]) -> Vec<Option<String>> {
        let r = self.routing();
        self.ranks(&r, keys, false)
            .iter()
            .map(|[a, _]| a.map(|i| r.ring.view.members[i].id.clone()))
            .collect()
    }

    /// Runs `f` on each member's share of `keys` (`which`: the rank each
    /// key goes to; keys without one are left out), concurrently when more
    /// than one member has a share. A member whose view is newer makes the
    /// client refresh; one it cannot reach is left out for a moment; either
    /// way the caller routes again.
    fn fan_out<T: Send>(
        &self,
        r: &Routing,
        which: &[Option<usize>],
        flags: u16,
        f: &Share<'_, T>,
    ) -> Result<Outcome<T>, Failure> {
        let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
        for (k, m) in which.iter().enumerate() {
            let Some(m) = *m else { continue };
            match groups.iter_mut().find(|g| g.0 == m) {
                Some(g) => g.1.push(k),
                None => groups.push((m, vec![k])),
            }
        }
        let route = r.ring.view.route();
        let run = |m: usize, idx: &[usize]| {
            r.pools[m].run(|c| {
                c.client().set_route(Some(route));
                c.client().set_batch_flags(flags);
                f(c, idx)
            })
        };
        let results: Vec<Result<T, Failure>> = if groups.len() == 1 {
            vec![run(groups[0].0, &groups[0].1)]
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = groups
                    .iter()
                    .map(|(m, idx)| s.spawn(move || run(*m, idx)))
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a routed call panicked"))
                    .collect()
            })
        };
        let mut done = Vec::with_capacity(groups.len());
        let mut again = false;
        let mut failed = None;
        for ((m, idx), res) in groups.into_iter().zip(results) {
            match res {
                Ok(v) => done.push((idx, v)),
                Err(Failure::Call(e)) if not_owner(&e) => {
                    self.refresh(&r.pools[m])?;
                    again = true;
                }
                Err(Failure::Connect(..))
                | Err(Failure::Call(Error::Io(_)))
                | Err(Failure::Call(Error::Broken)) => {
                    self.mark_down(&r.ring.view.members[m].endpoint);
                    again = true;
                }
                Err(e) => failed = Some(e),
            }
        }
        match (failed, again) {
            (Some(e), _) => Err(e),
            (None, true) => Ok(Outcome::Again),
            (None, false) => Ok(Outcome::Done(done)),
        }
    }

    /// Routes a call until its routing holds still (at most [`ATTEMPTS`]
    /// times); the last try's failure is the caller's.
    fn routed<T>(
        &self,
        mut call: impl FnMut(&Routing) -> Result<Option<T>, Failure>,
    ) -> Result<T, Failure> {
        self.check_view();
        for _ in 0..ATTEMPTS {
            let r = self.routing();
            if let Some(v) = call(&r)? {
                return Ok(v);
            }
        }
        Err(Failure::Call(Error::Io(std::io::Error::new(
            std::io::ErrorKind::NotConnected,
            "the cluster's KV members kept changing or failing under the call",
        ))))
    }

    /// Which keys are stored, asking the second-ranked member of a key the
    /// first does not have.
    pub fn exists(&self, keys: &[Digest]) -> Result<Vec<bool>, Failure> {
        self.routed(|r| {
            let ranks = self.ranks(r, keys, false);
            let first: Vec<_> = ranks.iter().map(|x| x[0]).collect();
            let exists = |c: &mut BlockingKvClient, idx: &[usize]| {
                let d: Vec<Digest> = idx.iter().map(|i| keys[*i]).collect();
                c.exists(&d).map(|r| r.present)
            };
            let Outcome::Done(done) = self.fan_out(r, &first, 0, &exists)? else {
                return Ok(None);
            };
            let mut present = vec![false; keys.len()];
            scatter(&mut present, done, |p, hit, _| *p = hit);
            let second: Vec<_> = ranks
                .iter()
                .zip(&present)
                .map(|(x, p)| if *p { None } else { x[1] })
                .collect();
            if second.iter().any(Option::is_some) {
                if let Outcome::Done(done) = self.fan_out(r, &second, BATCH_FALLBACK, &exists)? {
                    scatter(&mut present, done, |p, hit, _| *p |= hit);
                }
            }
            Ok(Some(present))
        })
    }

    /// Reads whole values into the regions (held by the caller, writable,
    /// disjoint). Misses fall back to the second-ranked member; its hits
    /// are written back to the first, and hot blocks copied to the second.
    pub fn get_into(
        &self,
        keys: &[Digest],
        regions: &[Region],
        offsets: Option<&[u64]>,
    ) -> Result<Vec<GetOutcome>, Failure> {
        let get = |c: &mut BlockingKvClient, idx: &[usize]| {
            c.get_into(&mut get_requests(keys, regions, offsets, idx))
        };
        self.routed(|r| {
            let ranks = self.ranks(r, keys, true);
            let first: Vec<_> = ranks.iter().map(|x| x[0]).collect();
            let Outcome::Done(done) = self.fan_out(r, &first, 0, &get)? else {
                return Ok(None);
            };
            let miss = GetOutcome {
                status: Status::NotFound,
                len: 0,
                value_len: 0,
                hot: false,
            };
            let mut out = vec![miss; keys.len()];
            scatter(&mut out, done, |o, g, _| *o = g);
            let second: Vec<_> = ranks
                .iter()
                .zip(&out)
                .map(|(x, g)| (g.status == Status::NotFound).then_some(x[1]).flatten())
                .collect();
            let mut found_second = vec![false; keys.len()];
            if second.iter().any(Option::is_some) {
                let asked = second.iter().filter(|s| s.is_some()).count() as u64;
                self.counters
                    .fallback_gets
                    .fetch_add(asked, Ordering::Relaxed);
                if let Outcome::Done(done) = self.fan_out(r, &second, BATCH_FALLBACK, &get)? {
                    scatter(&mut out, done, |o, g, i| {
                        if g.status == Status::Ok {
                            found_second[i] = true;
                            self.counters.fallback_hits.fetch_add(1, Ordering::Relaxed);
                        }
                        *o = g;
                    });
                }
            }
            // Ranges are not whole values: nothing to copy from them.
            if offsets.is_none() {
                self.copy_where_needed(r, keys, regions, &ranks, &out, &found_second);
            }
            Ok(Some(out))
        })
    }

    /// Best effort after a get: a block found only at the second-ranked
    /// member is written back to the first; a block the first reports hot
    /// (and not yet known hot) is copied to the second.
    fn copy_where_needed(
        &self,
        r: &Routing,
        keys: &[Digest],
        regions: &[Region],
        ranks: &[[Option<usize>; 2]],
        out: &[GetOutcome],
        found_second: &[bool],
    ) {
        let mut to: Vec<Option<usize>> = vec![None; keys.len()];
        let mut newly_hot = Vec::new();
        {
            let hot = self.hot.lock().unwrap_or_else(|p| p.into_inner());
            for i in 0..keys.len() {
                if out[i].status != Status::Ok {
                    continue;
                }
                if found_second[i] {
                    to[i] = ranks[i][0];
                } else if out[i].hot && ranks[i][1].is_some() && !hot.contains(&keys[i]) {
                    to[i] = ranks[i][1];
                    newly_hot.push(i);
                }
            }
        }
        if to.iter().all(Option::is_none) {
            return;
        }
        let put = |c: &mut BlockingKvClient, idx: &[usize]| {
            // The get just filled the first `len` bytes of each region.
            c.put_from(&put_prefixes(keys, regions, idx, |i| out[i].len as usize))
        };
        // A copy that fails costs a later fallback, nothing more.
        if let Ok(Outcome::Done(done)) = self.fan_out(r, &to, BATCH_COPY, &put) {
            let stored = done
                .iter()
                .flat_map(|(_, s)| s.iter())
                .filter(|s| s.is_stored())
                .count() as u64;
            self.counters
                .copies_written
                .fetch_add(stored, Ordering::Relaxed);
        }
        if !newly_hot.is_empty() {
            self.counters
                .hot_copies
                .fetch_add(newly_hot.len() as u64, Ordering::Relaxed);
            let mut hot = self.hot.lock().unwrap_or_else(|p| p.into_inner());
            if hot.len() + newly_hot.len() > HOT_KEYS_MAX {
                hot.clear();
            }
            hot.extend(newly_hot.into_iter().map(|i| keys[i]));
        }
    }

    /// Closes every member's idle connections.
    pub fn close(&self) {
        for p in self
            .pools
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
        {
            p.close();
        }
    }

    /// Stores each value at its key's first-ranked member.
    pub fn put_from(&self, keys: &[Digest], regions: &[Region]) -> Result<Vec<Status>, Failure> {
        let put =
            |c: &mut BlockingKvClient, idx: &[usize]| c.put_from(&put_items(keys, regions, idx));
        self.statuses(keys, &put, false)
    }

    /// Stores parts of values at their keys' first-ranked members.
    pub fn put_parts(
        &self,
        keys: &[Digest],
        regions: &[Region],
        parts: &[Part],
    ) -> Result<Vec<Status>, Failure> {
        let put = |c: &mut BlockingKvClient, idx: &[usize]| {
            let p: Vec<Part> = idx.iter().map(|i| parts[*i]).collect();
            c.put_parts(&put_items(keys, regions, idx), &p)
        };
        self.statuses(keys, &put, false)
    }

    /// A per-key status call (touch, pin, unpin, delete) at each key's
    /// first-ranked member, and with `both` at the second too (a key may
    /// have a copy there): a key counts as `Ok` if either says so.
    pub fn statuses(
        &self,
        keys: &[Digest],
        f: &Share<'_, Vec<Status>>,
        both: bool,
    ) -> Result<Vec<Status>, Failure> {
        self.routed(|r| {
            let ranks = self.ranks(r, keys, false);
            let mut out = vec![Status::NotFound; keys.len()];
            for rank in 0..if both { 2 } else { 1 } {
                let which: Vec<_> = ranks.iter().map(|x| x[rank]).collect();
                let Outcome::Done(done) = self.fan_out(r, &which, 0, f)? else {
                    return Ok(None);
                };
                scatter(&mut out, done, |o, s, _| {
                    if rank == 0 || s == Status::Ok {
                        *o = s;
                    }
                });
            }
            Ok(Some(out))
        })
    }
}
