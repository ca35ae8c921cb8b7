//! The cost of a permission check (issue 13): `Access::authorize` of a 4 KiB
//! GetObject as root (not judged), as the bucket owner and as a user a
//! bucket policy grants, beside one 4 KiB GET of the engine on the same core
//! (what the check adds to).
//!
//! `cargo bench -p tarn-s3 --bench access [-- --quick]`. Drives live under
//! $TARN_BENCH_DIR (default: the system temp dir). The recorded numbers are
//! in docs/benchmarks.md.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::Instant;

use s3s::path::S3Path;
use tarn_s3::access::{Access, AccessRequest, Ownership};
use tarn_s3::acl::Acl;
use tarn_s3::iam::Iam;
use tarn_store::{Durability, ObjectBody, PutOptions, Store, StoreConfig};

/// The policy of `scripts/bench-permissions`: an Allow for bob conditioned
/// on the source address and a Deny for everyone.
const POLICY: &str = r#"{"Version": "2012-10-17", "Statement": [
  {"Sid": "team", "Effect": "Allow", "Principal": {"AWS": "bob"},
   "Action": ["s3:GetObject", "s3:PutObject", "s3:ListBucket", "s3:DeleteObject"],
   "Resource": ["arn:aws:s3:::polbench", "arn:aws:s3:::polbench/*"],
   "Condition": {"IpAddress": {"aws:SourceIp": "127.0.0.0/8"}}},
  {"Sid": "guard", "Effect": "Deny", "Principal": "*", "Action": "s3:DeleteObject",
   "Resource": "arn:aws:s3:::polbench/keep/*"}]}"#;

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
    println!("access bench: one core, 4 drives, erasure 2+2, 4 KiB objects");
    std::thread::spawn(move || {
        let rt = tarn_io::runtime::build_core_runtime(0, false, true).expect("runtime");
        rt.block_on(bench(store, quick));
    })
    .join()
    .expect("bench thread");
}

async fn bench(store: Arc<Store>, quick: bool) {
    let iam = Iam::new(store.clone(), "tarnadmin", "tarnadmin-secret");
    let access = Access::new(store.clone(), iam.clone());
    access.load().await.expect("load");
    let alice = iam.add_user("alice", None).await.expect("alice").access_key;
    let bob = iam.add_user("bob", None).await.expect("bob").access_key;
    access
        .create_bucket(
            "alice",
            "polbench",
            Durability::ErasureCoded,
            Ownership::BucketOwnerEnforced,
            Acl::private("alice"),
            false,
        )
        .await
        .expect("bucket");
    access
        .update("polbench", |d| {
            d.policy = Some(POLICY.to_string());
            Ok(())
        })
        .await
        .expect("policy");
    let body = bytes::Bytes::from(vec![7u8; 4096]);
    store
        .put_object(
            "polbench",
            "obj/0",
            ObjectBody::from_bytes(body),
            PutOptions::default(),
        )
        .await
        .expect("put");

    // What s3s hands the check for `GET /polbench/obj/0` signed with SigV4.
    let path = S3Path::Object {
        bucket: "polbench".into(),
        key: "obj/0".into(),
    };
    let mut headers = http::HeaderMap::new();
    headers.insert("host", "127.0.0.1:9000".parse().unwrap());
    headers.insert("x-amz-content-sha256", "UNSIGNED-PAYLOAD".parse().unwrap());
    headers.insert("x-amz-date", "20261124T000000Z".parse().unwrap());
    headers.insert(
        "authorization",
        "AWS4-HMAC-SHA256 Credential=K/20261124/us-east-1/s3/aws4_request, \
         SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature=00"
            .parse()
            .unwrap(),
    );
    let peer = Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
    let checks = if quick { 20_000 } else { 400_000 };
    let mut results = Vec::new();
    for (who, key) in [
        ("root (not judged)", "tarnadmin"),
        ("alice (owner, policy evaluated)", alice.as_str()),
        ("bob (granted by the policy)", bob.as_str()),
    ] {
        let r = AccessRequest {
            access_key: Some(key),
            op: "GetObject",
            path: &path,
            headers: &headers,
            query: None,
            peer,
            tls: None,
            existing_tags: None,
        };
        access.authorize(&r).expect("allowed");
        // The best of five runs: the cost without the machine's noise.
        let ns = (0..5)
            .map(|_| {
                let t = Instant::now();
                for _ in 0..checks {
                    let mut ext = http::Extensions::new();
                    ext.insert(black_box(access.authorize(black_box(&r))).unwrap());
                    black_box(&ext);
                }
                t.elapsed().as_nanos() as f64 / checks as f64
            })
            .fold(f64::INFINITY, f64::min);
        results.push((who, ns));
    }
    let gets = if quick { 2_000 } else { 20_000 };
    let get_ns = {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t = Instant::now();
            for _ in 0..gets {
                let got = store
                    .get_object("polbench", "obj/0", None, None, None)
                    .await
                    .unwrap();
                assert_eq!(got.stream.collect().await.unwrap().len(), 4096);
            }
            best = best.min(t.elapsed().as_nanos() as f64 / gets as f64);
        }
        best
    };
    println!(
        "engine GET 4 KiB (one at a time)         {:>9.0} ns",
        get_ns
    );
    for (who, ns) in results {
        println!(
            "check + permit, {who:<33} {ns:>6.0} ns  {:>6.2} % of the engine GET",
            ns / get_ns * 100.0
        );
    }
}
