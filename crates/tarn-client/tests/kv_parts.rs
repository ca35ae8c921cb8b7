//! Values put in parts (the byte ranges tensor-parallel ranks hold), on a
//! real server in this process: a value is a miss until every byte of it
//! is in, from any mix of connections and transports; overlapping parts
//! (replicated heads) are fine (a corrupted part: kv.rs, which builds raw
//! frames); parts that disagree on the value's length or fall outside it are
//! refused; a value whose writers went away is dropped after the part
//! timeout; readers take whole values or their own ranges.

use std::sync::Arc;
use std::time::Duration;

use tarn_client::{
    BlockingKvClient, ConnectOptions, GetInto, Part, PutFrom, Status, TransportChoice,
};
use tarn_kv::auth::Credentials;
use tarn_kv::proto::Digest;
use tarn_kv::{Engine, KvConfig, Server, ServerOptions, Tenants};

fn start(part_timeout: Duration) -> (Arc<Engine>, Server) {
    let engine = Engine::open(KvConfig {
        memory_bytes: 32 << 20,
        value_max_bytes: 1 << 20,
        part_timeout,
        ..KvConfig::default()
    })
    .expect("engine");
    let tenants = Tenants::single(engine.clone(), Credentials::loopback_default());
    let opts = ServerOptions {
        threads: 2,
        ..ServerOptions::default()
    };
    (engine, Server::start(tenants, opts).expect("server"))
}

fn connect(server: &Server, choice: TransportChoice) -> BlockingKvClient {
    let opts = ConnectOptions {
        transport: choice,
        namespace: b"parts".to_vec(),
        ..ConnectOptions::default()
    };
    BlockingKvClient::connect(&server.tcp_addr.to_string(), opts).expect("connect")
}

fn digest(i: u8) -> Digest {
    [i; 32]
}

fn value(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn put_part(
    c: &mut BlockingKvClient,
    key: Digest,
    whole: &[u8],
    range: std::ops::Range<usize>,
) -> Status {
    let items = [PutFrom {
        digest: key,
        data: &whole[range.clone()],
    }];
    let parts = [Part {
        value_len: whole.len() as u64,
        offset: range.start as u64,
    }];
    c.put_parts(&items, &parts).expect("put part")[0]
}

fn get_whole(c: &mut BlockingKvClient, key: Digest, len: usize) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; len];
    let o = c
        .get_into(&mut [GetInto::whole(key, &mut buf)])
        .expect("get")[0];
    (o.status == Status::Ok).then(|| buf[..o.len as usize].to_vec())
}

#[test]
fn a_value_is_visible_only_once_every_part_is_in() {
    let (_e, server) = start(Duration::from_secs(60));
    let mut rank0 = connect(&server, TransportChoice::Shm);
    let mut rank1 = connect(&server, TransportChoice::Tcp);
    let mut reader = connect(&server, TransportChoice::Shm);
    let whole = value(256 << 10, 7);
    let key = digest(1);
    // Four quarters from two writers, out of order.
    assert_eq!(
        put_part(&mut rank1, key, &whole, (192 << 10)..(256 << 10)),
        Status::Ok
    );
    assert_eq!(put_part(&mut rank0, key, &whole, 0..(64 << 10)), Status::Ok);
    assert_eq!(reader.exists(&[key]).expect("exists").present, vec![false]);
    assert_eq!(get_whole(&mut reader, key, whole.len()), None);
    assert_eq!(
        put_part(&mut rank0, key, &whole, (64 << 10)..(128 << 10)),
        Status::Ok
    );
    assert_eq!(get_whole(&mut reader, key, whole.len()), None);
    assert_eq!(
        put_part(&mut rank1, key, &whole, (128 << 10)..(192 << 10)),
        Status::Ok
    );
    assert_eq!(
        get_whole(&mut reader, key, whole.len()).as_deref(),
        Some(&whole[..])
    );
    // Once visible, a value is stored: a late part is an idempotent success.
    assert_eq!(
        put_part(&mut rank1, key, &whole, 0..100),
        Status::AlreadyExists
    );
    // Each rank reads its own range over either transport.
    for (c, r) in [
        (&mut rank0, 0..(128 << 10)),
        (&mut rank1, (128 << 10)..(256 << 10)),
    ] {
        let mut buf = vec![0u8; r.len()];
        let o = c
            .get_into(&mut [GetInto {
                digest: key,
                offset: r.start as u64,
                len: Some(r.len() as u64),
                buf: &mut buf,
            }])
            .expect("ranged get")[0];
        assert_eq!(o.status, Status::Ok);
        assert_eq!(&buf[..], &whole[r]);
    }
    let stats = reader.stats().expect("stats");
    let stat = |n: &str| stats.iter().find(|(k, _)| k == n).map(|(_, v)| *v).unwrap();
    assert_eq!(stat("namespace.puts_stored"), 1);
    assert_eq!(stat("namespace.blocks"), 1);
}

