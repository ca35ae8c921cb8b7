//! The KV server's part of cluster routing, on a real server in this
//! process: CLUSTER answers the view it routes by, a batch routed by an
//! older and different view is refused (`NotOwner`) over both transports
//! and counted, the same members at an older epoch are not, fallback and
//! copy batches are counted, blocks read often come back hot, and batch
//! flags it does not know are refused.

use std::sync::Arc;

use tarn_client::kv::not_owner;
use tarn_client::route::{key_hash, namespace_hash, Ring};
use tarn_client::{BlockingKvClient, ConnectOptions, GetInto, PutFrom, Status, TransportChoice};
use tarn_kv::auth::Credentials;
use tarn_kv::proto::*;
use tarn_kv::{Engine, KvConfig, Server, ServerOptions, Tenants};

fn start() -> (Arc<Engine>, Server) {
    let engine = Engine::open(KvConfig {
        memory_bytes: 32 << 20,
        value_max_bytes: 1 << 20,
        ..KvConfig::default()
    })
    .expect("engine");
    let tenants = Tenants::single(engine.clone(), Credentials::loopback_default());
    let opts = ServerOptions {
        threads: 1,
        ..ServerOptions::default()
    };
    (engine, Server::start(tenants, opts).expect("server"))
}

fn connect(server: &Server, choice: TransportChoice) -> BlockingKvClient {
    let opts = ConnectOptions {
        transport: choice,
        namespace: b"routed".to_vec(),
        ..ConnectOptions::default()
    };
    BlockingKvClient::connect(&server.tcp_addr.to_string(), opts).expect("connect")
}

fn members(weights: &[(&str, u32)]) -> Vec<ViewMember> {
    weights
        .iter()
        .map(|(id, w)| ViewMember {
            id: id.to_string(),
            endpoint: format!("10.0.0.1:{}", 9400 + id.len()),
            weight: *w,
        })
        .collect()
}

fn digest(i: u64) -> Digest {
    let mut d = [0u8; 32];
    d[..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    d
}

fn stat(c: &mut BlockingKvClient, name: &str) -> u64 {
    let s = c.stats().expect("stats");
    s.iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| *v)
        .unwrap_or_else(|| panic!("no counter {name}"))
}

fn put(c: &mut BlockingKvClient, keys: &[u64]) -> tarn_client::kv::Result<Vec<Status>> {
    let vals: Vec<Vec<u8>> = keys.iter().map(|k| vec![*k as u8; 300]).collect();
    let items: Vec<PutFrom<'_>> = keys
        .iter()
        .zip(&vals)
        .map(|(k, v)| PutFrom {
            digest: digest(*k),
            data: v,
        })
        .collect();
    c.put_from(&items)
}

#[test]
fn outside_a_cluster_the_view_is_empty_and_routes_are_taken() {
    let (_e, server) = start();
    for choice in [TransportChoice::Tcp, TransportChoice::Shm] {
        let mut c = connect(&server, choice);
        assert_eq!(c.cluster_view().expect("view"), ClusterView::default());
        c.client().set_route(Some(Route { epoch: 5, view: 9 }));
        assert!(put(&mut c, &[1, 2])
            .expect("put")
            .iter()
            .all(|s| s.is_stored()));
    }
}

#[test]
fn stale_routes_are_refused_over_both_transports() {
    let (_e, server) = start();
    for (n, choice) in [TransportChoice::Tcp, TransportChoice::Shm]
        .into_iter()
        .enumerate()
    {
        let epoch = 10 + 100 * n as u64;
        let old = ClusterView::new(epoch, members(&[("a", 1000), ("b", 1000)]), "a");
        let new = ClusterView::new(
            epoch + 2,
            members(&[("a", 1000), ("b", 1000), ("c", 100)]),
            "a",
        );
        server.views.set(old.clone());
        let mut c = connect(&server, choice);
        let view = c.cluster_view().expect("view");
        assert_eq!(view, old);
        assert_eq!(view.this, Some(0));
        c.client().set_route(Some(view.route()));
        let base = 100 * n as u64;
        assert!(put(&mut c, &[base, base + 1])
            .expect("put")
            .iter()
            .all(|s| s.is_stored()));

        // The node moves on: every routed op by the old view is refused,
        // the connection stays usable, and the new view routes again.
        server.views.set(new.clone());
        let e = put(&mut c, &[base + 2, base + 3]).expect_err("stale put");
        assert!(not_owner(&e), "{e}");
        let e = c.exists(&[digest(base)]).expect_err("stale exists");
        assert!(not_owner(&e), "{e}");
        let mut buf = vec![0u8; 300];
        let e = c
            .get_into(&mut [GetInto::whole(digest(base), &mut buf)])
            .expect_err("stale get");
        assert!(not_owner(&e), "{e}");
        let e = c.delete(&[digest(base)]).expect_err("stale delete");
        assert!(not_owner(&e), "{e}");
        c.client().set_route(None);
        assert_eq!(stat(&mut c, "namespace.misses_not_owner"), 5 + 5 * n as u64);
        let fresh = c.cluster_view().expect("view");
        assert_eq!(fresh, new);
        c.client().set_route(Some(fresh.route()));
        assert!(put(&mut c, &[base + 2, base + 3])
            .expect("put")
            .iter()
            .all(|s| s.is_stored()));
        assert_eq!(
            c.exists(&[digest(base)]).expect("exists").present,
            vec![true]
        );

        // The same members published at an older epoch (another node read
        // them earlier) and a newer route than the node's are both taken.
        c.client().set_route(Some(Route {
            epoch: 3,
            view: new.view,
        }));
        assert!(put(&mut c, &[base + 4]).is_ok());
        c.client().set_route(Some(Route {
            epoch: epoch + 50,
            view: 7,
        }));
        assert!(put(&mut c, &[base + 5]).is_ok());
        // An older view never replaces a newer one.
        server.views.set(old.clone());
        assert_eq!(c.cluster_view().expect("view"), new);
    }
}

