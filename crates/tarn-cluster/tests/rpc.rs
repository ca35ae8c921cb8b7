//! Node-to-node RPC over real loopback TCP: authentication both ways,
//! epochs, deadlines, bodies, pools, and bad input from a peer.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tarn_cluster::rpc::client::ClientLimits;
use tarn_cluster::rpc::wire::{self, op, Channel, ErrorCode, Header, Kind};
use tarn_cluster::rpc::{
    fuzz, serve, Handler, HandlerError, Identity, RpcClient, RpcError, ServerCall, ServerStats,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SECRET: &[u8] = b"a-cluster-secret-of-some-length";
const OP_SLEEP: u16 = 100;
const OP_SUM_BODY: u16 = 101;
const OP_FAIL_AFTER_ONE: u16 = 102;
const OP_SEND_BODY: u16 = 103;

struct TestHandler {
    epoch: AtomicU64,
    ahead_seen: AtomicU64,
    handled: AtomicU64,
}

impl Handler for TestHandler {
    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    fn epoch_ahead(&self, epoch: u64) {
        self.ahead_seen.store(epoch, Ordering::SeqCst);
    }

    async fn handle(&self, call: &mut ServerCall<'_>) -> Result<(), HandlerError> {
        self.handled.fetch_add(1, Ordering::SeqCst);
        match call.op {
            op::PING => {
                let p = std::mem::take(&mut call.payload);
                call.reply(&p).await?;
            }
            OP_SLEEP => {
                let ms = u64::from_le_bytes(call.payload[..8].try_into().unwrap());
                tokio::time::sleep(Duration::from_millis(ms)).await;
                call.reply(b"slept").await?;
            }
            OP_SUM_BODY => {
                // Length and CRC32C of the whole body, and the end's payload.
                let mut buf = Vec::new();
                let (mut len, mut digest) = (
                    0u64,
                    crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi),
                );
                while call.next_data(&mut buf).await? {
                    len += buf.len() as u64;
                    digest.update(&buf);
                }
                let mut e = wire::Enc::new();
                e.u64(len).u32(digest.finalize() as u32).bytes(&buf);
                call.reply(&e.finish()).await?;
            }
            OP_FAIL_AFTER_ONE => {
                let mut buf = Vec::new();
                call.next_data(&mut buf).await?;
                return Err(HandlerError::Failed("disk on fire".into()));
            }
            OP_SEND_BODY => {
                // `count` frames of `size` bytes, byte i of frame f = f + i.
                let mut d = wire::Dec::new(&call.payload);
                let (count, size) = (d.u32()?, d.u32()? as usize);
                call.reply_body(b"head").await?;
                for f in 0..count {
                    let frame: Vec<u8> = (0..size).map(|i| (f as usize + i) as u8).collect();
                    call.send_data(&frame).await?;
                }
                call.end_body(b"tail").await?;
            }
            other => return Err(HandlerError::UnknownOp(other)),
        }
        Ok(())
    }
}

struct Node {
    address: String,
    handler: Arc<TestHandler>,
    stats: Arc<ServerStats>,
    stop: tokio::sync::watch::Sender<bool>,
}

async fn start_node(id: &str, secret: &[u8], epoch: u64) -> Node {
    start_node_at("127.0.0.1:0", id, secret, epoch).await
}

async fn start_node_at(bind: &str, id: &str, secret: &[u8], epoch: u64) -> Node {
    start_node_as(bind, Identity::new("test", id, secret).unwrap(), epoch).await
}

async fn start_node_as(bind: &str, identity: Identity, epoch: u64) -> Node {
    let listener = tokio::net::TcpListener::bind(bind).await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let handler = Arc::new(TestHandler {
        epoch: AtomicU64::new(epoch),
        ahead_seen: AtomicU64::new(0),
        handled: AtomicU64::new(0),
    });
    let stats = Arc::new(ServerStats::default());
    let (stop, rx) = tokio::sync::watch::channel(false);
    tokio::spawn(serve(
        listener,
        identity,
        handler.clone(),
        stats.clone(),
        rx,
    ));
    Node {
        address,
        handler,
        stats,
        stop,
    }
}

