//! KV store throughput and latency over shared memory and TCP, next to a
//! plain memcpy of the same bytes in the same run.
//!
//! `cargo bench -p tarn-client --bench kv` (TARN_BENCH_SECONDS per phase,
//! default 2; TARN_BENCH_WORKING_SET in MiB, default 256). The server runs in
//! this process on its own threads; the client is this thread.

use std::time::{Duration, Instant};

use tarn_client::{BlockingKvClient, ConnectOptions, GetInto, PutFrom, Status, TransportChoice};
use tarn_kv::{Engine, KvConfig, Server, ServerOptions};

const BATCH: usize = 32;

struct Lat(Vec<u64>);

impl Lat {
    fn pct(&mut self, p: f64) -> f64 {
        self.0.sort_unstable();
        let i = ((self.0.len() as f64 - 1.0) * p).round() as usize;
        self.0[i] as f64 / 1000.0
    }
}

fn digest(i: u64) -> [u8; 32] {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_le_bytes());
    d[8] = 1;
    d
}

fn row(name: &str, bytes: u64, elapsed: Duration, lat: &mut Lat) -> f64 {
    let gbps = bytes as f64 / elapsed.as_secs_f64() / 1e9;
    println!(
        "{name:<34} {gbps:>7.2} GB/s   p50 {:>9.1} us   p99 {:>9.1} us   ({} samples)",
        lat.pct(0.5),
        lat.pct(0.99),
        lat.0.len()
    );
    gbps
}