#[test]
fn fallback_copy_and_hot_blocks_are_counted() {
    let (_e, server) = start();
    for choice in [TransportChoice::Tcp, TransportChoice::Shm] {
        let mut c = connect(&server, choice);
        let base = if choice == TransportChoice::Tcp {
            0
        } else {
            1000
        };
        c.client().set_batch_flags(BATCH_COPY);
        assert_eq!(
            put(&mut c, &[base, base + 1]).expect("copy"),
            vec![Status::Ok; 2]
        );
        c.client().set_batch_flags(BATCH_FALLBACK);
        let mut b1 = vec![0u8; 300];
        let mut b2 = vec![0u8; 300];
        let got = c
            .get_into(&mut [
                GetInto::whole(digest(base), &mut b1),
                GetInto::whole(digest(base + 7), &mut b2),
            ])
            .expect("fallback get");
        assert_eq!(got[0].status, Status::Ok);
        assert_eq!(got[1].status, Status::NotFound);
        c.client().set_batch_flags(0);
        // Read often, a block comes back hot from the read that crosses
        // the threshold on.
        let mut hot = Vec::new();
        for _ in 0..10 {
            let o = c
                .get_into(&mut [GetInto::whole(digest(base + 1), &mut b1)])
                .expect("get");
            hot.push(o[0].hot);
        }
        assert_eq!(
            hot,
            [false, false, false, false, false, false, false, true, true, true]
        );
        let s = c.stats().expect("stats");
        let get = |n: &str| s.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
        assert!(get("namespace.copies_stored").unwrap() >= 2);
        assert!(get("namespace.fallback_gets").unwrap() >= 2);
        assert!(get("namespace.fallback_hits").unwrap() >= 1);
        assert!(get("namespace.hot_marked").unwrap() >= 1);
    }
}

#[test]
fn unknown_batch_flags_are_refused() {
    let (_e, server) = start();
    let mut c = connect(&server, TransportChoice::Tcp);
    c.client().set_batch_flags(0x40);
    let e = put(&mut c, &[1]).expect_err("unknown flag");
    assert!(e.to_string().contains("unknown batch flags"), "{e}");
    let mut c = connect(&server, TransportChoice::Shm);
    c.client().set_batch_flags(0x40);
    let e = c.exists(&[digest(1)]).expect_err("unknown flag");
    assert!(e.to_string().contains("unknown batch flags"), "{e}");
}

#[test]
fn every_client_ranks_a_key_the_same_way() {
    // What a node answers is what every client ranks by: the ranking is a
    // function of the view's members and the key only.
    let v = ClusterView::new(4, members(&[("b", 1000), ("a", 1000), ("c", 250)]), "c");
    let decoded = {
        let mut out = Vec::new();
        v.encode(&mut out);
        ClusterView::decode(&out).expect("decode")
    };
    assert_eq!(decoded, v);
    assert_eq!(decoded.members[0].id, "a", "sorted by id");
    assert_eq!(decoded.this, Some(2));
    let (r1, r2) = (Ring::new(v), Ring::new(decoded));
    let ns = namespace_hash(b"routed");
    for i in 0..1000 {
        let k = key_hash(ns, &digest(i));
        assert_eq!(r1.ranks(k, |_| true), r2.ranks(k, |_| true));
    }
}
