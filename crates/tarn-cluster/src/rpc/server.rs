//! The answering side: accepts connections, authenticates them, checks each
//! request's frame, epoch and deadline, and hands it to the node's handler.
//! Bad input from a peer gets an error frame (when the connection can still
//! carry one) and a log line, and closes the connection; it never panics
//! and never reaches the handler.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::time::{timeout, timeout_at, Instant};

use super::wire::{ErrorCode, Header, Kind};
use super::{server_handshake, BodyBuf, BoxStream, Conn, Identity, RpcError, HANDSHAKE_TIMEOUT};

/// An authenticated connection with no call for this long is closed (pools
/// reconnect on demand).
pub const IDLE_MAX: Duration = Duration::from_secs(300);
/// The longest deadline a request may ask for.
pub const CALL_MAX: Duration = Duration::from_secs(600);
/// A frame's payload must arrive within this once its header has.
const FRAME_READ_MAX: Duration = Duration::from_secs(30);

/// At most this much before a caller's deadline, the call is answered with
/// a deadline error.
const ANSWER_MARGIN: Duration = Duration::from_millis(50);

/// How long a request of a newer map epoch waits for this node's map to
/// catch up before it is refused, and how often it looks.
pub const EPOCH_CATCH_UP: Duration = Duration::from_millis(500);
pub const EPOCH_POLL: Duration = Duration::from_millis(5);

