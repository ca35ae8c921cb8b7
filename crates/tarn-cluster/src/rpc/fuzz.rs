//! Fuzzing entry points for every parser of RPC bytes from a peer: the
//! server's handshake and its frame handling after a real handshake, on an
//! in-memory stream. Used by `fuzz/` (cargo-fuzz) and by the mutation test
//! in `tests/rpc.rs`, which runs in the normal test suite.

use std::cell::RefCell;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::server::{serve_connection, Handler, HandlerError, ServerCall, ServerStats};
use super::wire::{self, op, Channel};
use super::{client_handshake, BoxStream, Identity};

/// The epoch the fuzzed server is at.
pub const FUZZ_EPOCH: u64 = 5;
/// An operation of the fuzz handler that echoes a request body as a response body.
pub const OP_ECHO_BODY: u16 = 0xfff0;

/// Answers PING with its payload and echoes request bodies.
pub struct EchoHandler;

impl Handler for EchoHandler {
    fn epoch(&self) -> u64 {
        FUZZ_EPOCH
    }

    async fn handle(&self, call: &mut ServerCall<'_>) -> Result<(), HandlerError> {
        match call.op {
            op::PING => {
                let p = std::mem::take(&mut call.payload);
                call.reply(&p).await?;
            }
            OP_ECHO_BODY => {
                let mut pieces = Vec::new();
                let mut buf = Vec::new();
                while call.next_data(&mut buf).await? {
                    if pieces.len() > 64 {
                        return Err(HandlerError::Failed("too many pieces".into()));
                    }
                    pieces.push(buf.clone());
                }
                call.reply_body(&buf).await?;
                for p in &pieces {
                    call.send_data(p).await?;
                }
                call.end_body(&[]).await?;
            }
            other => return Err(HandlerError::UnknownOp(other)),
        }
        Ok(())
    }
}

thread_local! {
    static RUNTIME: RefCell<Option<tokio::runtime::Runtime>> = const { RefCell::new(None) };
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    RUNTIME.with(|rt| {
        let mut rt = rt.borrow_mut();
        let rt = rt.get_or_insert_with(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("fuzz runtime")
        });
        rt.block_on(f)
    })
}

pub fn identity(node: &str) -> Identity {
    Identity::new("fuzz", node, b"fuzz-cluster-secret-0123456789").expect("identity")
}

/// Runs a real server connection against a client that (after a real
/// handshake, with `authenticate`) sends `data` and closes its side; returns
/// everything the server sent after the handshake.
async fn exchange(data: &[u8], authenticate: bool) -> Vec<u8> {
    let (ours, theirs) = tokio::io::duplex(1 << 16);
    let server = async {
        serve_connection(
            Box::new(theirs),
            "fuzz",
            &identity("server"),
            &EchoHandler,
            &ServerStats::default(),
        )
        .await
    };
    let client = async {
        let mut io: BoxStream = Box::new(ours);
        if authenticate {
            let conn = client_handshake(
                io,
                &identity("client"),
                Channel::Control,
                "fuzz",
                Some("server"),
            )
            .await
            .expect("handshake with the right secret");
            io = Box::new(conn.into_stream());
        }
        let _ = io.write_all(data).await;
        let _ = io.shutdown().await;
        let mut sink = Vec::new();
        let _ = io.read_to_end(&mut sink).await;
        sink
    };
    let (_, answer) = tokio::time::timeout(Duration::from_secs(10), async {
        tokio::join!(server, client)
    })
    .await
    .expect("the server ends when the input does");
    answer
}

/// Arbitrary bytes as the first bytes of a connection: the server must
/// refuse (no forged proof passes) without panicking.
pub fn handshake(data: &[u8]) {
    block_on(async {
        let answer = exchange(data, false).await;
        // Whatever came back is a challenge or a refusal, never a response frame.
        if answer.len() >= wire::CHALLENGE_FIXED_BYTES {
            assert_eq!(&answer[..4], &wire::MAGIC);
        }
    })
}

/// Arbitrary bytes after a real handshake: the server answers with frames
/// or closes, never panics, and never runs past the input.
pub fn frames(data: &[u8]) {
    block_on(async {
        let answer = exchange(data, true).await;
        // Every answer is a sequence of well-formed frames.
        let mut rest = &answer[..];
        while rest.len() >= wire::HEADER_BYTES {
            let h = wire::Header::decode(rest[..wire::HEADER_BYTES].try_into().expect("32"))
                .expect("the server sends valid headers");
            let end = wire::HEADER_BYTES + h.len as usize;
            assert!(rest.len() >= end, "a truncated frame from the server");
            h.check_payload(&rest[wire::HEADER_BYTES..end])
                .expect("the server's frames check");
            rest = &rest[end..];
        }
        assert!(rest.is_empty(), "trailing bytes from the server");
    })
}
