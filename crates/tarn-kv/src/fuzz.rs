//! Fuzzing entry points for every parser of KV wire bytes: the server's frame
//! handling (through a real connection on an in-memory stream, and through a
//! shared-memory mailbox) and the client-side response decoders. Used by `fuzz/` (cargo-fuzz) and by the
//! mutation test in `tests/fuzz.rs`, which runs in the normal test suite.

use std::cell::RefCell;
use std::sync::{Arc, OnceLock};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
}

/// Feeds `data` to a server connection after a valid HELLO and checks that
/// every byte it sends back is a well-formed response frame. Panics (the
/// fuzzer's signal) on a malformed response or a server panic.
pub fn frames(data: &[u8]) -> Outcome {
    decoders(data);
    let engine = engine();
    let mut input = Vec::with_capacity(data.len() + 64);
    begin_frame(&mut input, Op::Hello as u16, 0);
    Hello {
        version_min: VERSION_MIN,
        version_max: VERSION_MAX,
        flags: 0,
    }
    .encode(&mut input);
    finish_frame(&mut input, 0);
    input.extend_from_slice(data);
    let output = block_on(async move {
        let (mut client, server) = tokio::io::duplex(256 << 10);
        let serve = tokio::spawn(crate::server::serve_stream(engine, server));
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
        at += FRAME_HEADER_BYTES + h.len as usize;
        assert!(at <= output.len(), "server frame longer than what it sent");
        o.frames += 1;
    }
    assert!(o.frames >= 1, "no HELLO reply");
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
    let _ = ReserveResult::decode(&mut r);
    let mut r = Reader::new(data);
    let _ = read_batch_head(&mut r, GET_ENTRY_BYTES).map(|b| b.count);
    let _ = crate::disk::decode_record_header(data, 1 << 20);
}