#[test]
fn overlapping_parts_and_parts_that_do_not_fit() {
    let (_e, server) = start(Duration::from_secs(60));
    let mut a = connect(&server, TransportChoice::Tcp);
    let mut b = connect(&server, TransportChoice::Shm);
    let whole = value(10_000, 3);
    let key = digest(2);
    // Replicas of the same heads write the same bytes twice.
    assert_eq!(put_part(&mut a, key, &whole, 0..6000), Status::Ok);
    assert_eq!(put_part(&mut b, key, &whole, 4000..6000), Status::Ok);
    // Disagreeing on the value's length, or out of it: refused.
    let items = [PutFrom {
        digest: key,
        data: &whole[6000..],
    }];
    let wrong = [Part {
        value_len: 12_000,
        offset: 6000,
    }];
    assert_eq!(
        a.put_parts(&items, &wrong).expect("put")[0],
        Status::BadRange
    );
    let outside = [Part {
        value_len: 10_000,
        offset: 7000,
    }];
    assert_eq!(
        a.put_parts(&items, &outside).expect("put")[0],
        Status::BadRange
    );
    assert_eq!(get_whole(&mut b, key, whole.len()), None);
    assert_eq!(put_part(&mut b, key, &whole, 6000..10_000), Status::Ok);
    assert_eq!(
        get_whole(&mut a, key, whole.len()).as_deref(),
        Some(&whole[..])
    );
    // A value whose other part never comes stays a miss.
    let key = digest(3);
    assert_eq!(put_part(&mut a, key, &whole, 0..5000), Status::Ok);
    assert_eq!(get_whole(&mut a, key, whole.len()), None);
    assert_eq!(a.exists(&[key]).expect("exists").present, vec![false]);
}

#[test]
fn a_value_whose_writers_went_away_is_dropped() {
    let (_e, server) = start(Duration::from_millis(200));
    let whole = value(64 << 10, 9);
    {
        let mut gone = connect(&server, TransportChoice::Shm);
        assert_eq!(
            put_part(&mut gone, digest(4), &whole, 0..(32 << 10)),
            Status::Ok
        );
    }
    std::thread::sleep(Duration::from_millis(400));
    let mut c = connect(&server, TransportChoice::Tcp);
    // The next new value sweeps the abandoned one.
    assert_eq!(
        put_part(&mut c, digest(5), &whole, 0..(64 << 10)),
        Status::Ok
    );
    let stats = c.stats().expect("stats");
    let stat = |n: &str| stats.iter().find(|(k, _)| k == n).map(|(_, v)| *v).unwrap();
    assert_eq!(stat("parts_abandoned"), 1);
    // The dropped value starts over: a late part alone does not complete it.
    assert_eq!(
        put_part(&mut c, digest(4), &whole, (32 << 10)..(64 << 10)),
        Status::Ok
    );
    assert_eq!(get_whole(&mut c, digest(4), whole.len()), None);
    assert_eq!(
        put_part(&mut c, digest(4), &whole, 0..(32 << 10)),
        Status::Ok
    );
    assert_eq!(
        get_whole(&mut c, digest(4), whole.len()).as_deref(),
        Some(&whole[..])
    );
    assert_eq!(
        get_whole(&mut c, digest(5), whole.len()).as_deref(),
        Some(&whole[..])
    );
}

#[test]
fn a_whole_value_put_frees_a_value_whose_writers_went_away() {
    let (_e, server) = start(Duration::from_millis(200));
    let whole = value(64 << 10, 11);
    let mut c = connect(&server, TransportChoice::Shm);
    assert_eq!(
        put_part(&mut c, digest(6), &whole, 0..(16 << 10)),
        Status::Ok
    );
    std::thread::sleep(Duration::from_millis(400));
    // No value in parts follows: a plain put looks for abandoned ones too.
    let items = [PutFrom {
        digest: digest(7),
        data: &whole,
    }];
    assert_eq!(c.put_from(&items).expect("put"), vec![Status::Ok]);
    let stats = c.stats().expect("stats");
    let stat = |n: &str| stats.iter().find(|(k, _)| k == n).map(|(_, v)| *v).unwrap();
    assert_eq!(stat("parts_abandoned"), 1);
}

#[test]
fn only_puts_take_parts() {
    let (_e, server) = start(Duration::from_secs(60));
    for choice in [TransportChoice::Tcp, TransportChoice::Shm] {
        let mut c = connect(&server, choice);
        c.client().set_batch_flags(tarn_kv::proto::BATCH_PARTS);
        let e = c.exists(&[digest(1)]).expect_err("parts on EXISTS");
        assert!(
            e.to_string().contains("only PUT and PUT_SHM take parts"),
            "{e}"
        );
        let mut buf = vec![0u8; 10];
        let e = c
            .get_into(&mut [GetInto::whole(digest(1), &mut buf)])
            .expect_err("parts on GET");
        assert!(
            e.to_string().contains("only PUT and PUT_SHM take parts"),
            "{e}"
        );
        let e = c.stats().expect_err("parts on STATS");
        assert!(
            e.to_string().contains("only PUT and PUT_SHM take parts"),
            "{e}"
        );
        // The connection goes on.
        c.client().set_batch_flags(0);
        assert_eq!(c.exists(&[digest(1)]).expect("exists").present, vec![false]);
    }
}
