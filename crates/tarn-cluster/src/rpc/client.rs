//! The calling side: pools of authenticated connections per peer, channel
//! and core, and calls that hold one connection from request to last frame.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::{timeout_at, Instant};

use super::wire::{Channel, ErrorCode, Header, Kind};
use super::{client_handshake, BodyBuf, Conn, Identity, RpcError, HANDSHAKE_TIMEOUT};

/// How many connections one core keeps at most to one peer, per channel: a
/// call beyond that waits (within its deadline) for one to come free.
#[derive(Debug, Clone, Copy)]
pub struct ClientLimits {
    pub control_connections_max: usize,
    pub bulk_connections_max: usize,
}

impl Default for ClientLimits {
    fn default() -> Self {
        ClientLimits {
            control_connections_max: 32,
            bulk_connections_max: 64,
        }
    }
}

#[derive(Default, Debug)]
pub struct ClientStats {
    /// Connections opened (and authenticated).
    pub connects: AtomicU64,
    /// Connections whose peer failed the handshake.
    pub auth_failures: AtomicU64,
    /// Calls that ended in a deadline.
    pub deadlines: AtomicU64,
    /// Times a peer became suspect (it missed a deadline or could not be
    /// reached), and calls refused at once while one was.
    pub suspected: AtomicU64,
    pub fast_failures: AtomicU64,
    /// Deadlines missed while this node's own runtime ran late (a CPU
    /// stall here): no evidence against the peer.
    pub local_stalls: AtomicU64,
    /// Peers a missed deadline put in doubt, and those a probe then found
    /// answering (not made suspect).
    pub doubts: AtomicU64,
    pub doubts_cleared: AtomicU64,
}

/// How often a suspect peer is probed, and how long a probe may take.
pub const PROBE_INTERVAL: Duration = Duration::from_millis(250);
pub const PROBE_DEADLINE: Duration = Duration::from_secs(1);
/// How long the probe of a peer in doubt (one that missed one deadline)
/// may take before the peer is suspect: with the control step (1 s), a
/// silent peer is routed around within 2 s of the call that found it.
pub const DOUBT_PROBE_DEADLINE: Duration = Duration::from_millis(750);
/// A timer that fires this late, or a runtime heartbeat that wakes this
/// late, says this node itself stalled (its cores busy, the host loaded):
/// deadlines missed then, and for `LOCAL_STALL_SHADOW` after, are not held
/// against peers.
pub const LOCAL_STALL: Duration = Duration::from_millis(250);
pub const LOCAL_STALL_SHADOW: Duration = Duration::from_secs(2);
const HEARTBEAT: Duration = Duration::from_millis(100);

thread_local! {
    /// When this thread's runtime (one core of this node) was last seen
    /// running late: calls and probes are made and timed on the runtime of
    /// the thread that makes them.
    static LAST_LOCAL_STALL: std::cell::Cell<Option<std::time::Instant>> =
        const { std::cell::Cell::new(None) };
}

fn note_local_stall() {
    LAST_LOCAL_STALL.with(|c| c.set(Some(std::time::Instant::now())));
}

/// Whether this thread's runtime stalled within `LOCAL_STALL_SHADOW`.
fn stalled_recently() -> bool {
    LAST_LOCAL_STALL.with(|c| c.get().is_some_and(|t| t.elapsed() < LOCAL_STALL_SHADOW))
}