fn client(id: &str, secret: &[u8]) -> RpcClient {
    RpcClient::new(
        Identity::new("test", id, secret).unwrap(),
        ClientLimits::default(),
    )
}

const T: Duration = Duration::from_secs(10);

#[tokio::test]
async fn calls_reuse_one_authenticated_connection() {
    let n = start_node("b", SECRET, 1).await;
    let c = client("a", SECRET);
    for i in 0..20u8 {
        let r = c
            .call(&n.address, Some("b"), op::PING, 1, &[i; 100], T)
            .await
            .unwrap();
        assert_eq!(r, vec![i; 100]);
    }
    assert_eq!(c.stats.connects.load(Ordering::SeqCst), 1);
    assert_eq!(n.stats.connections.load(Ordering::SeqCst), 1);
    assert_eq!(n.stats.calls.load(Ordering::SeqCst), 20);
}

#[tokio::test]
async fn concurrent_calls_open_several_connections() {
    let n = start_node("b", SECRET, 1).await;
    let c = Arc::new(client("a", SECRET));
    let calls = (0..8).map(|_| {
        let (c, addr) = (c.clone(), n.address.clone());
        async move {
            c.call(&addr, Some("b"), OP_SLEEP, 1, &200u64.to_le_bytes(), T)
                .await
        }
    });
    for r in futures::future::join_all(calls).await {
        assert_eq!(r.unwrap(), b"slept");
    }
    assert_eq!(n.stats.connections.load(Ordering::SeqCst), 8);
    // All eight went back to the pool: no new connection for the next ones.
    for _ in 0..8 {
        c.call(&n.address, None, op::PING, 1, b"x", T)
            .await
            .unwrap();
    }
    assert_eq!(c.stats.connects.load(Ordering::SeqCst), 8);
}

