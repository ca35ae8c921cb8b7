//! Engine benchmarks: put/get of 4 KiB, 1 MiB and 64 MiB objects on a 4-drive
//! 2+2 store, and listing pages out of a bucket of 1,000,000 objects.
//!
//! `cargo bench -p tarn-store --bench engine [-- --quick]`. Drives live under
//! $TARN_BENCH_DIR (default: the system temp dir). Results go to stdout; the
//! recorded numbers are in docs/benchmarks.md.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tarn_store::{ByteRange, Durability, ListParams, ObjectBody, PutOptions, Store, StoreConfig};

struct Stats {
    latencies: Vec<Duration>,
    bytes: u64,
    wall: Duration,
}

impl Stats {
    fn report(&mut self, name: &str) {
        self.latencies.sort();
        let q = |p: f64| {
            self.latencies
                [((self.latencies.len() as f64 * p) as usize).min(self.latencies.len() - 1)]
        };
        let ops = self.latencies.len() as f64 / self.wall.as_secs_f64();
        println!(
            "{name:<34} {:>8} ops  {:>10.1} ops/s  {:>9.1} MB/s  p50 {:>9.3} ms  p99 {:>9.3} ms",
            self.latencies.len(),
            ops,
            self.bytes as f64 / self.wall.as_secs_f64() / 1e6,
            q(0.50).as_secs_f64() * 1e3,
            q(0.99).as_secs_f64() * 1e3
        );
    }
}

fn body(len: usize) -> Vec<u8> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

async fn run_concurrent<F, Fut>(count: usize, concurrency: usize, bytes_each: u64, f: F) -> Stats
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let next = std::cell::Cell::new(0usize);
    let lat = std::cell::RefCell::new(Vec::with_capacity(count));
    let start = Instant::now();
    let workers = (0..concurrency).map(|_| async {
        loop {
            let i = next.get();
            if i >= count {
                break;
            }
            next.set(i + 1);
            let t = Instant::now();
            f(i).await;
            lat.borrow_mut().push(t.elapsed());
        }
    });
    futures::future::join_all(workers).await;
    Stats {
        latencies: lat.into_inner(),
        bytes: bytes_each * count as u64,
        wall: start.elapsed(),
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let base = std::env::var_os("TARN_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(base).expect("bench dir");
    let drives: Vec<_> = (0..4).map(|i| dir.path().join(format!("d{i}"))).collect();
    let store = Store::open(StoreConfig {
        drives,
        ..Default::default()
    })
    .expect("open");
    println!(
        "engine bench: 4 drives, erasure 2+2, stripe 1 MiB, io_uring, one core; dir {}",
        dir.path().display()
    );
    std::thread::spawn(move || {
        let rt = tarn_io::runtime::build_core_runtime(0, false, true).expect("runtime");
        rt.block_on(bench(store, quick));
    })
    .join()
    .expect("bench thread");
}

async fn bench(store: Arc<Store>, quick: bool) {
    store
        .create_bucket("bench", Durability::ErasureCoded)
        .await
        .unwrap();
    let scale = if quick { 10 } else { 1 };
    for (label, size, count, conc) in [
        ("4 KiB", 4usize << 10, 2000 / scale, 8usize),
        ("1 MiB", 1 << 20, 400 / scale, 8),
        ("64 MiB", 64 << 20, (20 / scale).max(2), 2),
    ] {
        let data = bytes::Bytes::from(body(size));
        let s = store.clone();
        let d = data.clone();
        let mut put = run_concurrent(count, conc, size as u64, |i| {
            let (s, d) = (s.clone(), d.clone());
            async move {
                s.put_object(
                    "bench",
                    &format!("{label}/{i}"),
                    ObjectBody::from_bytes(d),
                    PutOptions::default(),
                )
                .await
                .unwrap();
            }
        })
        .await;
        put.report(&format!("put {label} (concurrency {conc})"));
        let s = store.clone();
        let mut get = run_concurrent(count, conc, size as u64, |i| {
            let s = s.clone();
            async move {
                let got = s
                    .get_object("bench", &format!("{label}/{i}"), None, None, None)
                    .await
                    .unwrap();
                let n = got.stream.collect().await.unwrap().len();
                assert_eq!(n, size);
            }
        })
        .await;
        get.report(&format!("get {label} (concurrency {conc})"));
        if size >= 1 << 20 {
            let s = store.clone();
            let mut ranged = run_concurrent(count, conc, 4096, |i| {
                let s = s.clone();
                async move {
                    let r = ByteRange::Closed((size / 2) as u64, (size / 2 + 4095) as u64);
                    let got = s
                        .get_object("bench", &format!("{label}/{i}"), None, Some(r), None)
                        .await
                        .unwrap();
                    assert_eq!(got.stream.collect().await.unwrap().len(), 4096);
                }
            })
            .await;
            ranged.report(&format!("get 4 KiB range of {label}"));
        }
    }

    // Listing: a bucket of 1,000,000 objects (100,000 with --quick).
    let total = if quick { 100_000 } else { 1_000_000 };
    store
        .create_bucket("many", Durability::ErasureCoded)
        .await
        .unwrap();
    let t = Instant::now();
    let keys: Vec<String> = (0..total)
        .map(|i| {
            format!(
                "ckpt/step-{:04}/shard-{:05}.safetensors",
                i / 1000,
                i % 1000
            )
        })
        .collect();
    store.bulk_load_inline("many", keys, b"x").await.unwrap();
    println!(
        "bulk-loaded {total} objects in {:.1} s",
        t.elapsed().as_secs_f64()
    );
    for (name, params) in [
        (
            "list 1000 keys, first page",
            ListParams {
                max_keys: 1000,
                ..Default::default()
            },
        ),
        (
            "list 1000 keys, middle (start-after)",
            ListParams {
                max_keys: 1000,
                after: Some(format!(
                    "ckpt/step-{:04}/shard-00500.safetensors",
                    total / 2000
                )),
                ..Default::default()
            },
        ),
        (
            "list 1000 keys under a prefix",
            ListParams {
                max_keys: 1000,
                prefix: format!("ckpt/step-{:04}/", total / 3000),
                ..Default::default()
            },
        ),
        (
            "list 1000 common prefixes (delimiter)",
            ListParams {
                max_keys: 1000,
                prefix: "ckpt/".into(),
                delimiter: Some("/".into()),
                ..Default::default()
            },
        ),
    ] {
        let s = store.clone();
        let want = if name.contains("prefixes") {
            (total / 1000).min(1000)
        } else {
            1000
        };
        let mut st = run_concurrent(50, 1, 0, |_| {
            let (s, p) = (s.clone(), params.clone());
            async move {
                let page = s.list_objects("many", p).await.unwrap();
                assert_eq!(page.objects.len() + page.common_prefixes.len(), want);
            }
        })
        .await;
        st.report(name);
    }
}
