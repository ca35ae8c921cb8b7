//! `tarn server --kv` as users run it: the real binary, the real client over
//! shared memory and TCP, /metrics, SIGTERM, and a restart on the NVMe tier.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};

use tarn_client::{
    BlockingKvClient, ConnectOptions, GetInto, PutFrom, Status, TransportChoice, TransportKind,
};

struct Daemon {
    child: Child,
    kv: String,
    admin: String,
}

fn start(dir: &std::path::Path) -> Daemon {
    let mut child = Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args([
            "server",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--cores",
            "2",
        ])
        .arg("--drive")
        .arg(dir.join("data"))
        .args([
            "--kv",
            "--kv-listen",
            "127.0.0.1:0",
            "--kv-memory",
            "16MiB",
            "--kv-value-max",
            "256KiB",
        ])
        .arg("--kv-disk")
        .arg(dir.join("kv"))
        .args(["--kv-disk-size", "64MiB"])
        .env_remove("TARN_ACCESS_KEY")
        .env_remove("TARN_SECRET_KEY")
        .stdout(Stdio::piped())
        .spawn()
        .expect("start tarn");
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut kv, mut admin) = (None, None);
    while kv.is_none() || admin.is_none() {
        let line = lines.next().expect("tarn exited early").unwrap();
        if let Some(e) = line.strip_prefix("KV endpoint: ") {
            kv = Some(e.split_whitespace().next().unwrap().to_string());
        }
        if let Some(e) = line.strip_prefix("Admin endpoint: http://") {
            admin = Some(e.split_whitespace().next().unwrap().to_string());
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Daemon {
        child,
        kv: kv.unwrap(),
        admin: admin.unwrap(),
    }
}

impl Daemon {
    fn client(&self, choice: TransportChoice) -> BlockingKvClient {
        BlockingKvClient::connect(
            &self.kv,
            ConnectOptions {
                transport: choice,
                namespace: b"model/f32/bs32".to_vec(),
                ..Default::default()
            },
        )
        .unwrap()
    }

    fn metrics(&self) -> String {
        let mut s = std::net::TcpStream::connect(&self.admin).unwrap();
        // With the admin token (the built-in secret key): tenants and
        // namespaces are named only for it.
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tarnadmin-secret\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    }

    /// SIGTERM by PID; returns the exit status.
    fn terminate(mut self) -> std::process::ExitStatus {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().unwrap()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn digest(i: u64) -> [u8; 32] {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.to_le_bytes());
    d[31] = 0xa5;
    d
}

fn value(i: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u64 * 31 + i * 7 + (j as u64 >> 9)) as u8)
        .collect()
}

/// Abstract Unix sockets of a process, from /proc/net/unix.
fn kv_sockets(pid: u32) -> usize {
    let text = std::fs::read_to_string("/proc/net/unix").unwrap();
    let needle = format!("@tarn-kv.{pid}.");
    text.lines().filter(|l| l.contains(&needle)).count()
}

#[test]
fn kv_daemon_serves_both_transports_and_keeps_nvme_blocks_across_restart() {
    let dir = tempfile::tempdir().unwrap();
    let len = 200 << 10;
    let d = start(dir.path());
    let pid = d.child.id();
    assert!(kv_sockets(pid) >= 1, "no shared-memory socket");
    let shm_files_before = std::fs::read_dir("/dev/shm")
        .map(|r| r.count())
        .unwrap_or(0);
    let mut shm = d.client(TransportChoice::Auto);
    assert_eq!(shm.transport(), TransportKind::Shm);
    let mut tcp = d.client(TransportChoice::Tcp);
    // 200 blocks of 200 KiB through 16 MiB of RAM: most are demoted to NVMe.
    for chunk in (0..200u64).collect::<Vec<_>>().chunks(32) {
        let vals: Vec<Vec<u8>> = chunk.iter().map(|i| value(*i, len)).collect();
        let items: Vec<PutFrom> = chunk
            .iter()
            .zip(&vals)
            .map(|(i, v)| PutFrom {
                digest: digest(*i),
                data: v,
            })
            .collect();
        assert!(shm
            .put_from(&items)
            .unwrap()
            .iter()
            .all(|s| *s == Status::Ok));
    }
    for i in [0u64, 100, 199] {
        let mut buf = vec![0u8; len];
        let out = tcp
            .get_into(&mut [GetInto::whole(digest(i), &mut buf)])
            .unwrap();
        assert_eq!(out[0].status, Status::Ok);
        assert_eq!(buf, value(i, len));
    }
    let m = d.metrics();
    assert!(
        m.contains("tarn_kv_evicted_demoted{tenant=\"default\"} "),
        "{m}"
    );
    assert!(
        m.contains("tarn_kv_namespace{tenant=\"default\",namespace=\"model/f32/bs32\",counter=\"puts_stored\"} 200"),
        "{m}"
    );
    assert_eq!(
        std::fs::read_dir("/dev/shm")
            .map(|r| r.count())
            .unwrap_or(0),
        shm_files_before,
        "the arena must not be a named file"
    );

    drop(shm);
    drop(tcp);
    let status = d.terminate();
    assert!(status.success(), "{status:?}");
    assert_eq!(kv_sockets(pid), 0, "shared-memory socket left behind");

    // Restart on the same NVMe tier: blocks that were demoted are still there.
    let d = start(dir.path());
    let mut c = d.client(TransportChoice::Auto);
    let present = c
        .exists(&(0..200).map(digest).collect::<Vec<_>>())
        .unwrap()
        .present;
    let kept: Vec<u64> = (0..200).filter(|i| present[*i as usize]).collect();
    assert!(kept.len() >= 100, "only {} blocks survived", kept.len());
    for i in kept {
        let mut buf = vec![0u8; len];
        let out = c
            .get_into(&mut [GetInto::whole(digest(i), &mut buf)])
            .unwrap();
        assert_eq!(out[0].status, Status::Ok, "block {i}");
        assert_eq!(buf, value(i, len), "block {i}");
    }
}