#[tokio::test]
async fn a_client_without_the_secret_is_refused_and_reaches_nothing() {
    let n = start_node("b", SECRET, 1).await;
    let c = client("a", b"not-the-cluster-secret-at-all");
    let e = c
        .call(&n.address, None, op::PING, 1, b"x", T)
        .await
        .unwrap_err();
    match &e {
        RpcError::Auth { reason, .. } => {
            assert!(reason.contains("secret proof refused"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(n.handler.handled.load(Ordering::SeqCst), 0);
    assert_eq!(
        n.stats.auth_failures.load(Ordering::SeqCst),
        1,
        "the caller proves first, so the server refuses"
    );
    assert_eq!(c.stats.auth_failures.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn the_server_proves_nothing_to_a_caller_that_has_not_proved_the_secret() {
    // A hostile caller collecting material to guess the secret offline:
    // nothing the server sends before or after a wrong proof depends on
    // the secret.
    let n = start_node("b", SECRET, 1).await;
    let mut s = tokio::net::TcpStream::connect(&n.address).await.unwrap();
    let hello = wire::Hello {
        version: wire::PROTOCOL_VERSION,
        channel: Channel::Control,
        cluster: "test".into(),
        node_id: "mallory".into(),
        nonce: [7; 32],
    };
    s.write_all(&hello.encode()).await.unwrap();
    let mut challenge = vec![0u8; wire::CHALLENGE_FIXED_BYTES + 1];
    s.read_exact(&mut challenge).await.unwrap();
    let c = wire::Challenge::decode(&challenge).unwrap();
    assert_eq!(
        (c.status, c.node_id.as_str()),
        (wire::Refusal::Accepted, "b")
    );
    s.write_all(&[0u8; 32]).await.unwrap();
    let mut welcome = [0u8; wire::WELCOME_BYTES];
    s.read_exact(&mut welcome).await.unwrap();
    let w = wire::Welcome::decode(&welcome).unwrap();
    assert_eq!(w.status, wire::Refusal::Proof);
    assert_eq!(
        w.proof, [0u8; 32],
        "no proof of the secret to a refused caller"
    );
    // A request sent anyway is never served.
    let ping = Header::new(Kind::Request, op::PING, 1, 1, 1000);
    let _ = s.write_all(&ping.encode(b"x")).await;
    let _ = s.write_all(b"x").await;
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest).await;
    assert!(rest.is_empty());
    assert_eq!(n.handler.handled.load(Ordering::SeqCst), 0);
    assert_eq!(n.stats.auth_failures.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_server_without_the_secret_is_refused_by_the_client() {
    let n = start_node("b", b"an-impostor-with-another-secret", 1).await;
    let c = client("a", SECRET);
    let e = c
        .call(&n.address, None, op::PING, 1, b"x", T)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::Auth { .. }), "{e:?}");
    assert_eq!(n.handler.handled.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn another_cluster_and_another_node_are_refused() {
    let n = start_node("b", SECRET, 1).await;
    let stranger = RpcClient::new(
        Identity::new("other", "a", SECRET).unwrap(),
        ClientLimits::default(),
    );
    let e = stranger
        .call(&n.address, None, op::PING, 1, b"x", T)
        .await
        .unwrap_err();
    match e {
        RpcError::Auth { reason, .. } => assert!(reason.contains("another cluster"), "{reason}"),
        other => panic!("{other:?}"),
    }
    let c = client("a", SECRET);
    let e = c
        .call(&n.address, Some("c"), op::PING, 1, b"x", T)
        .await
        .unwrap_err();
    match e {
        RpcError::Auth { reason, .. } => assert!(reason.contains("expected node c"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn short_secrets_and_bad_names_are_refused() {
    assert!(Identity::new("c", "n", b"short").is_err());
    assert!(Identity::new("c", "n/1", SECRET).is_err());
    assert!(Identity::new("", "n", SECRET).is_err());
    assert!(Identity::new("c", &"n".repeat(64), SECRET).is_err());
}

#[tokio::test]
async fn stale_and_newer_epochs_are_refused_and_the_connection_stays_usable() {
    let n = start_node("b", SECRET, 7).await;
    let c = client("a", SECRET);
    let e = c
        .call(&n.address, None, op::PING, 6, b"x", T)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::StaleEpoch { peer_epoch: 7 }), "{e:?}");
    let e = c
        .call(&n.address, None, op::PING, 9, b"x", T)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::EpochAhead { peer_epoch: 7 }), "{e:?}");
    assert_eq!(n.handler.ahead_seen.load(Ordering::SeqCst), 9);
    assert_eq!(n.handler.handled.load(Ordering::SeqCst), 0);
    assert_eq!(
        c.call(&n.address, None, op::PING, 7, b"ok", T)
            .await
            .unwrap(),
        b"ok"
    );
    assert_eq!(c.stats.connects.load(Ordering::SeqCst), 1);
    assert_eq!(n.stats.stale_epochs.load(Ordering::SeqCst), 1);
    // A shard write is taken from a caller a map change behind (what it
    // writes is nobody's until an epoch-checked record names it).
    let r = c.call(&n.address, None, op::SHARD_WRITE, 6, b"x", T).await;
    assert!(!matches!(r, Err(RpcError::StaleEpoch { .. })), "{r:?}");
    assert_eq!(n.handler.handled.load(Ordering::SeqCst), 2);
    assert_eq!(n.stats.stale_epochs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_call_ends_at_its_deadline_and_the_pool_recovers() {
    let n = start_node("b", SECRET, 1).await;
    let c = client("a", SECRET);
    let e = c
        .call(
            &n.address,
            None,
            OP_SLEEP,
            1,
            &600_000u64.to_le_bytes(),
            Duration::from_millis(300),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::Deadline), "{e:?}");
    assert_eq!(c.stats.deadlines.load(Ordering::SeqCst), 1);
    // The peer answered (its deadline error): it is not suspect.
    assert!(!c.is_suspect(&n.address));
    // The timed-out connection was closed, not reused.
    assert_eq!(
        c.call(&n.address, None, op::PING, 1, b"x", T)
            .await
            .unwrap(),
        b"x"
    );
    assert_eq!(c.stats.connects.load(Ordering::SeqCst), 2);
}

/// A link between a client and a node that can stall: while `stalled`,
/// nothing crosses it either way (a paused process, a cut cable), and the
/// connections stay open.
async fn stalling_link(to: String, stalled: Arc<std::sync::atomic::AtomicBool>) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let (a, _) = l.accept().await.unwrap();
            let b = tokio::net::TcpStream::connect(&to).await.unwrap();
            let (ar, aw) = a.into_split();
            let (br, bw) = b.into_split();
            for (mut r, mut w) in [
                (
                    Box::new(ar) as Box<dyn tokio::io::AsyncRead + Send + Unpin>,
                    Box::new(bw) as Box<dyn tokio::io::AsyncWrite + Send + Unpin>,
                ),
                (Box::new(br), Box::new(aw)),
            ] {
                let stalled = stalled.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64 << 10];
                    loop {
                        while stalled.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        let n = match r.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => n,
                        };
                        while stalled.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                        if w.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        }
    });
    address
}

/// A node "b" behind a stalling link, a client that has called it once
/// (its connection open), and the link stalled now.
async fn stalled_peer() -> (Node, Arc<std::sync::atomic::AtomicBool>, String, RpcClient) {
    let n = start_node("b", SECRET, 1).await;
    let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let address = stalling_link(n.address.clone(), stalled.clone()).await;
    let c = client("a", SECRET);
    c.call(&address, Some("b"), op::PING, 1, b"x", T)
        .await
        .unwrap();
    stalled.store(true, Ordering::SeqCst);
    (n, stalled, address, c)
}

#[tokio::test]
async fn a_silent_peer_is_suspect_once_its_probe_fails_and_probed_back() {
    let (_n, stalled, address, c) = stalled_peer().await;
    // The call waits out one step (a second), whatever deadline it had.
    let t = std::time::Instant::now();
    let e = c
        .call(&address, Some("b"), op::PING, 1, b"x", T)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::Deadline), "{e:?}");
    // In doubt, probed at once: suspect when the probe fails too, within
    // two seconds of the call that found it silent.
    while !c.is_suspect(&address) {
        assert!(
            t.elapsed() < Duration::from_millis(2500),
            "not suspect after {:?}",
            t.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(c.stats.doubts.load(Ordering::SeqCst), 1);
    let s = c.suspects();
    assert_eq!(s.len(), 1);
    assert_eq!(s[0].node.as_deref(), Some("b"));
    // From now on calls fail at once, on either channel, with a clear error.
    for channel in [Channel::Control, Channel::Bulk] {
        let t = std::time::Instant::now();
        let e = c.open(&address, Some("b"), channel, T).await.err().unwrap();
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
        assert!(
            matches!(&e, RpcError::Unreachable { reason, .. } if reason.contains("suspect")),
            "{e:?}"
        );
    }
    assert_eq!(c.stats.fast_failures.load(Ordering::SeqCst), 2);
    // Still silent: probes keep failing, the peer stays suspect.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(c.is_suspect(&address));
    // The link works again: a probe finds the peer and calls go through.
    stalled.store(false, Ordering::SeqCst);
    let t = std::time::Instant::now();
    while c.is_suspect(&address) {
        assert!(t.elapsed() < Duration::from_secs(10), "never probed back");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        c.call(&address, Some("b"), op::PING, 1, b"y", T)
            .await
            .unwrap(),
        b"y"
    );
    assert_eq!(c.stats.suspected.load(Ordering::SeqCst), 1);
}

/// No fault anywhere, a loaded host: one answer came late and every node
/// took every other out of its view at once (54 requests answered 503 in 2
/// s, issue 40). A peer that misses one deadline but answers the probe
/// made at once is not routed around.
#[tokio::test]
async fn a_peer_that_misses_one_deadline_but_answers_its_probe_is_not_suspect() {
    let (_n, stalled, address, c) = stalled_peer().await;
    let un = stalled.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1100)).await;
        un.store(false, Ordering::SeqCst);
    });
    let e = c
        .call(&address, Some("b"), op::PING, 1, b"x", T)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::Deadline), "{e:?}");
    let t = std::time::Instant::now();
    while c.stats.doubts_cleared.load(Ordering::SeqCst) == 0 {
        assert!(!c.is_suspect(&address), "suspect after one late answer");
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "the probe never answered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(c.stats.suspected.load(Ordering::SeqCst), 0);
    assert_eq!(
        c.call(&address, Some("b"), op::PING, 1, b"y", T)
            .await
            .unwrap(),
        b"y"
    );
}