fn main() {
    let seconds: f64 = std::env::var("TARN_BENCH_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2.0);
    let working_set: usize = std::env::var("TARN_BENCH_WORKING_SET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
        << 20;
    let phase = Duration::from_secs_f64(seconds);
    let engine = Engine::open(KvConfig {
        memory_bytes: (working_set as u64 * 4).max(1 << 30),
        value_max_bytes: 4 << 20,
        ..KvConfig::default()
    })
    .expect("engine");
    let huge = engine.arena().huge_pages;
    let server = Server::start(
        tarn_kv::Tenants::single(engine, tarn_kv::Credentials::loopback_default()),
        ServerOptions {
            threads: 1,
            pin_cores: true,
            io_uring: true,
            ..ServerOptions::default()
        },
    )
    .expect("server");
    let addr = server.tcp_addr.to_string();
    // The server thread is pinned to core 0 (as the daemon pins its threads);
    // the client, like an inference engine's loader thread, sits on core 1.
    // SAFETY: plain syscall on a zeroed cpu_set_t.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(1, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
    println!(
        "working set {} MiB, batches of {BATCH}, {seconds} s per phase, arena on {}",
        working_set >> 20,
        if huge { "huge pages" } else { "4 KiB pages" }
    );
    // Connect first: a client faults the arena mapping in on a background
    // thread at connect (a one-time cost), which must not overlap the phases.
    let mut clients: Vec<(&str, BlockingKvClient)> =
        [("shm", TransportChoice::Shm), ("tcp", TransportChoice::Tcp)]
            .into_iter()
            .map(|(n, choice)| {
                let c = BlockingKvClient::connect(
                    &addr,
                    ConnectOptions {
                        transport: choice,
                        ..Default::default()
                    },
                )
                .expect("connect");
                (n, c)
            })
            .collect();
    // Faulting in costs ~2.5 µs per 4 KiB page here, for the daemon's and the
    // client's mapping: wait it out (about 1.5 s per GiB of arena).
    let arena_gib = ((working_set as u64 * 4).max(1 << 30) >> 30) as f64;
    std::thread::sleep(Duration::from_secs_f64((arena_gib * 1.5).max(3.0)));
    if let Ok(st) = std::fs::read_to_string("/proc/self/status") {
        for l in st
            .lines()
            .filter(|l| l.starts_with("RssShmem") || l.starts_with("VmRSS"))
        {
            println!("{l}");
        }
    }
    // TARN_BENCH_SIZES=64,256 (KiB) and TARN_BENCH_TRANSPORTS=shm narrow the run.
    let sizes: Vec<usize> = std::env::var("TARN_BENCH_SIZES")
        .ok()
        .map(|v| {
            v.split(',')
                .filter_map(|x| x.trim().parse::<usize>().ok())
                .map(|k| k << 10)
                .collect()
        })
        .unwrap_or_else(|| vec![64 << 10, 256 << 10, 2 << 20]);
    let transports = std::env::var("TARN_BENCH_TRANSPORTS").unwrap_or_else(|_| "shm,tcp".into());
    for size in sizes {
        let blocks = (working_set / size).max(BATCH);
        let batches = blocks / BATCH;
        // Source data: one distinct buffer per block.
        let src: Vec<Vec<u8>> = (0..blocks)
            .map(|i| vec![(i % 251) as u8 ^ 0x5a; size])
            .collect();
        // Destination: page-aligned, like a registered buffer or a tensor.
        let mut reg = tarn_client::RegisteredBuffer::new(BATCH * size).expect("buffer");
        let mut dst: Vec<&mut [u8]> = reg.as_mut_slice().chunks_mut(size).collect();
        let label = format!("{}KiB", size >> 10);

        // memcpy of the same bytes, batch by batch.
        let mut lat = Lat(Vec::new());
        let (mut bytes, start) = (0u64, Instant::now());
        let mut b = 0;
        while start.elapsed() < phase {
            let t = Instant::now();
            for (j, d) in dst.iter_mut().enumerate() {
                d.copy_from_slice(&src[(b % batches) * BATCH + j]);
            }
            std::hint::black_box(&dst);
            lat.0.push(t.elapsed().as_nanos() as u64);
            bytes += (BATCH * size) as u64;
            b += 1;
        }
        row(
            &format!("memcpy {label} x{BATCH}"),
            bytes,
            start.elapsed(),
            &mut lat,
        );
        // The same copy with the CRC32C check every get does.
        let mut lat = Lat(Vec::new());
        let (mut bytes, start) = (0u64, Instant::now());
        let mut b = 0;
        while start.elapsed() < phase {
            let t = Instant::now();
            for (j, d) in dst.iter_mut().enumerate() {
                std::hint::black_box(tarn_kv::proto::copy_with_crc(
                    d,
                    &src[(b % batches) * BATCH + j],
                ));
            }
            lat.0.push(t.elapsed().as_nanos() as u64);
            bytes += (BATCH * size) as u64;
            b += 1;
        }
        row(
            &format!("memcpy+crc32c {label} x{BATCH}"),
            bytes,
            start.elapsed(),
            &mut lat,
        );

        for tname in ["shm", "tcp"]
            .into_iter()
            .filter(|t| transports.contains(t))
        {
            let c = clients
                .iter_mut()
                .find(|(n, _)| *n == tname)
                .map(|(_, c)| c)
                .expect("client");
            c.client()
                .set_namespace(format!("bench-{tname}-{label}").as_bytes())
                .expect("namespace");
            // put: the working set once.
            let mut lat = Lat(Vec::new());
            let start = Instant::now();
            for b in 0..batches {
                let items: Vec<PutFrom> = (0..BATCH)
                    .map(|j| PutFrom {
                        digest: digest((b * BATCH + j) as u64),
                        data: &src[b * BATCH + j],
                    })
                    .collect();
                let t = Instant::now();
                let st = c.put_from(&items).expect("put");
                lat.0.push(t.elapsed().as_nanos() as u64);
                assert!(st.iter().all(|s| *s == Status::Ok), "{st:?}");
            }
            row(
                &format!("{tname} put {label} x{BATCH}"),
                (batches * BATCH * size) as u64,
                start.elapsed(),
                &mut lat,
            );
            // get: cycle over the working set, alternating each batch with a
            // memcpy of the same blocks so both see the same machine noise.
            let mut lat = Lat(Vec::new());
            let mut copy_lat = Lat(Vec::new());
            let (mut bytes, start) = (0u64, Instant::now());
            let (mut get_time, mut copy_time) = (Duration::ZERO, Duration::ZERO);
            let mut b = 0;
            while start.elapsed() < phase {
                let base = (b % batches) * BATCH;
                let t = Instant::now();
                for (j, d) in dst.iter_mut().enumerate() {
                    d.copy_from_slice(&src[base + j]);
                }
                std::hint::black_box(&dst);
                let e = t.elapsed();
                copy_time += e;
                copy_lat.0.push(e.as_nanos() as u64);
                let mut reqs: Vec<GetInto> = dst
                    .iter_mut()
                    .enumerate()
                    .map(|(j, d)| GetInto::whole(digest((base + j) as u64), &mut d[..]))
                    .collect();
                let t = Instant::now();
                let out = c.get_into(&mut reqs).expect("get");
                let e = t.elapsed();
                get_time += e;
                lat.0.push(e.as_nanos() as u64);
                assert!(out.iter().all(|o| o.status == Status::Ok));
                bytes += (BATCH * size) as u64;
                b += 1;
            }
            row(
                &format!("{tname} get {label} x{BATCH}"),
                bytes,
                get_time,
                &mut lat,
            );
            row("  memcpy alongside", bytes, copy_time, &mut copy_lat);
            println!(
                "{:<34} {:>7.0} %",
                format!("  {tname} get / memcpy"),
                100.0 * copy_time.as_secs_f64() / get_time.as_secs_f64()
            );
            let all: Vec<[u8; 32]> = (0..blocks as u64).map(digest).collect();
            if size == 64 << 10 {
                // The floor: one round trip with no data.
                let mut lat = Lat(Vec::new());
                let start = Instant::now();
                while start.elapsed() < phase {
                    let t = Instant::now();
                    c.exists(&all[..1]).expect("exists");
                    lat.0.push(t.elapsed().as_nanos() as u64);
                }
                row(
                    &format!("{tname} exists x1 (round trip)"),
                    0,
                    start.elapsed(),
                    &mut lat,
                );
            }
            if size == 256 << 10 {
                // A single block, as an engine loading one block would.
                let mut lat = Lat(Vec::new());
                let (mut bytes, start) = (0u64, Instant::now());
                let mut i = 0u64;
                while start.elapsed() < phase {
                    let mut reqs = [GetInto::whole(digest(i % blocks as u64), &mut dst[0][..])];
                    let t = Instant::now();
                    let out = c.get_into(&mut reqs).expect("get");
                    lat.0.push(t.elapsed().as_nanos() as u64);
                    assert_eq!(out[0].status, Status::Ok);
                    bytes += size as u64;
                    i += 1;
                }
                row(
                    &format!("{tname} get {label} x1"),
                    bytes,
                    start.elapsed(),
                    &mut lat,
                );
            }
            // Make room for the next phase.
            assert!(c
                .delete(&all)
                .expect("delete")
                .iter()
                .all(|s| *s == Status::Ok));
        }
    }
    server.stop();
}
