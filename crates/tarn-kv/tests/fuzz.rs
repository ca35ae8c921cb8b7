//! Mutation fuzzing of the KV protocol in the normal test suite: valid frames
//! of every op, mutated (bit flips, truncation, splices, length fields set to
//! edge values), fed to a real server connection. The cargo-fuzz target in
//! `fuzz/` runs the same entry point with coverage guidance.

use tarn_kv::proto::*;

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

fn frame(op: Op, payload: &[u8], bulk: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    begin_frame(&mut out, op as u16, 9);
    out.extend_from_slice(payload);
    finish_frame(&mut out, bulk.len() as u64);
    out.extend_from_slice(bulk);
    out
}

fn corpus() -> Vec<Vec<u8>> {
    let d = |i: u8| [i; 32];
    let mut v = Vec::new();
    for op in [Op::Exists, Op::Touch, Op::Pin, Op::Unpin, Op::Delete] {
        let mut p = Vec::new();
        put_batch_head(&mut p, b"ns", 3, 100);
        for i in 0..3 {
            p.extend_from_slice(&d(i));
        }
        v.push(frame(op, &p, &[]));
    }
    let data = vec![0x5au8; 3000];
    let mut p = Vec::new();
    put_batch_head(&mut p, b"ns", 2, 0);
    PutEntry {
        digest: d(1),
        len: 1000,
        crc: crc32c(&data[..1000]),
    }
    .encode(&mut p);
    PutEntry {
        digest: d(2),
        len: 2000,
        crc: crc32c(&data[1000..]),
    }
    .encode(&mut p);
    v.push(frame(Op::Put, &p, &data));
    for op in [Op::Get, Op::GetShm] {
        let mut p = Vec::new();
        put_batch_head(&mut p, b"ns", 2, 0);
        GetEntry {
            digest: d(1),
            offset: 0,
            length: LENGTH_TO_END,
        }
        .encode(&mut p);
        GetEntry {
            digest: d(2),
            offset: 10,
            length: 100,
        }
        .encode(&mut p);
        v.push(frame(op, &p, &[]));
    }
    let mut p = Vec::new();
    put_batch_head(&mut p, b"ns", 1, 0);
    PutShmEntry {
        digest: d(3),
        len: 10,
        window_offset: 64,
        crc: 0,
    }
    .encode(&mut p);
    v.push(frame(Op::PutShm, &p, &[]));
    let mut p = Vec::new();
    put_batch_head(&mut p, b"ns", 0, 0);
    v.push(frame(Op::Stats, &p, &[]));
    v.extend(handshake_corpus());
    v
}

/// HELLO, and AUTH with a proof for a nonce the server never sent.
fn handshake_corpus() -> Vec<Vec<u8>> {
    let mut v = Vec::new();
    let mut p = Vec::new();
    Hello {
        version_min: VERSION_MIN,
        version_max: VERSION_MAX,
        flags: 0,
    }
    .encode(&mut p);
    v.push(frame(Op::Hello, &p, &[]));
    let mut p = Vec::new();
    Auth {
        flags: 0,
        client_nonce: [7; 32],
        proof: [9; 32],
        access_key: tarn_kv::auth::DEFAULT_ACCESS_KEY.as_bytes().to_vec(),
    }
    .encode(&mut p);
    v.push(frame(Op::Auth, &p, &[]));
    v
}

fn mutate(rng: &mut Rng, corpus: &[Vec<u8>]) -> Vec<u8> {
    let mut input: Vec<u8> = Vec::new();
    for _ in 0..1 + rng.below(3) {
        input.extend_from_slice(&corpus[rng.below(corpus.len())]);
    }
    for _ in 0..1 + rng.below(4) {
        let len = input.len();
        match rng.below(6) {
            0 => {
                let i = rng.below(len);
                input[i] ^= 1 << rng.below(8);
            }
            1 => input.truncate(rng.below(len)),
            2 if len >= 8 => {
                // A length or count field set to an edge value.
                let i = rng.below(len.saturating_sub(8));
                let edge: u64 = [0, 1, 0xff, 0xffff, 0xffff_ffff, u64::MAX, 1 << 40][rng.below(7)];
                input[i..i + 8].copy_from_slice(&edge.to_le_bytes());
            }
            3 => {
                let i = rng.below(len);
                input.insert(i, rng.next() as u8);
            }
            4 => {
                let c = &corpus[rng.below(corpus.len())];
                let i = rng.below(len);
                input.splice(i..i, c.iter().copied());
            }
            _ => {
                let i = rng.below(len);
                input.remove(i.min(len.saturating_sub(1)));
            }
        }
        if input.is_empty() {
            break;
        }
    }
    input
}

#[test]
fn corpus_frames_are_all_answered() {
    for f in corpus() {
        let o = tarn_kv::fuzz::frames(&f);
        assert_eq!(o.frames, 1, "one reply per frame");
    }
}

/// Before AUTH, nothing but HELLO replies and error frames, whatever comes:
/// every operation of the corpus, mutated, in front of or behind a HELLO.
#[test]
fn nothing_is_served_before_auth() {
    let corpus = corpus();
    let hello = &handshake_corpus()[0];
    for f in &corpus {
        let o = tarn_kv::fuzz::handshake(f);
        assert!(o.frames >= 1);
        let mut after_hello = hello.clone();
        after_hello.extend_from_slice(f);
        tarn_kv::fuzz::handshake(&after_hello);
    }
    let mut rng = Rng(0x7a72_6e6b_7600_0003);
    for _ in 0..5_000 {
        let mut input = hello.clone();
        input.extend(mutate(&mut rng, &corpus));
        tarn_kv::fuzz::handshake(&input);
    }
}

#[test]
fn mutated_frames_never_break_the_server() {
    let corpus = corpus();
    let mut rng = Rng(0x7a72_6e6b_7600_0001);
    let iterations = std::env::var("TARN_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30_000);
    let mut errors = 0;
    for _ in 0..iterations {
        let input = mutate(&mut rng, &corpus);
        errors += tarn_kv::fuzz::frames(&input).errors;
    }
    assert!(
        errors > 0,
        "mutations never produced an error: the mutator is broken"
    );
    // Random bytes too.
    for _ in 0..500 {
        let n = rng.below(300);
        let input: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
        tarn_kv::fuzz::frames(&input);
    }
}

#[test]
fn mutated_mailbox_requests_never_break_the_server() {
    let corpus = corpus();
    for f in &corpus {
        let o = tarn_kv::fuzz::mailbox(f);
        assert_eq!(o.frames, 1);
    }
    let mut rng = Rng(0x7a72_6e6b_7600_0002);
    let iterations = std::env::var("TARN_FUZZ_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30_000usize)
        / 3;
    let mut errors = 0;
    for _ in 0..iterations {
        let input = mutate(&mut rng, &corpus);
        errors += tarn_kv::fuzz::mailbox(&input).errors;
    }
    assert!(
        errors > 0,
        "mutations never produced an error: the mutator is broken"
    );
}
