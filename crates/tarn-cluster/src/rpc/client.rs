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
    pub stats: ClientStats,
}

impl RpcClient {
    pub fn new(me: Identity, limits: ClientLimits) -> RpcClient {
        RpcClient {
            me,
            limits,
            pools: Mutex::default(),
            stats: ClientStats::default(),
        }
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
        let deadline = Instant::now() + timeout;
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
            _ => (
                self.connect(address, expect, channel, deadline).await?,
                false,
            ),
        };
        Ok(Call {
            conn: Some(conn),
            pool,
            _permit: permit,
            deadline,
            call_id: 0,
            op: 0,
            state: State::Idle,
            reused,
        })
    }

    async fn connect(
        &self,
        address: &str,
        expect: Option<&str>,
        channel: Channel,
        deadline: Instant,
    ) -> Result<Conn, RpcError> {
        let unreachable = |reason: String| RpcError::Unreachable {
            peer: address.to_string(),
            reason,
        };
        let stream = timeout_at(deadline, TcpStream::connect(address))
            .await
            .map_err(|_| unreachable("connect timed out".into()))?
            .map_err(|e| unreachable(e.to_string()))?;
        stream.set_nodelay(true)?;
        let hs_deadline = deadline.min(Instant::now() + HANDSHAKE_TIMEOUT);
        let conn = timeout_at(
            hs_deadline,
            client_handshake(Box::new(stream), &self.me, channel, address, expect),
        )
        .await
        .map_err(|_| unreachable("handshake timed out".into()))?;
        match conn {
            Ok(c) => {
                self.stats.connects.fetch_add(1, Ordering::Relaxed);
                Ok(c)
            }
            Err(e) => {
                if matches!(e, RpcError::Auth { .. }) {
                    self.stats.auth_failures.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(peer = %address, error = %e, "cluster RPC: authentication failed");
                }
                Err(e)
            }
        }
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Idle,
    SendingBody,
    AwaitResponse,
    ReadingBody,
    Done,
}

/// The longest one step of a call (a frame sent, an answer or a body frame
/// awaited) may take.
pub const STEP_MAX: std::time::Duration = std::time::Duration::from_secs(5);

/// One call on one connection. Every step ends by the call's deadline; a
/// call that fails mid-stream closes its connection, one that ends cleanly
/// gives it back to the pool (`finish`).
pub struct Call {
    conn: Option<Conn>,
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
    /// `STEP_MAX` from now if sooner. A peer that stops making progress (a
    /// paused process, a cut link) fails the call within seconds, whatever
    /// time a long transfer was given in all.
    fn step_deadline(&self) -> Instant {
        self.deadline.min(Instant::now() + STEP_MAX)
    }

    /// The connection of a call still open.
    fn conn(&mut self) -> Result<&mut Conn, RpcError> {
        self.conn.as_mut().ok_or(RpcError::Closed)
    }

    /// The outcome of one step bounded by the deadline: a failure that may
    /// have left the connection mid-frame closes it, and ends the call.
    fn settle<T>(
        &mut self,
        r: Result<Result<T, RpcError>, tokio::time::error::Elapsed>,
    ) -> Result<T, RpcError> {
        let r = r.unwrap_or(Err(RpcError::Deadline));
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
        self.settle(r.map(|w| w.map_err(RpcError::from)))?;
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
                Err(_) => RpcError::Deadline,
            };
            // The peer stopped reading this body: the connection is done.
            self.conn = None;
            self.state = State::Done;
            return Err(e);
        }
        let r = timeout_at(deadline, c.write_frame(h, data)).await;
        self.settle(r.map(|w| w.map_err(RpcError::from)))
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
        self.settle(r.map(|w| w.map_err(RpcError::from)))?;
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
        let r = self.settle(r)?;
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
        let more = self.settle(r)?;
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