/// Runs `tarn bench kv` with `args`; returns its exit status and stdout.
fn bench_kv(d: &Daemon, args: &[&str]) -> (std::process::ExitStatus, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args(["bench", "kv", "--endpoint", &d.kv, "--json"])
        .args(args)
        .output()
        .expect("run tarn bench kv");
    (
        out.status,
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// A number field of the bench's one-line JSON report.
fn json_number(json: &str, field: &str) -> f64 {
    let at = json
        .find(&format!("\"{field}\":"))
        .unwrap_or_else(|| panic!("no {field} in {json}"));
    let rest = &json[at + field.len() + 3..];
    let end = rest.find([',', '}']).unwrap();
    rest[..end].parse().unwrap()
}

#[test]
fn bench_kv_runs_against_the_daemon_and_verifies_what_it_reads() {
    let dir = tempfile::tempdir().unwrap();
    let d = start(dir.path());
    for transport in ["shm", "tcp"] {
        for op in ["get", "exists", "put", "mixed"] {
            let (status, out) = bench_kv(
                &d,
                &[
                    "--transport",
                    transport,
                    "--op",
                    op,
                    "--block-size",
                    "64KiB",
                    "--batch",
                    "8",
                    "--working-set",
                    "4MiB",
                    "--count",
                    "40",
                    "--verify",
                ],
            );
            assert!(status.success(), "{transport} {op}: {out}");
            assert!(
                out.contains(&format!("\"transport\":\"{transport}\"")),
                "{out}"
            );
            assert_eq!(json_number(&out, "batches"), 40.0, "{out}");
            assert_eq!(json_number(&out, "verify_failures"), 0.0, "{out}");
            assert!(out.contains("\"errors\":{}"), "{out}");
            if op == "get" || op == "exists" {
                // 4 MiB fits the 16 MiB arena: every lookup hits.
                assert_eq!(json_number(&out, "hit_rate_percent"), 100.0, "{out}");
            }
            if op != "exists" {
                assert!(json_number(&out, "mb_per_sec") > 0.0, "{out}");
            }
        }
    }

    // --compare alternates phases between endpoints (here the same daemon
    // twice) and reports each, with ratios to the first.
    let (status, out) = bench_kv(
        &d,
        &[
            "--compare",
            &d.kv,
            "--rounds",
            "3",
            "--op",
            "get",
            "--block-size",
            "64KiB",
            "--batch",
            "8",
            "--working-set",
            "4MiB",
            "--count",
            "30",
            "--verify",
        ],
    );
    assert!(status.success(), "{out}");
    assert!(
        out.starts_with("{\"rounds\":3,\"endpoints\":[{\"endpoint\":"),
        "{out}"
    );
    assert_eq!(out.matches("\"batches\":30,").count(), 2, "{out}");
    assert!(
        out.contains("\"ratios_to_first\":[{\"batches_per_sec\":"),
        "{out}"
    );

    // Buffers beyond reason are refused up front, not allocated.
    let out = Command::new(env!("CARGO_BIN_EXE_tarn"))
        .args([
            "bench",
            "kv",
            "--endpoint",
            &d.kv,
            "--block-size",
            "1GiB",
            "--batch",
            "1000000",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--batch must stay within"));

    // --verify catches wrong bytes: store other bytes under the keys the
    // bench's working set uses (its namespace and key layout, mirrored here)
    // before it runs; write-once keeps them, and every read must fail.
    let mut c = BlockingKvClient::connect(
        &d.kv,
        ConnectOptions {
            transport: TransportChoice::Tcp,
            namespace: b"tarn-bench/4096".to_vec(),
            ..Default::default()
        },
    )
    .unwrap();
    let bench_key = |i: u64| {
        let mut k = [0u8; 32];
        k[..8].copy_from_slice(&i.to_le_bytes());
        k[8..16].copy_from_slice(&i.wrapping_mul(0xff51_afd7_ed55_8ccd).to_le_bytes());
        k[24..32].copy_from_slice(b"tarnbnch");
        k
    };
    let wrong = vec![0x42u8; 4096];
    for i in 0..8 {
        let st = c
            .put_from(&[PutFrom {
                digest: bench_key(i),
                data: &wrong,
            }])
            .unwrap();
        assert_eq!(st, vec![Status::Ok]);
    }
    let (status, out) = bench_kv(
        &d,
        &[
            "--op",
            "get",
            "--block-size",
            "4KiB",
            "--batch",
            "8",
            "--working-set",
            "32KiB",
            "--count",
            "5",
            "--verify",
        ],
    );
    assert!(!status.success(), "wrong bytes passed verification: {out}");
    assert_eq!(json_number(&out, "verify_failures"), 40.0, "{out}");
}
