//! The etcd client against a real etcd (Debian's `etcd-server`, which
//! scripts/test installs; `TARN_ETCD_BIN` names another binary), started on
//! free loopback ports for each test and stopped by its PID.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tarn_cluster::etcd::{Etcd, EtcdError};
use tarn_cluster::membership::Membership;

struct EtcdProc {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for EtcdProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn start_etcd() -> EtcdProc {
    let bin = std::env::var("TARN_ETCD_BIN").unwrap_or_else(|_| "etcd".into());
    let dir = tempfile::tempdir().unwrap();
    let (client, peer) = (free_port(), free_port());
    let url = format!("http://127.0.0.1:{client}");
    let peer_url = format!("http://127.0.0.1:{peer}");
    let child = Command::new(&bin)
        .args([
            "--name",
            "t",
            "--data-dir",
            dir.path().to_str().unwrap(),
            "--listen-client-urls",
            &url,
            "--advertise-client-urls",
            &url,
            "--listen-peer-urls",
            &peer_url,
            "--initial-advertise-peer-urls",
            &peer_url,
            "--initial-cluster",
            &format!("t={peer_url}"),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start {bin} ({e}): install Debian's etcd-server (scripts/test does)")
        });
    let p = EtcdProc {
        child,
        url,
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(p.url.trim_start_matches("http://")).is_err() {
        assert!(Instant::now() < deadline, "etcd did not start");
        std::thread::sleep(Duration::from_millis(50));
    }
    p
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn client(url: &str) -> Etcd {
    Etcd::new(url, Duration::from_secs(5)).unwrap()
}

/// The first calls may land while etcd elects itself: retried briefly.
async fn ready(e: &Etcd) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while e.get("/ready").await.is_err() {
        assert!(Instant::now() < deadline, "etcd does not answer");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn keys_prefixes_and_compare_and_swap() {
    let p = start_etcd();
    rt().block_on(async {
        let e = client(&p.url);
        ready(&e).await;
        assert_eq!(e.get("/tarn/c/map").await.unwrap().0, None);
        let r1 = e.put("/tarn/c/nodes/a", b"A", None).await.unwrap();
        e.put("/tarn/c/nodes/b", b"B", None).await.unwrap();
        e.put("/tarn/c0", b"outside", None).await.unwrap();
        let (kv, _) = e.get("/tarn/c/nodes/a").await.unwrap();
        let kv = kv.unwrap();
        assert_eq!((kv.value.as_slice(), kv.mod_revision), (&b"A"[..], r1));
        let (list, rev) = e.get_prefix("/tarn/c/nodes/").await.unwrap();
        assert_eq!(
            list.iter().map(|k| k.key.as_str()).collect::<Vec<_>>(),
            ["/tarn/c/nodes/a", "/tarn/c/nodes/b"]
        );
        assert!(rev >= r1);

        // Create-if-absent, then two swaps from the same revision: one wins.
        assert!(e
            .compare_and_swap("/tarn/c/map", 0, b"e1", None)
            .await
            .unwrap());
        assert!(!e
            .compare_and_swap("/tarn/c/map", 0, b"again", None)
            .await
            .unwrap());
        let seen = e.get("/tarn/c/map").await.unwrap().0.unwrap().mod_revision;
        let (a, b) = tokio::join!(
            e.compare_and_swap("/tarn/c/map", seen, b"e2-a", None),
            e.compare_and_swap("/tarn/c/map", seen, b"e2-b", None),
        );
        assert!(a.unwrap() ^ b.unwrap(), "exactly one swap wins");
        let now = e.get("/tarn/c/map").await.unwrap().0.unwrap().value;
        assert!(now == b"e2-a" || now == b"e2-b");

        assert!(e.delete("/tarn/c/nodes/a").await.unwrap());
        assert!(!e.delete("/tarn/c/nodes/a").await.unwrap());
    });
}

#[test]
fn leases_keep_keys_only_while_renewed() {
    let p = start_etcd();
    rt().block_on(async {
        let e = client(&p.url);
        ready(&e).await;
        let (lease, ttl) = e.lease_grant(2).await.unwrap();
        assert_eq!(ttl, 2);
        e.put("/tarn/c/members/a", b"up", Some(lease))
            .await
            .unwrap();
        // Renewed: still there after more than its TTL.
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            assert!(e.lease_keep_alive(lease).await.unwrap() > 0);
        }
        let kv = e.get("/tarn/c/members/a").await.unwrap().0.unwrap();
        assert_eq!(kv.lease, lease);
        // Not renewed: gone, and the lease reports itself expired.
        let deadline = Instant::now() + Duration::from_secs(10);
        while e.get("/tarn/c/members/a").await.unwrap().0.is_some() {
            assert!(Instant::now() < deadline, "the key outlived its lease");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        assert_eq!(e.lease_keep_alive(lease).await.unwrap(), 0);
        // Revoked: gone at once.
        let (lease, _) = e.lease_grant(30).await.unwrap();
        e.put("/tarn/c/members/b", b"up", Some(lease))
            .await
            .unwrap();
        e.lease_revoke(lease).await.unwrap();
        assert_eq!(e.get("/tarn/c/members/b").await.unwrap().0, None);
        e.lease_revoke(lease).await.unwrap();
    });
}

#[test]
fn unreachable_endpoints_fail_and_the_next_one_answers() {
    let p = start_etcd();
    let dead = format!("http://127.0.0.1:{}", free_port());
    rt().block_on(async {
        let e = Etcd::new(&dead, Duration::from_secs(1)).unwrap();
        match e.get("/x").await {
            Err(EtcdError::Unreachable { reason, .. }) => assert!(reason.contains("connect")),
            other => panic!("{other:?}"),
        }
        let both = client(&format!("{dead},{}", p.url));
        ready(&both).await;
        both.put("/x", b"1", None).await.unwrap();
        assert_eq!(both.get("/x").await.unwrap().0.unwrap().value, b"1");
        // etcd's own refusals are errors, not retries: a lease that does
        // not exist cannot carry a key.
        match both.put("/y", b"1", Some(12345)).await {
            Err(EtcdError::Refused { message, .. }) => {
                assert!(message.contains("lease not found"), "{message}")
            }
            other => panic!("{other:?}"),
        }
    });
}

async fn wait_for(what: &str, mut cond: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn membership_holds_renews_rejoins_and_lapses() {
    let mut p = start_etcd();
    let rt = rt();
    let e = client(&p.url);
    rt.block_on(ready(&e));
    let key = "/tarn/c/members/a".to_string();
    let m = Membership::start(e.clone(), key.clone(), b"up".to_vec(), 2).unwrap();
    rt.block_on(async {
        wait_for("it is a member", async || m.is_member()).await;
        let first = e.get(&key).await.unwrap().0.unwrap().lease;
        // Held past several TTLs.
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(m.is_member());
        assert_eq!(e.get(&key).await.unwrap().0.unwrap().lease, first);
        // Its lease taken away: it registers again on a new one.
        e.lease_revoke(first).await.unwrap();
        wait_for("it registered again", async || {
            e.get(&key)
                .await
                .unwrap()
                .0
                .is_some_and(|kv| kv.lease != first)
        })
        .await;
    });
    // Stopped: the key goes at once (the lease is revoked).
    m.stop();
    rt.block_on(async { assert_eq!(e.get(&key).await.unwrap().0, None) });
    // etcd gone: the node stops counting itself a member within its TTL.
    let m = Membership::start(e.clone(), key, b"up".to_vec(), 2).unwrap();
    rt.block_on(async {
        wait_for("it is a member", async || m.is_member()).await;
        let _ = p.child.kill();
        let _ = p.child.wait();
        wait_for("it is no longer a member", async || !m.is_member()).await;
    });
    drop(m);
}