thread_local! {
    static HEARTBEAT_RUNS: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Starts, once per thread with a runtime, a task that notes when that
/// runtime wakes it late (a stall of this node, not of its peers).
fn ensure_heartbeat() {
    if HEARTBEAT_RUNS.with(|b| b.replace(true)) {
        return;
    }
    let Ok(rt) = tokio::runtime::Handle::try_current() else {
        HEARTBEAT_RUNS.with(|b| b.set(false));
        return;
    };
    rt.spawn(async {
        loop {
            let t = Instant::now();
            tokio::time::sleep(HEARTBEAT).await;
            if t.elapsed() > HEARTBEAT + LOCAL_STALL {
                note_local_stall();
            }
        }
    });
}

/// The longest one step of a call (a frame sent, an answer or a body frame
/// awaited) may take, by channel: a peer that stops making progress (a
/// paused process, a cut link) fails the call within this, and is suspect
/// from then on (`Peer`).
pub const CONTROL_STEP_MAX: Duration = Duration::from_secs(1);
pub const BULK_STEP_MAX: Duration = Duration::from_secs(2);

fn step_max(channel: Channel) -> Duration {
    match channel {
        Channel::Control => CONTROL_STEP_MAX,
        Channel::Bulk => BULK_STEP_MAX,
    }
}

/// What this client knows of one peer's health, a circuit breaker: a peer
/// that cannot be reached is suspect at once, without asking etcd, and
/// calls to it fail at once instead of waiting out their deadlines, until
/// a probe (a fresh connection and a ping, every `PROBE_INTERVAL`) is
/// answered. A peer that misses a deadline is only in doubt: it is probed
/// at once and suspect if the probe fails too. One late answer (a CPU
/// stall of a loaded host) took every peer out of every node's view at
/// once before: 54 requests answered 503 with no fault anywhere. A
/// deadline missed while this node itself stalled is held against nobody.
struct Peer {
    address: String,
    me: Identity,
    stats: Arc<ClientStats>,
    health: Mutex<Health>,
}

#[derive(Default)]
struct Health {
    /// Since when, and why.
    suspect: Option<(std::time::Instant, String)>,
    /// A missed deadline not confirmed by a probe yet: since when, and why.
    doubt: Option<(std::time::Instant, String)>,
    /// When a probe last began a try (None: no probe runs).
    probed: Option<std::time::Instant>,
    /// The node id last expected at the address (the probe checks it).
    expect: Option<String>,
}

/// A suspect peer as `RpcClient::suspects` reports it.
#[derive(Debug, Clone)]
pub struct Suspect {
    pub address: String,
    pub node: Option<String>,
    pub since: std::time::Instant,
    pub reason: String,
}

impl Peer {
    /// Refuses a call at once while the peer is suspect.
    fn check(self: &Arc<Self>, expect: Option<&str>) -> Result<(), RpcError> {
        let mut h = self.health.lock().expect("peer health");
        if let Some(id) = expect {
            if h.expect.as_deref() != Some(id) {
                h.expect = Some(id.to_string());
            }
        }
        let Some((since, reason)) = &h.suspect else {
            return Ok(());
        };
        let e = RpcError::Unreachable {
            peer: self.address.clone(),
            reason: format!(
                "suspect for {} ms ({reason}): not called until it answers a probe",
                since.elapsed().as_millis()
            ),
        };
        self.stats.fast_failures.fetch_add(1, Ordering::Relaxed);
        self.ensure_probe(&mut h);
        Err(e)
    }

    /// Marks the peer suspect (once) and starts probing it.
    fn suspect(self: &Arc<Self>, reason: &str) {
        let mut h = self.health.lock().expect("peer health");
        if h.suspect.is_none() {
            h.suspect = Some((std::time::Instant::now(), reason.to_string()));
            self.stats.suspected.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(peer = %self.address, %reason, "peer suspect: routed around until it answers a probe");
        }
        self.ensure_probe(&mut h);
    }

    /// A call to the peer missed `deadline`: unless this node was the one
    /// that stalled, the peer is in doubt and probed now; it is suspect
    /// only if the probe fails too.
    fn missed(self: &Arc<Self>, deadline: Instant) {
        if Instant::now().saturating_duration_since(deadline) >= LOCAL_STALL {
            note_local_stall();
        }
        if stalled_recently() {
            self.stats.local_stalls.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut h = self.health.lock().expect("peer health");
        if h.suspect.is_some() || h.doubt.is_some() {
            return;
        }
        h.doubt = Some((
            std::time::Instant::now(),
            "a call missed its deadline".into(),
        ));
        self.stats.doubts.fetch_add(1, Ordering::Relaxed);
        tracing::info!(peer = %self.address, "a call to the peer missed its deadline: probing it");
        // A probe already running for an older doubt goes on; else one now.
        self.ensure_probe(&mut h);
    }

    /// Starts a probe on the current runtime unless one is running (one
    /// whose runtime went away, silent for long, is replaced).
    fn ensure_probe(self: &Arc<Self>, h: &mut Health) {
        let alive = h
            .probed
            .is_some_and(|t| t.elapsed() < PROBE_INTERVAL + PROBE_DEADLINE * 2);
        if alive {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            // No runtime to probe from: the next call is the probe.
            h.suspect = None;
            return;
        };
        h.probed = Some(std::time::Instant::now());
        rt.spawn(self.clone().probe());
    }

    /// Probes until the peer answers a ping on a fresh connection: at once
    /// for a peer in doubt, every `PROBE_INTERVAL` for a suspect one.
    async fn probe(self: Arc<Self>) {
        loop {
            let (expect, in_doubt) = {
                let mut h = self.health.lock().expect("peer health");
                h.probed = Some(std::time::Instant::now());
                (h.expect.clone(), h.doubt.is_some() && h.suspect.is_none())
            };
            if !in_doubt {
                tokio::time::sleep(PROBE_INTERVAL).await;
            }
            let deadline = Instant::now()
                + if in_doubt {
                    DOUBT_PROBE_DEADLINE
                } else {
                    PROBE_DEADLINE
                };
            let r = async {
                let mut conn = connect(
                    &self.me,
                    &self.stats,
                    &self.address,
                    expect.as_deref(),
                    Channel::Control,
                    deadline,
                )
                .await?;
                let call_id = CALL_IDS.fetch_add(1, Ordering::Relaxed);
                let h = Header::new(Kind::Request, super::wire::op::PING, call_id, 0, 1000);
                timeout_at(deadline, conn.write_frame(h, b"probe"))
                    .await
                    .map_err(|_| RpcError::Deadline)??;
                timeout_at(
                    deadline,
                    read_response(&mut conn, call_id, super::wire::op::PING),
                )
                .await
                .map_err(|_| RpcError::Deadline)?
            }
            .await;
            let mut h = self.health.lock().expect("peer health");
            match r {
                // Any answer, an epoch refusal included, shows it is alive.
                Ok(_)
                | Err(
                    RpcError::StaleEpoch { .. }
                    | RpcError::EpochAhead { .. }
                    | RpcError::Remote { .. },
                ) => {
                    if let Some((since, _)) = h.suspect.take() {
                        tracing::info!(peer = %self.address, suspect_ms = since.elapsed().as_millis() as u64, "peer answers again");
                    } else if h.doubt.is_some() {
                        self.stats.doubts_cleared.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(peer = %self.address, "the peer answers its probe: not routed around");
                    }
                    h.doubt = None;
                    h.probed = None;
                    return;
                }
                Err(e) => {
                    if let Some((_, reason)) = &mut h.suspect {
                        *reason = e.to_string();
                    } else if let Some((since, why)) = h.doubt.clone() {
                        if Instant::now().saturating_duration_since(deadline) >= LOCAL_STALL {
                            note_local_stall();
                        }
                        if stalled_recently() {
                            // This node stalled: the probe says nothing of
                            // the peer; it is tried again.
                            self.stats.local_stalls.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                        h.doubt = None;
                        h.suspect = Some((since, format!("{why}, and a probe failed: {e}")));
                        self.stats.suspected.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(peer = %self.address, error = %e, "peer suspect: missed a deadline and its probe; routed around until it answers one");
                    }
                }
            }
        }
    }
}

/// Connections are registered with the runtime of the thread that opened
/// them: a core's calls use its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Owner {
    Core(usize),
    Thread(std::thread::ThreadId),
}

fn owner() -> Owner {
    match tarn_io::runtime::core_id() {
        Some(c) => Owner::Core(c),
        None => Owner::Thread(std::thread::current().id()),
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PoolKey {
    address: String,
    channel: Channel,
    owner: Owner,
}

struct Pool {
    idle: Mutex<Vec<Conn>>,
    permits: Arc<Semaphore>,
}

pub struct RpcClient {
    me: Identity,
    limits: ClientLimits,
    pools: Mutex<HashMap<PoolKey, Arc<Pool>>>,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    pub stats: Arc<ClientStats>,
}

impl RpcClient {
    pub fn new(me: Identity, limits: ClientLimits) -> RpcClient {
        RpcClient {
            me,
            limits,
            pools: Mutex::default(),
            peers: Mutex::default(),
            stats: Arc::default(),
        }
    }

    fn peer(&self, address: &str) -> Arc<Peer> {
        self.peers
            .lock()
            .expect("rpc peers")
            .entry(address.to_string())
            .or_insert_with(|| {
                Arc::new(Peer {
                    address: address.to_string(),
                    me: self.me.clone(),
                    stats: self.stats.clone(),
                    health: Mutex::default(),
                })
            })
            .clone()
    }

    /// The peers suspect now, and since when.
    pub fn suspects(&self) -> Vec<Suspect> {
        let peers = self.peers.lock().expect("rpc peers");
        let mut out: Vec<Suspect> = peers
            .values()
            .filter_map(|p| {
                let h = p.health.lock().expect("peer health");
                let (since, reason) = h.suspect.clone()?;
                Some(Suspect {
                    address: p.address.clone(),
                    node: h.expect.clone(),
                    since,
                    reason,
                })
            })
            .collect();
        out.sort_by(|a, b| a.address.cmp(&b.address));
        out
    }

    /// Whether calls to `address` fail at once now (it is suspect).
    pub fn is_suspect(&self, address: &str) -> bool {
        self.peers
            .lock()
            .expect("rpc peers")
            .get(address)
            .is_some_and(|p| p.health.lock().expect("peer health").suspect.is_some())
    }

    pub fn identity(&self) -> &Identity {
        &self.me
    }

    fn pool(&self, address: &str, channel: Channel) -> Arc<Pool> {
        let key = PoolKey {
            address: address.to_string(),
            channel,
            owner: owner(),
        };
        let max = match channel {
            Channel::Control => self.limits.control_connections_max,
            Channel::Bulk => self.limits.bulk_connections_max,
        };
        self.pools
            .lock()
            .expect("rpc pools")
            .entry(key)
            .or_insert_with(|| {
                Arc::new(Pool {
                    idle: Mutex::default(),
                    permits: Arc::new(Semaphore::new(max.max(1))),
                })
            })
            .clone()
    }

    /// Drops every idle connection to `address` (its node restarted or was
    /// replaced): the next call connects afresh.
    pub fn forget(&self, address: &str) {
        for (k, p) in self.pools.lock().expect("rpc pools").iter() {
            if k.address == address {
                p.idle.lock().expect("rpc idle").clear();
            }
        }
    }

    /// Takes a connection to the node `expect` (when named) at `address`
    /// for one call that must end within `timeout`.
    pub async fn open(
        &self,
        address: &str,
        expect: Option<&str>,
        channel: Channel,
        timeout: Duration,
    ) -> Result<Call, RpcError> {
        ensure_heartbeat();
        let deadline = Instant::now() + timeout;
        let peer = self.peer(address);
        peer.check(expect)?;
        let pool = self.pool(address, channel);
        let permit = timeout_at(deadline, pool.permits.clone().acquire_owned())
            .await
            .map_err(|_| self.deadline())?
            .expect("pool semaphores are never closed");
        // An idle connection with something to read has been closed by its
        // peer (a restart, an idle timeout): it is dropped, not reused.
        let idle = loop {
            let Some(mut c) = pool.idle.lock().expect("rpc idle").pop() else {
                break None;
            };
            if !c.has_pending_input() {
                break Some(c);
            }
        };
        let (conn, reused) = match idle {
            Some(c) if expect.is_none_or(|id| id == c.peer_id) => (c, true),
            _ => {
                // Connecting is one step: a peer that accepts but never
                // answers (a paused process) fails it within the step limit.
                let step = deadline.min(Instant::now() + step_max(channel));
                let c = connect(&self.me, &self.stats, address, expect, channel, step).await;
                match c {
                    Ok(c) => (c, false),
                    Err(e) => {
                        if let RpcError::Unreachable { reason, .. } = &e {
                            // A refusal proves the peer away; a connection
                            // or handshake that took too long is a missed
                            // deadline like any other.
                            if reason.ends_with("timed out") {
                                peer.missed(step);
                            } else {
                                peer.suspect(reason);
                            }
                        }
                        return Err(e);
                    }
                }
            }
        };
        Ok(Call {
            conn: Some(conn),
            step: step_max(channel),
            peer,
            pool,
            _permit: permit,
            deadline,
            call_id: 0,
            op: 0,
            state: State::Idle,
            reused,
        })
    }

    fn deadline(&self) -> RpcError {
        self.stats.deadlines.fetch_add(1, Ordering::Relaxed);
        RpcError::Deadline
    }

    /// One control call without bodies: request, response payload. A reused
    /// connection the peer had closed meanwhile (it restarted) is replaced
    /// once, transparently: the request never reached it.
    pub async fn call(
        &self,
        address: &str,
        expect: Option<&str>,
        op: u16,
        epoch: u64,
        payload: &[u8],
        timeout: Duration,
    ) -> Result<Vec<u8>, RpcError> {
        let deadline = Instant::now() + timeout;
        for attempt in 0..2 {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut call = self.open(address, expect, Channel::Control, left).await?;
            let reused = call.reused;
            let r = async {
                call.request(op, epoch, payload, false).await?;
                call.response().await
            }
            .await;
            match r {
                Ok((body, false)) => {
                    call.finish();
                    return Ok(body);
                }
                Ok((_, true)) => {
                    return Err(RpcError::Protocol(
                        "a response body to a call that expects none".into(),
                    ))
                }
                Err(RpcError::Closed) if reused && attempt == 0 => continue,
                Err(RpcError::Deadline) => return Err(self.deadline()),
                Err(e) => {
                    call.finish();
                    return Err(e);
                }
            }
        }
        Err(RpcError::Closed)
    }
}

/// A new authenticated connection to the node `expect` (when named) at
/// `address`, by `deadline`.
async fn connect(
    me: &Identity,
    stats: &ClientStats,
    address: &str,
    expect: Option<&str>,
    channel: Channel,
    deadline: Instant,
) -> Result<Conn, RpcError> {
    let unreachable = |reason: String| RpcError::Unreachable {
        peer: address.to_string(),
        reason,
    };
    // Twice at most: an older peer refuses the newest version with the one
    // it speaks, and the second connection offers that.
    let mut conn = Err(RpcError::Closed);
    for _ in 0..2 {
        let stream = timeout_at(deadline, TcpStream::connect(address))
            .await
            .map_err(|_| unreachable("connect timed out".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
        stream.set_nodelay(true)?;
        let hs_deadline = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
        let io: super::BoxStream = match &me.tls {
            None => Box::new(stream),
            Some(tls) => {
                let name = tarn_io::tls::server_name(address).map_err(unreachable)?;
                let tls = timeout_at(hs_deadline, tls.connector.connect(name, stream))
                    .await
                    .map_err(|_| unreachable("TLS handshake timed out".into()))?
                    .map_err(|e| {
                        stats.auth_failures.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(peer = %address, error = %e, "cluster RPC: TLS handshake failed");
                        unreachable(format!("TLS: {e}"))
                    })?;
                Box::new(tls)
            }
        };
        conn = timeout_at(
            hs_deadline,
            client_handshake(io, me, channel, address, expect),
        )
        .await
        .map_err(|_| unreachable("handshake timed out".into()))?;
        match &conn {
            Err(RpcError::VersionRetry { version }) => {
                tracing::info!(peer = %address, version, "cluster RPC: an older node; speaking its protocol version");
            }
            _ => break,
        }
    }
    match conn {
        Ok(c) => {
            stats.connects.fetch_add(1, Ordering::Relaxed);
            Ok(c)
        }
        Err(e) => {
            if matches!(e, RpcError::Auth { .. }) {
                stats.auth_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(peer = %address, error = %e, "cluster RPC: authentication failed");
            }
            Err(e)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    SendingBody,
    AwaitResponse,
    ReadingBody,
    Done,
}

/// One call on one connection. Every step ends by the call's deadline; a
/// call that fails mid-stream closes its connection, one that ends cleanly
/// gives it back to the pool (`finish`).
pub struct Call {
    conn: Option<Conn>,
    peer: Arc<Peer>,
    /// The longest one step may take (by channel).
    step: Duration,
    pool: Arc<Pool>,
    _permit: OwnedSemaphorePermit,
    deadline: Instant,
    call_id: u64,
    op: u16,
    state: State,
    reused: bool,
}

static CALL_IDS: AtomicU64 = AtomicU64::new(1);

impl Call {
    /// The authenticated peer's node id.
    pub fn peer_id(&self) -> &str {
        self.conn.as_ref().map(|c| c.peer_id.as_str()).unwrap_or("")
    }

    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// When the step under way must have ended: the call's deadline, or
    /// the channel's step limit from now if sooner. A peer that stops making
    /// progress (a paused process, a cut link) fails the call within a
    /// second or two, whatever time a long transfer was given in all, and
    /// is suspect from then on.
    fn step_deadline(&self) -> Instant {
        self.deadline.min(Instant::now() + self.step)
    }

    /// The connection of a call still open.
    fn conn(&mut self) -> Result<&mut Conn, RpcError> {
        self.conn.as_mut().ok_or(RpcError::Closed)
    }

    /// The outcome of one step bounded by the deadline: a failure that may
    /// have left the connection mid-frame closes it, and ends the call.
    fn settle<T>(
        &mut self,
        deadline: Instant,
        r: Result<Result<T, RpcError>, tokio::time::error::Elapsed>,
    ) -> Result<T, RpcError> {
        let r = r.unwrap_or_else(|_| {
            self.peer.missed(deadline);
            Err(RpcError::Deadline)
        });
        if let Err(e) = &r {
            if e.poisons_connection() {
                self.conn = None;
            }
            self.state = State::Done;
        }
        r
    }

    /// Sends the request; with `body`, data frames and `end_body` follow.
    pub async fn request(
        &mut self,
        op: u16,
        epoch: u64,
        payload: &[u8],
        body: bool,
    ) -> Result<(), RpcError> {
        if self.state != State::Idle {
            return Err(RpcError::Protocol("one request per call".into()));
        }
        self.call_id = CALL_IDS.fetch_add(1, Ordering::Relaxed);
        self.op = op;
        let left_ms = self
            .deadline
            .saturating_duration_since(Instant::now())
            .as_millis()
            .clamp(1, u32::MAX as u128) as u32;
        let h = Header::new(Kind::Request, op, self.call_id, epoch, left_ms).with_body(body);
        let deadline = self.step_deadline();
        let c = self.conn()?;
        let r = timeout_at(deadline, c.write_frame(h, payload)).await;
        self.settle(deadline, r.map(|w| w.map_err(RpcError::from)))?;
        self.state = if body {
            State::SendingBody
        } else {
            State::AwaitResponse
        };
        Ok(())
    }

    /// Sends one piece of the request body. An answer that came early (the
    /// peer failed and stopped reading) is returned as that error.
    pub async fn send_data(&mut self, data: &[u8]) -> Result<(), RpcError> {
        if self.state != State::SendingBody {
            return Err(RpcError::Protocol("no request body open".into()));
        }
        let h = Header::new(Kind::Data, self.op, self.call_id, 0, 0);
        let (deadline, call_id, op) = (self.step_deadline(), self.call_id, self.op);
        let c = self.conn()?;
        if c.has_pending_input() {
            let e = match timeout_at(deadline, early_answer(c, call_id, op)).await {
                Ok(e) => e,
                Err(_) => {
                    self.peer.missed(deadline);
                    RpcError::Deadline
                }
            };
            // The peer stopped reading this body: the connection is done.
            self.conn = None;
            self.state = State::Done;
            return Err(e);
        }
        let r = timeout_at(deadline, c.write_frame(h, data)).await;
        self.settle(deadline, r.map(|w| w.map_err(RpcError::from)))
    }

    /// Ends the request body with an end frame carrying `payload`.
    pub async fn end_body(&mut self, payload: &[u8]) -> Result<(), RpcError> {
        if self.state != State::SendingBody {
            return Err(RpcError::Protocol("no request body open".into()));
        }
        let h = Header::new(Kind::End, self.op, self.call_id, 0, 0);
        let deadline = self.step_deadline();
        let c = self.conn()?;
        let r = timeout_at(deadline, c.write_frame(h, payload)).await;
        self.settle(deadline, r.map(|w| w.map_err(RpcError::from)))?;
        self.state = State::AwaitResponse;
        Ok(())
    }

    /// The response: its payload, and whether a body follows (`next_data`).
    pub async fn response(&mut self) -> Result<(Vec<u8>, bool), RpcError> {
        if self.state != State::AwaitResponse {
            return Err(RpcError::Protocol("no response awaited".into()));
        }
        let (deadline, call_id, op) = (self.step_deadline(), self.call_id, self.op);
        let c = self.conn()?;
        let r = timeout_at(deadline, read_response(c, call_id, op)).await;
        let r = self.settle(deadline, r)?;
        self.state = if r.1 { State::ReadingBody } else { State::Done };
        Ok(r)
    }

    /// The next piece of the response body, read into `buf` (resized to
    /// it); false at the body's end, whose payload is then in `buf`.
    pub async fn next_data(&mut self, buf: &mut impl BodyBuf) -> Result<bool, RpcError> {
        if self.state != State::ReadingBody {
            return Err(RpcError::Protocol("no response body open".into()));
        }
        let (deadline, call_id, op) = (self.step_deadline(), self.call_id, self.op);
        let c = self.conn()?;
        let r = timeout_at(deadline, read_body_frame(c, call_id, op, buf)).await;
        let more = self.settle(deadline, r)?;
        if !more {
            self.state = State::Done;
        }
        Ok(more)
    }

    /// Ends the call: a connection that finished cleanly goes back to the
    /// pool for the next call, any other is closed.
    pub fn finish(mut self) {
        if self.state == State::Done {
            if let Some(c) = self.conn.take() {
                self.pool.idle.lock().expect("rpc idle").push(c);
            }
        }
    }
}

async fn next_frame(c: &mut Conn, call_id: u64, op: u16) -> Result<Header, RpcError> {
    let h = c.read_header().await?.ok_or(RpcError::Closed)?;
    if h.call != call_id || h.op != op {
        return Err(RpcError::Protocol(format!(
            "frame of call {} op {} while in call {call_id} op {op}",
            h.call, h.op
        )));
    }
    Ok(h)
}

async fn read_response(c: &mut Conn, call_id: u64, op: u16) -> Result<(Vec<u8>, bool), RpcError> {
    let h = next_frame(c, call_id, op).await?;
    match h.kind {
        Kind::Response => Ok((c.read_payload(&h).await?, h.has_body())),
        Kind::Error => Err(error_frame(c, &h).await),
        k => Err(RpcError::Protocol(format!(
            "{k:?} frame instead of a response"
        ))),
    }
}

async fn read_body_frame(
    c: &mut Conn,
    call_id: u64,
    op: u16,
    buf: &mut impl BodyBuf,
) -> Result<bool, RpcError> {
    let h = next_frame(c, call_id, op).await?;
    match h.kind {
        Kind::Data | Kind::End => {
            c.read_payload_into(&h, buf.frame(h.len as usize)).await?;
            Ok(h.kind == Kind::Data)
        }
        Kind::Error => Err(error_frame(c, &h).await),
        k => Err(RpcError::Protocol(format!(
            "{k:?} frame in a response body"
        ))),
    }
}

/// Reads what the peer sent while we were still sending.
async fn early_answer(c: &mut Conn, call_id: u64, op: u16) -> RpcError {
    match next_frame(c, call_id, op).await {
        Ok(h) if h.kind == Kind::Error => error_frame(c, &h).await,
        Ok(h) => RpcError::Protocol(format!("{:?} frame before the request body ended", h.kind)),
        Err(e) => e,
    }
}

/// The error an error frame carries.
async fn error_frame(c: &mut Conn, h: &Header) -> RpcError {
    let message = match c.read_payload(h).await {
        Ok(p) => String::from_utf8_lossy(&p).into_owned(),
        Err(e) => return e,
    };
    match ErrorCode::from_u32(h.aux) {
        Some(ErrorCode::StaleEpoch) => RpcError::StaleEpoch {
            peer_epoch: h.epoch,
        },
        Some(ErrorCode::EpochAhead) => RpcError::EpochAhead {
            peer_epoch: h.epoch,
        },
        Some(ErrorCode::Deadline) => RpcError::Deadline,
        Some(code) => RpcError::Remote { code, message },
        None => RpcError::Protocol(format!("unknown error code {}: {message}", h.aux)),
    }
}
