//! Fuzzing entry points for every parser of KV wire bytes: the server's frame
//! handling (through a real connection on an in-memory stream, and through a
//! shared-memory mailbox) and the client-side response decoders. Used by `fuzz/` (cargo-fuzz) and by the
//! mutation test in `tests/fuzz.rs`, which runs in the normal test suite.

use std::cell::RefCell;
use std::sync::{Arc, OnceLock};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::auth::{Credentials, Tenants};
use crate::engine::{Engine, KvConfig};
use crate::mailbox::{Area, Mailbox, REQUEST_AREA_BYTES, RESPONSE_AREA_BYTES};
use crate::proto::*;

fn engine() -> Arc<Engine> {
    static ENGINE: OnceLock<Arc<Engine>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            Engine::open(KvConfig {
                memory_bytes: 8 << 20,
                value_max_bytes: 64 << 10,
                ..KvConfig::default()
            })
            .expect("fuzz engine")
        })
        .clone()
}

thread_local! {
    static RUNTIME: RefCell<Option<tokio::runtime::Runtime>> = const { RefCell::new(None) };
    static MAILBOX: Mailbox = Mailbox::create().expect("fuzz mailbox");
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    RUNTIME.with(|rt| {
        let mut rt = rt.borrow_mut();
        let rt = rt.get_or_insert_with(|| {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
        });
        rt.block_on(f)
    })
}

/// What one input produced.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Response frames the server sent (each with a valid header).
    pub frames: usize,
    /// Error frames among them.
    pub errors: usize,
    /// HELLO replies among them.
    pub hellos: usize,
}

fn tenants() -> Tenants {
    Tenants::single(engine(), Credentials::loopback_default())
}

/// Feeds `data` to an authenticated server connection and checks that every
/// byte it sends back is a well-formed response frame. Panics (the fuzzer's
/// signal) on a malformed response or a server panic.
pub fn frames(data: &[u8]) -> Outcome {
    decoders(data);
    serve(data, true)
}

/// Feeds `data` to a connection that has not authenticated: whatever it
/// sends, the server answers only HELLO replies and error frames (no
/// operation is served before AUTH, and a fuzzer cannot forge a proof of a
/// nonce it never saw), and every frame is well formed.
pub fn handshake(data: &[u8]) -> Outcome {
    decoders(data);
    let o = serve(data, false);
    assert_eq!(
        o.frames,
        o.errors + o.hellos,
        "the server answered an operation before AUTH"
    );
    o
}

fn serve(data: &[u8], preauthenticated: bool) -> Outcome {
    let input = data.to_vec();
    let tenants = tenants();
    let output = block_on(async move {
        let (mut client, server) = tokio::io::duplex(256 << 10);
        let serve = tokio::spawn(crate::server::serve_stream(
            tenants,
            server,
            preauthenticated,
        ));
        let (mut rd, mut wr) = tokio::io::split(&mut client);
        let write = async {
            let _ = wr.write_all(&input).await;
            let _ = wr.shutdown().await;
        };
        let mut out = Vec::new();
        let read = rd.read_to_end(&mut out);
        let (_, r) = tokio::join!(write, read);
        let _ = r;
        serve.await.expect("server task panicked");
        out
    });
    let mut o = Outcome::default();
    let mut at = 0;
    while at < output.len() {
        let head: &[u8; FRAME_HEADER_BYTES] = output[at..at + FRAME_HEADER_BYTES]
            .try_into()
            .expect("server sent a partial frame header");
        let h = FrameHeader::decode(head).expect("server sent a bad frame header");
        assert!(
            h.op & RESPONSE_BIT != 0,
            "server sent a non-response op {:#x}",
            h.op
        );
        if h.op == Op::Error as u16 | RESPONSE_BIT {
            o.errors += 1;
        }
        if h.op == Op::Hello as u16 | RESPONSE_BIT {
            o.hellos += 1;
        }
        at += FRAME_HEADER_BYTES + h.len as usize;
        assert!(at <= output.len(), "server frame longer than what it sent");
        o.frames += 1;
    }
    o
}

/// Places `data` in a mailbox's request area (the rest of the area keeps
/// whatever the previous input left, as a client's scribbles would) and has
/// the server answer it: the response area must then hold one well-formed
/// response frame, and streamed GET_SHM results must not run past it.
pub fn mailbox(data: &[u8]) -> Outcome {
    decoders(data);
    let engine = engine();
    MAILBOX.with(|mb| {
        let seq = mb.request_seq().load(std::sync::atomic::Ordering::Relaxed) + 1;
        mb.write(Area::Request, &data[..data.len().min(REQUEST_AREA_BYTES)])
            .expect("fits");
        mb.request_seq()
            .store(seq, std::sync::atomic::Ordering::Release);
        block_on(crate::server::answer_mailbox_once(engine, mb, seq));
        let mut head = [0u8; FRAME_HEADER_BYTES];
        assert!(mb.read(Area::Response, 0, &mut head));
        let h = FrameHeader::decode(&head).expect("server wrote a bad frame header");
        assert!(h.op & RESPONSE_BIT != 0, "non-response op {:#x}", h.op);
        assert!(
            FRAME_HEADER_BYTES as u64 + h.len <= RESPONSE_AREA_BYTES as u64,
            "response frame runs past the area"
        );
        let streamed = mb.progress(seq);
        if streamed > 0 {
            assert_eq!(h.op, Op::GetShm as u16 | RESPONSE_BIT);
            assert!(4 + streamed * GET_SHM_RESULT_BYTES <= h.len as usize);
        }
        Outcome {
            frames: 1,
            errors: (h.op == Op::Error as u16 | RESPONSE_BIT) as usize,
            hellos: 0,
        }
    })
}

/// Client-side decoders must reject, never panic on, arbitrary bytes.
fn decoders(data: &[u8]) {
    let _ = HelloReply::decode(data);
    let _ = Hello::decode(data);
    let n = data.first().copied().unwrap_or(0) as usize;
    let _ = decode_statuses(data, n);
    let _ = ExistsReply::decode(data, n);
    let _ = decode_stats(data);
    let _ = decode_error(data);
    let mut r = Reader::new(data);
    let _ = GetResult::decode(&mut r);
    let _ = ShmGetResult::decode(&mut r);
    let _ = PutShmEntry::decode(&mut r);
    let _ = Auth::decode(data);
    let _ = AuthReply::decode(data);
    let mut r = Reader::new(data);
    let _ = read_batch_head(&mut r, GET_ENTRY_BYTES).map(|b| b.count);
    let _ = crate::disk::decode_record_header(data, 1 << 20);
}