/// When the calling node itself stalls (its runtime woken late), a call
/// that misses its deadline then says nothing of the peer.
#[tokio::test]
async fn a_deadline_missed_while_this_node_stalled_is_held_against_nobody() {
    let (_n, stalled, address, c) = stalled_peer().await;
    let c = Arc::new(c);
    let call = {
        let (c, address) = (c.clone(), address.clone());
        tokio::spawn(async move { c.call(&address, Some("b"), op::PING, 1, b"x", T).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // This runtime blocked past the call's step deadline: its timer fires
    // well after the deadline.
    std::thread::sleep(Duration::from_millis(1500));
    let e = call.await.unwrap().unwrap_err();
    assert!(matches!(e, RpcError::Deadline), "{e:?}");
    assert!(c.stats.local_stalls.load(Ordering::SeqCst) >= 1);
    assert_eq!(c.stats.doubts.load(Ordering::SeqCst), 0);
    assert!(!c.is_suspect(&address));
    stalled.store(false, Ordering::SeqCst);
}

#[tokio::test]
async fn the_server_enforces_the_callers_deadline_too() {
    // A caller that never gives up on its own: the server answers at the
    // request's deadline (200 ms) instead of running the 10-minute handler.
    let n = start_node("b", SECRET, 1).await;
    let mut f = Header::new(Kind::Request, OP_SLEEP, 1, 1, 200)
        .encode(&600_000u64.to_le_bytes())
        .to_vec();
    f.extend_from_slice(&600_000u64.to_le_bytes());
    let answer = raw_after_handshake(&n, &f).await;
    assert_eq!(error_code(&answer), ErrorCode::Deadline as u32);
}

#[tokio::test]
async fn bodies_stream_both_ways() {
    let n = start_node("b", SECRET, 1).await;
    let c = client("a", SECRET);
    // 40 MiB up in 1 MiB frames.
    let mut call = c.open(&n.address, None, Channel::Bulk, T).await.unwrap();
    call.request(OP_SUM_BODY, 1, b"", true).await.unwrap();
    let mut digest = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
    for f in 0..40u32 {
        let frame: Vec<u8> = (0..1 << 20).map(|i: u32| (i ^ f) as u8).collect();
        digest.update(&frame);
        call.send_data(&frame).await.unwrap();
    }
    call.end_body(b"trailer").await.unwrap();
    let (r, body) = call.response().await.unwrap();
    assert!(!body);
    call.finish();
    let mut d = wire::Dec::new(&r);
    assert_eq!(d.u64().unwrap(), 40 << 20);
    assert_eq!(d.u32().unwrap(), digest.finalize() as u32);
    assert_eq!(d.bytes().unwrap(), b"trailer");
    // And down.
    let mut call = c.open(&n.address, None, Channel::Bulk, T).await.unwrap();
    let mut e = wire::Enc::new();
    e.u32(5).u32(3 << 20);
    call.request(OP_SEND_BODY, 1, &e.finish(), false)
        .await
        .unwrap();
    let (head, body) = call.response().await.unwrap();
    assert_eq!((head.as_slice(), body), (&b"head"[..], true));
    let mut buf = Vec::new();
    let mut f = 0usize;
    while call.next_data(&mut buf).await.unwrap() {
        assert_eq!(buf.len(), 3 << 20);
        assert!(buf.iter().enumerate().all(|(i, &b)| b == (f + i) as u8));
        f += 1;
    }
    assert_eq!((f, buf.as_slice()), (5, &b"tail"[..]));
    call.finish();
    // Both calls ended cleanly: one bulk connection served both.
    assert_eq!(c.stats.connects.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_early_failure_stops_the_senders_body() {
    let n = start_node("b", SECRET, 1).await;
    let c = client("a", SECRET);
    let mut call = c.open(&n.address, None, Channel::Bulk, T).await.unwrap();
    call.request(OP_FAIL_AFTER_ONE, 1, b"", true).await.unwrap();
    let frame = vec![1u8; 1 << 20];
    let mut sent = 0;
    let e = loop {
        match call.send_data(&frame).await {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 10_000, "the sender never learnt of the failure");
        tokio::task::yield_now().await;
    };
    match e {
        RpcError::Remote { code, message } => {
            assert_eq!(code, ErrorCode::Failed);
            assert_eq!(message, "disk on fire");
        }
        // The server closed after answering; the answer may be lost to a reset.
        RpcError::Io(_) | RpcError::Closed => {}
        other => panic!("{other:?}"),
    }
    call.finish();
    assert_eq!(
        c.call(&n.address, None, op::PING, 1, b"x", T)
            .await
            .unwrap(),
        b"x"
    );
}

#[tokio::test]
async fn bulk_streams_do_not_hold_up_control_calls() {
    let n = start_node("b", SECRET, 1).await;
    let c = RpcClient::new(
        Identity::new("test", "a", SECRET).unwrap(),
        ClientLimits {
            control_connections_max: 1,
            bulk_connections_max: 1,
        },
    );
    // A bulk stream left open holds the only bulk connection.
    let mut bulk = c.open(&n.address, None, Channel::Bulk, T).await.unwrap();
    bulk.request(OP_SUM_BODY, 1, b"", true).await.unwrap();
    bulk.send_data(&[0; 1000]).await.unwrap();
    for _ in 0..5 {
        c.call(&n.address, None, op::PING, 1, b"x", T)
            .await
            .unwrap();
    }
    // Another bulk call waits for it, within its deadline.
    let e = c
        .open(&n.address, None, Channel::Bulk, Duration::from_millis(200))
        .await
        .err()
        .unwrap();
    assert!(matches!(e, RpcError::Deadline), "{e:?}");
    bulk.end_body(b"").await.unwrap();
    bulk.response().await.unwrap();
    bulk.finish();
    c.open(&n.address, None, Channel::Bulk, T).await.unwrap();
}

#[tokio::test]
async fn a_restarted_peer_is_reconnected_transparently() {
    let n = start_node("b", SECRET, 1).await;
    let c = client("a", SECRET);
    c.call(&n.address, None, op::PING, 1, b"x", T)
        .await
        .unwrap();
    // Stop it (its connections close with it) and start again on the same port.
    n.stop.send(true).unwrap();
    drop(n.stop);
    let address = n.address.clone();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The listener task ended; open connections end when their tasks see EOF.
    let n2 = start_node_at(&address, "b", SECRET, 1).await;
    let _ = &n2;
    // The idle connection may still be open to the old task: the pool
    // drops it and connects afresh either way.
    c.forget(&address);
    assert_eq!(
        c.call(&address, None, op::PING, 1, b"y", T).await.unwrap(),
        b"y"
    );
}

#[tokio::test]
async fn unreachable_peers_fail_fast_with_a_clear_error() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = l.local_addr().unwrap().to_string();
    drop(l);
    let c = client("a", SECRET);
    let e = c
        .call(&address, None, op::PING, 1, b"x", T)
        .await
        .unwrap_err();
    assert!(matches!(e, RpcError::Unreachable { .. }), "{e:?}");
}

/// Raw frames after a real handshake, from a peer that knows the secret but
/// sends garbage.
async fn raw_after_handshake(n: &Node, bytes: &[u8]) -> Vec<u8> {
    let s = tokio::net::TcpStream::connect(&n.address).await.unwrap();
    let conn = tarn_cluster::rpc::client_handshake(
        Box::new(s),
        &Identity::new("test", "raw", SECRET).unwrap(),
        Channel::Control,
        &n.address,
        None,
    )
    .await
    .unwrap();
    let mut io = conn.into_stream();
    io.write_all(bytes).await.unwrap();
    // Our side is done: a server left waiting for more sees the end.
    io.shutdown().await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(T, io.read_to_end(&mut answer))
        .await
        .expect("the server closes a connection that sent garbage")
        .unwrap();
    answer
}

fn error_code(answer: &[u8]) -> u32 {
    let h = Header::decode(answer[..32].try_into().unwrap()).unwrap();
    assert_eq!(h.kind, Kind::Error);
    h.aux
}

#[tokio::test]
async fn bad_frames_from_a_peer_get_an_error_and_close_the_connection() {
    let n = start_node("b", SECRET, 1).await;
    // An oversized length.
    let mut h = Header::new(Kind::Request, op::PING, 1, 1, 1000).encode(&[]);
    h[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        error_code(&raw_after_handshake(&n, &h).await),
        ErrorCode::Protocol as u32
    );
    // A bad checksum.
    let mut f = Header::new(Kind::Request, op::PING, 1, 1, 1000)
        .encode(b"abc")
        .to_vec();
    f.extend_from_slice(b"abd");
    assert_eq!(
        error_code(&raw_after_handshake(&n, &f).await),
        ErrorCode::Protocol as u32
    );
    // A response where a request belongs.
    let f = Header::new(Kind::Response, op::PING, 1, 1, 0).encode(&[]);
    assert_eq!(
        error_code(&raw_after_handshake(&n, &f).await),
        ErrorCode::Protocol as u32
    );
    // An unknown operation is answered, and the connection goes on.
    let mut f = Header::new(Kind::Request, 999, 1, 1, 1000)
        .encode(&[])
        .to_vec();
    f.extend_from_slice(&Header::new(Kind::Request, op::PING, 2, 1, 1000).encode(b"z"));
    f.push(b'z');
    let answer = raw_after_handshake(&n, &f).await;
    assert_eq!(error_code(&answer), ErrorCode::UnknownOp as u32);
    let unknown_len = 32 + u32::from_le_bytes(answer[4..8].try_into().unwrap()) as usize;
    let pong = Header::decode(answer[unknown_len..unknown_len + 32].try_into().unwrap()).unwrap();
    assert_eq!((pong.kind, pong.call), (Kind::Response, 2));
    assert_eq!(n.stats.protocol_errors.load(Ordering::SeqCst), 3);
    // Good peers are served throughout.
    let c = client("a", SECRET);
    assert_eq!(
        c.call(&n.address, None, op::PING, 1, b"x", T)
            .await
            .unwrap(),
        b"x"
    );
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn frame(
    kind: Kind,
    op: u16,
    call: u64,
    epoch: u64,
    aux: u32,
    body: bool,
    payload: &[u8],
) -> Vec<u8> {
    let mut f = Header::new(kind, op, call, epoch, aux)
        .with_body(body)
        .encode(payload)
        .to_vec();
    f.extend_from_slice(payload);
    f
}

fn corpus() -> Vec<Vec<u8>> {
    let e = fuzz::FUZZ_EPOCH;
    let mut v = vec![
        frame(Kind::Request, op::PING, 1, e, 1000, false, b"ping"),
        frame(Kind::Request, op::PING, 1, e - 1, 1000, false, b""),
        frame(Kind::Request, op::PING, 1, e + 1, 1000, false, b""),
        frame(Kind::Request, 77, 1, e, 1000, false, b""),
    ];
    let mut body = frame(Kind::Request, fuzz::OP_ECHO_BODY, 3, e, 1000, true, b"");
    body.extend(frame(
        Kind::Data,
        fuzz::OP_ECHO_BODY,
        3,
        0,
        0,
        false,
        &[5; 300],
    ));
    body.extend(frame(
        Kind::Data,
        fuzz::OP_ECHO_BODY,
        3,
        0,
        0,
        false,
        &[6; 10],
    ));
    body.extend(frame(Kind::End, fuzz::OP_ECHO_BODY, 3, 0, 0, false, b"end"));
    body.extend(frame(Kind::Request, op::PING, 4, e, 1000, false, b"after"));
    v.push(body);
    v
}

/// Valid frame sequences, mutated, fed to a real server connection: it
/// answers with well-formed frames or closes, and never panics or hangs.
#[test]
fn mutated_frames_never_break_the_server() {
    for seed in corpus() {
        fuzz::frames(&seed);
    }
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let corpus = corpus();
    for _ in 0..3000 {
        let mut f = corpus[rng.below(corpus.len())].clone();
        for _ in 0..1 + rng.below(4) {
            match rng.below(5) {
                0 if !f.is_empty() => {
                    let i = rng.below(f.len());
                    f[i] ^= 1 << rng.below(8);
                }
                1 => f.truncate(rng.below(f.len() + 1)),
                2 if f.len() >= 8 => {
                    // A length field at an edge value (the CRC no longer matches,
                    // unless recomputed below).
                    let edge = [
                        0u32,
                        1,
                        wire::MESSAGE_MAX_BYTES,
                        wire::DATA_MAX_BYTES,
                        u32::MAX,
                    ];
                    f[4..8].copy_from_slice(&edge[rng.below(edge.len())].to_le_bytes());
                }
                3 if f.len() >= 32 => {
                    // Fix up the first header's CRC so the mutation gets past it.
                    let h = &f[..28];
                    let len = u32::from_le_bytes(f[4..8].try_into().unwrap()) as usize;
                    let end = (32 + len).min(f.len());
                    let mut d = crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi);
                    d.update(h);
                    d.update(&f[32..end]);
                    let crc = (d.finalize() as u32).to_le_bytes();
                    f[28..32].copy_from_slice(&crc);
                }
                _ => {
                    let other = &corpus[rng.below(corpus.len())];
                    let at = rng.below(f.len() + 1);
                    f.splice(at..at, other.iter().copied());
                }
            }
        }
        fuzz::frames(&f);
    }
}

#[test]
fn arbitrary_handshakes_are_refused() {
    let mut rng = Rng(42);
    let good = wire::Hello {
        version: wire::PROTOCOL_VERSION,
        channel: Channel::Bulk,
        cluster: "fuzz".into(),
        node_id: "x".into(),
        nonce: [1; 32],
    }
    .encode();
    for _ in 0..500 {
        let mut f = good.clone();
        f.extend((0..rng.below(80)).map(|_| rng.next() as u8));
        let i = rng.below(f.len());
        f[i] ^= rng.next() as u8;
        fuzz::handshake(&f);
    }
}

/// A rolling upgrade: nodes of the next release (speaking this version and
/// the next) and of this one call each other on this version; a node two
/// releases apart is refused with the reason.
#[tokio::test]
async fn nodes_of_adjacent_releases_agree_on_the_older_protocol() {
    let v = wire::PROTOCOL_VERSION;
    let id = |name: &str, oldest: u16, newest: u16| {
        Identity::new("test", name, SECRET)
            .unwrap()
            .speaking(oldest, newest)
    };
    let old = start_node_as("127.0.0.1:0", id("old", v, v), 1).await;
    let new = start_node_as("127.0.0.1:0", id("new", v, v + 1), 1).await;
    let new_client = RpcClient::new(id("new-c", v, v + 1), ClientLimits::default());
    let old_client = RpcClient::new(id("old-c", v, v), ClientLimits::default());
    for (c, n) in [
        (&new_client, &old),
        (&old_client, &new),
        (&new_client, &new),
        (&old_client, &old),
    ] {
        let r = c
            .call(&n.address, None, op::PING, 1, b"up", T)
            .await
            .unwrap();
        assert_eq!(r, b"up");
    }

    // The versions each connection agreed on: the newer node's first
    // offer to the older is refused with the version it speaks, and the
    // next connection offers that.
    let handshake = |me: Identity, address: String| async move {
        let s = tokio::net::TcpStream::connect(&address).await.unwrap();
        tarn_cluster::rpc::client_handshake(Box::new(s), &me, Channel::Control, &address, None)
            .await
    };
    let newer = id("newer", v, v + 1);
    let e = handshake(newer.clone(), old.address.clone())
        .await
        .err()
        .unwrap();
    assert!(
        matches!(e, RpcError::VersionRetry { version } if version == v),
        "{e:?}"
    );
    let conn = handshake(newer.clone(), old.address.clone()).await.unwrap();
    assert_eq!(conn.version, v);
    let conn = handshake(newer.clone(), new.address.clone()).await.unwrap();
    assert_eq!(conn.version, v + 1);
    let conn = handshake(id("older", v, v), new.address.clone())
        .await
        .unwrap();
    assert_eq!(conn.version, v);

    // Two releases apart, either way: refused, saying why.
    let far = RpcClient::new(id("far", v + 1, v + 2), ClientLimits::default());
    let e = far
        .call(&old.address, None, op::PING, 1, b"x", T)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("one release at a time"), "{e}");
    let far_node = start_node_as("127.0.0.1:0", id("far-node", v + 1, v + 2), 1).await;
    let e = old_client
        .call(&far_node.address, None, op::PING, 1, b"x", T)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("protocol versions up to"), "{e}");
}