/// Serves the node's side of calls.
pub trait Handler: Send + Sync + 'static {
    /// The epoch of this node's current cluster map.
    fn epoch(&self) -> u64;

    /// A request carried a newer epoch than ours: reload the map.
    fn epoch_ahead(&self, _epoch: u64) {}

    /// Waits (briefly) before a request's epoch is judged: a node opening
    /// its map a moment after its peers answers them once it has.
    fn ready(&self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Serves one call: reads its request body if it has one, and replies
    /// (`reply`, or `reply_body` then data and `end_body`).
    fn handle(
        &self,
        call: &mut ServerCall<'_>,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// The operation failed; the peer gets this message in an error frame.
    #[error("{0}")]
    Failed(String),
    #[error("unknown operation {0}")]
    UnknownOp(u16),
    /// The request did not decode.
    #[error("malformed request: {0}")]
    Malformed(String),
    /// The connection broke: nothing more can be sent on it.
    #[error(transparent)]
    Rpc(#[from] RpcError),
}

impl From<super::wire::WireError> for HandlerError {
    fn from(e: super::wire::WireError) -> Self {
        HandlerError::Malformed(e.to_string())
    }
}

#[derive(Default, Debug)]
pub struct ServerStats {
    pub connections: AtomicU64,
    pub auth_failures: AtomicU64,
    pub protocol_errors: AtomicU64,
    pub stale_epochs: AtomicU64,
    pub calls: AtomicU64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Body {
    None,
    Open,
    Ended,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reply {
    None,
    Body,
    Done,
}

/// One call being served.
pub struct ServerCall<'c> {
    conn: &'c mut Conn,
    pub op: u16,
    /// The caller's map epoch (equal to ours: others never get here).
    pub epoch: u64,
    pub payload: Vec<u8>,
    pub deadline: Instant,
    call_id: u64,
    body: Body,
    reply: Reply,
}

impl ServerCall<'_> {
    /// The authenticated caller's node id.
    pub fn peer_id(&self) -> &str {
        &self.conn.peer_id
    }

    pub fn has_body(&self) -> bool {
        self.body != Body::None
    }

    /// The next piece of the request body, read into `buf` (resized to it);
    /// false at its end, whose payload is then in `buf`.
    pub async fn next_data(&mut self, buf: &mut impl BodyBuf) -> Result<bool, RpcError> {
        if self.body != Body::Open {
            return Err(RpcError::Protocol("no request body open".into()));
        }
        let h = self.conn.read_header().await?.ok_or(RpcError::Closed)?;
        if h.call != self.call_id || h.op != self.op {
            return Err(RpcError::Protocol(format!(
                "frame of call {} in call {}",
                h.call, self.call_id
            )));
        }
        match h.kind {
            Kind::Data | Kind::End => {
                let frame = buf.frame(h.len as usize);
                timeout(FRAME_READ_MAX, self.conn.read_payload_into(&h, frame))
                    .await
                    .map_err(|_| RpcError::Deadline)??;
                if h.kind == Kind::End {
                    self.body = Body::Ended;
                }
                Ok(h.kind == Kind::Data)
            }
            k => Err(RpcError::Protocol(format!("{k:?} frame in a request body"))),
        }
    }

    fn header(&self, kind: Kind) -> Header {
        Header::new(kind, self.op, self.call_id, 0, 0)
    }

    /// The result, with no body.
    pub async fn reply(&mut self, payload: &[u8]) -> Result<(), RpcError> {
        if self.reply != Reply::None {
            return Err(RpcError::Protocol("replied twice".into()));
        }
        self.reply = Reply::Done;
        let h = self.header(Kind::Response);
        Ok(self.conn.write_frame(h, payload).await?)
    }

    /// The result, with a body of data frames ended by `end_body`.
    pub async fn reply_body(&mut self, payload: &[u8]) -> Result<(), RpcError> {
        if self.reply != Reply::None {
            return Err(RpcError::Protocol("replied twice".into()));
        }
        self.reply = Reply::Body;
        let h = self.header(Kind::Response).with_body(true);
        Ok(self.conn.write_frame(h, payload).await?)
    }

    pub async fn send_data(&mut self, data: &[u8]) -> Result<(), RpcError> {
        if self.reply != Reply::Body {
            return Err(RpcError::Protocol("no response body open".into()));
        }
        let h = self.header(Kind::Data);
        Ok(self.conn.write_frame(h, data).await?)
    }

    pub async fn end_body(&mut self, payload: &[u8]) -> Result<(), RpcError> {
        if self.reply != Reply::Body {
            return Err(RpcError::Protocol("no response body open".into()));
        }
        self.reply = Reply::Done;
        let h = self.header(Kind::End);
        Ok(self.conn.write_frame(h, payload).await?)
    }
}

async fn send_error(
    conn: &mut Conn,
    h: &Header,
    code: ErrorCode,
    epoch: u64,
    message: &str,
) -> std::io::Result<()> {
    let e = Header::new(Kind::Error, h.op, h.call, epoch, code as u32);
    conn.write_frame(e, message.as_bytes()).await
}

/// Accepts connections until `shutdown` turns true; each is served on its
/// own task.
pub async fn serve<H: Handler>(
    listener: TcpListener,
    me: Identity,
    handler: Arc<H>,
    stats: Arc<ServerStats>,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, remote) = match accepted {
                    Ok(a) => a,
                    Err(error) => {
                        tracing::warn!(%error, "cluster RPC: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let (me, handler, stats) = (me.clone(), handler.clone(), stats.clone());
                tokio::spawn(async move {
                    let io: BoxStream = match &me.tls {
                        None => Box::new(stream),
                        Some(tls) => match timeout(HANDSHAKE_TIMEOUT, tls.acceptor.accept(stream)).await {
                            Ok(Ok(s)) => Box::new(s),
                            Ok(Err(error)) => {
                                stats.auth_failures.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(%remote, %error, "cluster RPC: TLS handshake refused");
                                return;
                            }
                            Err(_) => {
                                stats.auth_failures.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(%remote, "cluster RPC: TLS handshake timed out");
                                return;
                            }
                        },
                    };
                    serve_connection(io, &remote.to_string(), &me, &*handler, &stats).await;
                });
            }
            _ = shutdown.changed() => {
                if *shutdown.borrow() {
                    return;
                }
            }
        }
    }
}

/// Serves one connection from its handshake to its end.
pub async fn serve_connection<H: Handler>(
    io: BoxStream,
    remote: &str,
    me: &Identity,
    handler: &H,
    stats: &ServerStats,
) {
    let mut conn = match timeout(HANDSHAKE_TIMEOUT, server_handshake(io, me)).await {
        Ok(Ok(c)) => c,
        Ok(Err(RpcError::Closed)) => return,
        Ok(Err(error)) => {
            stats.auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%remote, %error, "cluster RPC: connection refused");
            return;
        }
        Err(_) => {
            stats.auth_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%remote, "cluster RPC: handshake timed out");
            return;
        }
    };
    stats.connections.fetch_add(1, Ordering::Relaxed);
    let peer = conn.peer_id.clone();
    let bad = |stats: &ServerStats, error: &dyn std::fmt::Display| {
        stats.protocol_errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(%remote, %peer, %error, "cluster RPC: bad input from a peer; connection closed");
    };
    loop {
        let h = match timeout(IDLE_MAX, conn.read_header()).await {
            Err(_) | Ok(Ok(None)) | Ok(Err(RpcError::Closed)) => return,
            Ok(Err(RpcError::Io(_))) => return,
            Ok(Err(error)) => {
                bad(stats, &error);
                // The header did not decode: there is no call to answer.
                let h = Header::new(Kind::Error, 0, 0, 0, 0);
                let _ = send_error(&mut conn, &h, ErrorCode::Protocol, 0, &error.to_string()).await;
                return;
            }
            Ok(Ok(Some(h))) => h,
        };
        if h.kind != Kind::Request {
            let error = format!("{:?} frame where a request was expected", h.kind);
            bad(stats, &error);
            let _ = send_error(&mut conn, &h, ErrorCode::Protocol, 0, &error).await;
            return;
        }
        let payload = match timeout(FRAME_READ_MAX, conn.read_payload(&h)).await {
            Ok(Ok(p)) => p,
            Ok(Err(RpcError::Closed)) | Ok(Err(RpcError::Io(_))) => return,
            Ok(Err(error)) => {
                bad(stats, &error);
                let _ = send_error(&mut conn, &h, ErrorCode::Protocol, 0, &error.to_string()).await;
                return;
            }
            Err(_) => {
                bad(stats, &"request payload did not arrive in time");
                return;
            }
        };
        stats.calls.fetch_add(1, Ordering::Relaxed);
        handler.ready().await;
        let mut mine = handler.epoch();
        if h.epoch > mine {
            // A map change reaches the nodes a few milliseconds apart: a
            // request of the new epoch waits for this node to catch up.
            handler.epoch_ahead(h.epoch);
            let until = tokio::time::Instant::now() + EPOCH_CATCH_UP;
            while mine < h.epoch && tokio::time::Instant::now() < until {
                tokio::time::sleep(EPOCH_POLL).await;
                mine = handler.epoch();
            }
        }
        // A shard file written is nobody's until a record names it, and
        // records are written by calls that check the epoch: a shard write
        // of a caller a map change behind is taken (refused, its streamed
        // body would be lost and its drive taken out of the caller's view
        // while the map reaches it, a few milliseconds).
        let refusal = if h.epoch < mine && h.op != super::wire::op::SHARD_WRITE {
            stats.stale_epochs.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%peer, theirs = h.epoch, mine, "cluster RPC: request with a stale map epoch refused");
            Some((ErrorCode::StaleEpoch, "stale map epoch"))
        } else if h.epoch > mine {
            Some((ErrorCode::EpochAhead, "this node's map is behind; retry"))
        } else if h.aux == 0 {
            Some((
                ErrorCode::Deadline,
                "the deadline passed before the request arrived",
            ))
        } else {
            None
        };
        if let Some((code, message)) = refusal {
            if send_error(&mut conn, &h, code, mine, message)
                .await
                .is_err()
                || h.has_body()
            {
                // A body we will not read: the connection cannot go on.
                return;
            }
            continue;
        }
        // A little before the caller's: its deadline error must reach the
        // caller before the caller gives up on this node (and takes it for
        // silent).
        let left = Duration::from_millis(h.aux as u64).min(CALL_MAX);
        let deadline = Instant::now() + left - (left / 10).min(ANSWER_MARGIN);
        let mut call = ServerCall {
            conn: &mut conn,
            op: h.op,
            epoch: h.epoch,
            payload,
            deadline,
            call_id: h.call,
            body: if h.has_body() { Body::Open } else { Body::None },
            reply: Reply::None,
        };
        let outcome = timeout_at(deadline, handler.handle(&mut call)).await;
        let (body, reply) = (call.body, call.reply);
        let failure = match outcome {
            Err(_) => {
                tracing::warn!(%peer, op = h.op, "cluster RPC: call passed its deadline");
                let _ =
                    send_error(&mut conn, &h, ErrorCode::Deadline, mine, "deadline passed").await;
                // The handler stopped mid-way: the stream's state is unknown.
                return;
            }
            Ok(Ok(())) if reply == Reply::Done => None,
            Ok(Ok(())) => Some((
                ErrorCode::Failed,
                "the handler ended without a complete reply".to_string(),
            )),
            Ok(Err(HandlerError::Rpc(error))) => {
                if !matches!(error, RpcError::Closed | RpcError::Io(_)) {
                    bad(stats, &error);
                }
                return;
            }
            Ok(Err(HandlerError::Malformed(m))) => {
                bad(stats, &m);
                Some((ErrorCode::Protocol, m))
            }
            Ok(Err(HandlerError::UnknownOp(op))) => {
                tracing::warn!(%peer, op, "cluster RPC: unknown operation");
                Some((ErrorCode::UnknownOp, format!("unknown operation {op}")))
            }
            Ok(Err(HandlerError::Failed(m))) => Some((ErrorCode::Failed, m)),
        };
        if let Some((code, message)) = &failure {
            if reply == Reply::Done {
                tracing::error!(%peer, op = h.op, %message, "cluster RPC: a handler failed after replying");
                return;
            }
            if send_error(&mut conn, &h, *code, mine, message)
                .await
                .is_err()
            {
                return;
            }
            if *code == ErrorCode::Protocol {
                return;
            }
        }
        if body == Body::Open {
            // The rest of a request body we did not read: close rather
            // than read what may be gigabytes.
            return;
        }
    }
}
