//! One drive interface, two implementations: every operation gives the same
//! answer on a local drive and on a drive of another node reached over RPC,
//! and failures keep their kind (missing, corrupt, no space, offline).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tarn_cluster::remote::{DriveProvider, DriveService, RemoteDrive};
use tarn_cluster::rpc::client::ClientLimits;
use tarn_cluster::rpc::wire::drive::Failure;
use tarn_cluster::rpc::{serve, Identity, RpcClient, ServerStats};
use tarn_io::AlignedBuf;
use tarn_store::codec::StripeGeometry;
use tarn_store::drive::{self, DriveDb, DrivePaths, ObjectWrite};
use tarn_store::drive_io::{Drive, LocalDrive, ShardPlace};
use tarn_store::format::{
    new_id, BucketRecord, DriveFormat, Id128, Layout, ObjectRecord, Storage, UploadPartRecord,
    VersionMeta,
};
use tarn_store::lock::{LeaseCall, LeaseTable, LockMode};
use tarn_store::shard::ShardError;
use tarn_store::{Durability, StoreError, Versioning};

const SECRET: &[u8] = b"remote-drive-test-secret-123456";

fn local_drive(dir: &std::path::Path) -> (Id128, Arc<LocalDrive>) {
    let id = new_id();
    drive::format_drive(
        dir,
        &DriveFormat {
            deployment_id: [1; 16],
            drive_id: id,
            set_count: 1,
            set_drive_count: 1,
            set_index: 0,
            drive_index: 0,
        },
    )
    .unwrap();
    let db = DriveDb::open(dir).unwrap();
    (
        id,
        Arc::new(LocalDrive::new(
            Arc::new(db),
            DrivePaths {
                root: dir.to_path_buf(),
            },
        )),
    )
}

struct One {
    id: Id128,
    drive: Arc<LocalDrive>,
    offline: bool,
}

impl DriveProvider for One {
    fn epoch(&self) -> u64 {
        1
    }
    fn for_read(&self, id: &Id128) -> Option<Arc<dyn Drive>> {
        self.for_write(id)
    }
    fn for_write(&self, id: &Id128) -> Option<Arc<dyn Drive>> {
        (*id == self.id && !self.offline).then(|| self.drive.clone() as Arc<dyn Drive>)
    }
    fn leases(&self, id: &Id128) -> Option<Arc<LeaseTable>> {
        (*id == self.id).then(|| self.drive.leases().clone())
    }
}

/// A node serving one drive; returns a RemoteDrive to it.
async fn serve_drive(dir: &std::path::Path, offline: bool) -> (RemoteDrive, Arc<LocalDrive>) {
    let (id, local) = local_drive(dir);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (stop, rx) = tokio::sync::watch::channel(false);
    std::mem::forget(stop);
    tokio::spawn(serve(
        listener,
        Identity::new("t", "server", SECRET).unwrap(),
        Arc::new(DriveService {
            provider: One {
                id,
                drive: local.clone(),
                offline,
            },
        }),
        Arc::new(ServerStats::default()),
        rx,
    ));
    let client = Arc::new(RpcClient::new(
        Identity::new("t", "client", SECRET).unwrap(),
        ClientLimits::default(),
    ));
    (
        RemoteDrive::new(
            client,
            &address,
            "server",
            id,
            Arc::new(AtomicU64::new(1)),
            1,
        ),
        local,
    )
}

fn version(n: u8) -> VersionMeta {
    VersionMeta {
        version_id: [n; 16],
        mod_time_ns: n as u64 * 1000,
        delete_marker: false,
        size: 3,
        etag: format!("etag{n}"),
        content_type: "text/plain".into(),
        headers: vec![("cache-control".into(), "no-cache".into())],
        user_metadata: vec![("a".into(), "b".into())],
        tags: Vec::new(),
        checksum: None,
        layout: Layout::single_copy(1 << 20),
        storage: Storage::Inline { crc32c: 7 },
        // Every other version sealed: encrypted records cross the wire too.
        seal: n.is_multiple_of(2).then(|| tarn_store::format::Seal {
            cipher: tarn_store::seal::CIPHER_AES256_GCM_64K,
            salts: vec![[n; 16]],
        }),
        // Every third version locked: format-5 records cross the wire too.
        lock: n
            .is_multiple_of(3)
            .then_some(tarn_store::format::ObjectLock {
                retention: Some(tarn_store::format::Retention {
                    mode: tarn_store::format::LockMode::Compliance,
                    until_ns: 1 << 62,
                }),
                legal_hold: true,
            }),
    }
}

/// The same script of metadata operations; returns what it observed.
async fn metadata_script(d: &dyn Drive) -> Vec<String> {
    let mut seen = Vec::new();
    let b = BucketRecord {
        created_ns: 5,
        durability: Durability::ErasureCoded,
        versioning: Versioning::Enabled,
        object_lock: true,
    };
    d.put_bucket("bkt".into(), b.clone()).await.unwrap();
    d.put_bucket("gone".into(), b).await.unwrap();
    d.delete_bucket("gone".into()).await.unwrap();
    seen.push(format!("{:?}", d.buckets().await.unwrap()));
    seen.push(format!(
        "{:?}",
        d.bucket_has_entries("bkt".into(), true).await.unwrap()
    ));
    for i in 0..2500u32 {
        let w = ObjectWrite {
            record: Some(ObjectRecord {
                versions: vec![version((i % 200) as u8)],
                stamp: 1 + i as u64,
            }),
            inline_put: vec![(
                [(i % 200) as u8; 16],
                (i % 200) as u64 * 1000,
                b"abc".to_vec(),
            )],
            ..Default::default()
        };
        d.write_object("bkt".into(), format!("k/{i:05}"), Arc::new(w))
            .await
            .unwrap();
    }
    seen.push(format!(
        "{:?}",
        d.object("bkt".into(), "k/00007".into()).await.unwrap()
    ));
    seen.push(format!(
        "{:?}",
        d.object("bkt".into(), "nope".into()).await.unwrap()
    ));
    seen.push(format!(
        "{:?}",
        d.inline_data("bkt".into(), "k/00007".into(), [7; 16], 7000)
            .await
            .unwrap()
    ));
    seen.push(format!(
        "{:?}",
        d.inline_data("bkt".into(), "k/00007".into(), [8; 16], 7000)
            .await
            .unwrap()
    ));
    let page = d
        .list_page("bkt".into(), "k/".into(), Some(b"k/01000".to_vec()), 2000)
        .await
        .unwrap();
    seen.push(format!(
        "{} {:?} {:?}",
        page.len(),
        page.first().map(|e| &e.0),
        page.last().map(|e| &e.0)
    ));
    seen.push(format!(
        "{:?}",
        d.all_object_keys("bkt".into()).await.unwrap().len()
    ));
    seen.push(format!(
        "{:?}",
        d.bucket_has_entries("bkt".into(), false).await.unwrap()
    ));
    // A delete.
    d.write_object(
        "bkt".into(),
        "k/00000".into(),
        Arc::new(ObjectWrite::default()),
    )
    .await
    .unwrap();
    seen.push(format!(
        "{:?}",
        d.object("bkt".into(), "k/00000".into()).await.unwrap()
    ));
    // Uploads and parts.
    let up = tarn_store::format::UploadRecord {
        upload_id: [9; 16],
        initiated_ns: 1,
        content_type: "x".into(),
        headers: Vec::new(),
        user_metadata: Vec::new(),
        tags: Vec::new(),
        checksum_type: String::new(),
        checksum_algorithm: String::new(),
        layout: Layout::single_copy(1 << 20),
    };
    d.put_upload("bkt".into(), "u".into(), up).await.unwrap();
    for n in 1..=3 {
        d.put_part(
            [9; 16],
            UploadPartRecord {
                number: n,
                size: 10,
                etag: "e".into(),
                data_id: [n as u8; 16],
                mod_time_ns: 3,
                checksum: None,
                salt: (n == 2).then_some([2; 16]),
            },
        )
        .await
        .unwrap();
    }
    seen.push(format!(
        "{:?}",
        d.upload("bkt".into(), "u".into(), [9; 16]).await.unwrap()
    ));
    seen.push(format!("{:?}", d.parts([9; 16]).await.unwrap()));
    seen.push(format!(
        "{:?}",
        d.scan_uploads("bkt".into(), String::new(), 10)
            .await
            .unwrap()
    ));
    let mut ids: Vec<_> = d.referenced_data_ids().await.unwrap().into_iter().collect();
    ids.sort();
    seen.push(format!("{ids:?}"));
    d.delete_upload("bkt".into(), "u".into(), [9; 16], vec![1, 2, 3])
        .await
        .unwrap();
    seen.push(format!(
        "{:?}",
        d.upload("bkt".into(), "u".into(), [9; 16]).await.unwrap()
    ));
    seen.push(format!("{:?}", d.parts([9; 16]).await.unwrap()));
    // Bulk.
    let items: Vec<_> = (0..300)
        .map(|i| {
            (
                format!("bulk/{i}"),
                ObjectRecord {
                    versions: vec![version(1)],
                    stamp: 1,
                }
                .encode(),
                Some(([1; 16], 1000, vec![i as u8; 10])),
            )
        })
        .collect();
    d.write_objects_bulk("bkt".into(), Arc::new(items), 100..250)
        .await
        .unwrap();
    // Records are ordered by their stamps; a deleted key keeps a tombstone,
    // and a refusal keeps its kind across the wire.
    let write = |rec: ObjectRecord| {
        d.write_object(
            "bkt".into(),
            "stamped".into(),
            Arc::new(ObjectWrite {
                record: Some(rec),
                ..Default::default()
            }),
        )
    };
    write(ObjectRecord {
        versions: vec![version(3)],
        stamp: 50,
    })
    .await
    .unwrap();
    write(ObjectRecord::tombstone(60)).await.unwrap();
    seen.push(format!(
        "{:?}",
        d.object("bkt".into(), "stamped".into()).await.unwrap()
    ));
    let late = write(ObjectRecord {
        versions: vec![version(4)],
        stamp: 55,
    })
    .await
    .unwrap_err();
    assert!(
        matches!(late, StoreError::Superseded { held: 60, offered: 55, ref what, .. } if what == "bkt/stamped"),
        "{late:?}"
    );
    let page = d
        .list_page("bkt".into(), "bulk/".into(), None, 1000)
        .await
        .unwrap();
    seen.push(format!("{}", page.len()));
    seen
}

#[tokio::test]
async fn metadata_operations_answer_the_same_on_both_implementations() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (_, local) = local_drive(a.path());
    let (remote, _) = serve_drive(b.path(), false).await;
    let here = metadata_script(&*local).await;
    let there = metadata_script(&remote).await;
    assert_eq!(here, there);
    assert!(here.iter().any(|s| s.starts_with("1500 ")), "{here:?}");
}

/// Three 4 KiB blocks, block j filled with j + 1.
async fn write_blocks(mut w: Box<dyn tarn_store::drive_io::ShardSink>) {
    for j in 0..3u8 {
        let mut b = AlignedBuf::with_capacity(4096);
        b.extend_from_slice(&[j + 1; 4096]);
        w.write_block(b).await.0.unwrap();
    }
    w.finish().await.unwrap();
}

#[tokio::test]
async fn shard_files_round_trip_and_damage_keeps_its_kind() {
    let dir = tempfile::tempdir().unwrap();
    let (remote, local) = serve_drive(dir.path(), false).await;
    // 3 stripes of 8 KiB with k = 2: blocks of 4 KiB.
    let g = StripeGeometry::new(24 << 10, 8 << 10, 2);
    let data_id = new_id();
    let w = remote
        .create_shard(data_id, 1, ShardPlace::Final)
        .await
        .unwrap();
    write_blocks(w).await;
    // Written on the serving node: its own reader checks it.
    local
        .open_shard(data_id, g)
        .await
        .unwrap()
        .verify_all(1)
        .await
        .unwrap();
    let mut r = remote.open_shard(data_id, g).await.unwrap();
    r.load_checksums(0, 2).await.unwrap();
    for j in [0u64, 1, 2, 1] {
        let (res, buf) = r.read_block(j, AlignedBuf::with_capacity(4096)).await;
        res.unwrap();
        assert!(buf.iter().all(|&x| x == j as u8 + 1), "block {j}");
    }
    r.verify_all(1).await.unwrap();
    assert!(matches!(
        r.verify_all(0).await,
        Err(ShardError::BadFooter(_))
    ));
    // A flipped byte in block 1 is caught on the serving node.
    let path = local.paths.shard(&data_id);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[4096 + 10] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let mut r = remote.open_shard(data_id, g).await.unwrap();
    r.load_checksums(0, 2).await.unwrap();
    let (res, _) = r.read_block(0, AlignedBuf::with_capacity(4096)).await;
    res.unwrap();
    let (res, _) = r.read_block(1, AlignedBuf::with_capacity(4096)).await;
    assert!(
        matches!(res, Err(ShardError::Corrupt { block: 1 })),
        "{res:?}"
    );
    // A truncated one, a missing one.
    std::fs::write(&path, &bytes[..100]).unwrap();
    assert!(matches!(
        remote.open_shard(data_id, g).await.err().unwrap(),
        ShardError::WrongLength { actual: 100, .. }
    ));
    remote.remove_shards(vec![data_id]).await;
    assert!(!path.exists());
    assert!(matches!(
        remote.open_shard(data_id, g).await.err().unwrap(),
        ShardError::Missing
    ));
    // A rebuilt shard goes to tmp, then into place.
    let tmp = new_id();
    let w = remote.create_shard(tmp, 1, ShardPlace::Tmp).await.unwrap();
    write_blocks(w).await;
    assert!(!path.exists());
    remote.commit_shard(tmp, data_id).await.unwrap();
    remote
        .open_shard(data_id, g)
        .await
        .unwrap()
        .verify_all(1)
        .await
        .unwrap();
}

#[tokio::test]
async fn a_drive_out_of_service_or_a_node_away_is_an_error_of_that_drive() {
    let dir = tempfile::tempdir().unwrap();
    let (remote, _) = serve_drive(dir.path(), true).await;
    match remote.object("b".into(), "k".into()).await {
        Err(StoreError::Drive { reason, .. }) => {
            assert!(reason.contains("not in service"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        remote
            .open_shard(new_id(), StripeGeometry::new(10, 4096, 1))
            .await
            .err()
            .unwrap(),
        ShardError::Missing
    ));
    let gone = RemoteDrive::new(
        Arc::new(RpcClient::new(
            Identity::new("t", "client", SECRET).unwrap(),
            ClientLimits::default(),
        )),
        "127.0.0.1:1",
        "server",
        new_id(),
        Arc::new(AtomicU64::new(1)),
        1,
    );
    // A node that does not answer: an error naming the drive, of the kind
    // the store takes for a node away (out of use, not faulty).
    match gone.buckets().await {
        Err(StoreError::Io(e)) => {
            assert_eq!(e.kind(), std::io::ErrorKind::NotConnected, "{e}");
            assert!(e.to_string().contains("node server"), "{e}");
        }
        other => panic!("{other:?}"),
    }
}

/// A node whose drive the map of epoch 2 places: it serves the drive once
/// it has taken that epoch, a moment after the caller applied the map.
struct PlacedAt2 {
    id: Id128,
    drive: Arc<LocalDrive>,
    epoch: Arc<AtomicU64>,
}

impl DriveProvider for PlacedAt2 {
    fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }
    fn for_read(&self, id: &Id128) -> Option<Arc<dyn Drive>> {
        self.for_write(id)
    }
    fn for_write(&self, id: &Id128) -> Option<Arc<dyn Drive>> {
        (*id == self.id && self.epoch() >= 2).then(|| self.drive.clone() as Arc<dyn Drive>)
    }
    fn leases(&self, id: &Id128) -> Option<Arc<LeaseTable>> {
        (*id == self.id).then(|| self.drive.leases().clone())
    }
}

/// A caller that uses a drive the map of epoch 2 placed, in the moment
/// before it takes epoch 2 itself, asks with epoch 2: the drive's node
/// waits until it serves that map instead of answering that the drive is
/// not in service (which took the drive out of the caller's view, and a
/// whole new pool with it, during a pool add).
#[tokio::test]
async fn a_drive_placed_by_a_newer_map_is_asked_with_that_map_s_epoch() {
    let dir = tempfile::tempdir().unwrap();
    let (id, local) = local_drive(dir.path());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let (stop, rx) = tokio::sync::watch::channel(false);
    std::mem::forget(stop);
    let served_epoch = Arc::new(AtomicU64::new(1));
    tokio::spawn(serve(
        listener,
        Identity::new("t", "server", SECRET).unwrap(),
        Arc::new(DriveService {
            provider: PlacedAt2 {
                id,
                drive: local,
                epoch: served_epoch.clone(),
            },
        }),
        Arc::new(ServerStats::default()),
        rx,
    ));
    let client = Arc::new(RpcClient::new(
        Identity::new("t", "client", SECRET).unwrap(),
        ClientLimits::default(),
    ));
    let callers_epoch = Arc::new(AtomicU64::new(1));
    let placed = RemoteDrive::new(
        client.clone(),
        &address,
        "server",
        id,
        callers_epoch.clone(),
        2,
    );
    let as_before = RemoteDrive::new(client, &address, "server", id, callers_epoch, 1);
    // Asked as the old map's: not in service there yet.
    match as_before.buckets().await {
        Err(StoreError::Drive { reason, .. }) => {
            assert!(reason.contains("not in service"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
    let bump = {
        let e = served_epoch.clone();
        tokio::spawn(async move {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
            e.store(2, Ordering::Release);
        })
    };
    // Asked with the placing map's epoch: answered once the node has it.
    placed
        .buckets()
        .await
        .expect("the drive answers once its node serves epoch 2");
    bump.await.unwrap();
}

/// Locks and pins through RPC land in the drive's own lease table: a lock
/// taken by another node excludes this node's, a drive out of service still
/// votes, and data a remote reader pinned stays until it releases.
#[tokio::test]
async fn lease_calls_reach_the_drive_s_own_table() {
    let dir = tempfile::tempdir().unwrap();
    let (remote, local) = serve_drive(dir.path(), false).await;
    let acquire = |owner: u8, mode| LeaseCall::Acquire {
        owner: [owner; 16],
        items: vec![(42, mode)],
        ttl_ms: 10_000,
    };
    assert!(remote.lease(acquire(1, LockMode::Write)).await.unwrap());
    assert!(!local.lease(acquire(2, LockMode::Read)).await.unwrap());
    assert!(remote
        .lease(LeaseCall::Release { owner: [1; 16] })
        .await
        .unwrap());
    assert!(local.lease(acquire(2, LockMode::Read)).await.unwrap());
    assert!(!remote.lease(acquire(3, LockMode::Write)).await.unwrap());
    // A call the table refuses is an error, not a refusal.
    assert!(remote
        .lease(LeaseCall::Refresh {
            owner: [2; 16],
            ttl_ms: 0
        })
        .await
        .is_err());

    let id = new_id();
    let path = local.paths.shard(&id);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, b"x").unwrap();
    assert!(remote
        .lease(LeaseCall::Pin {
            owner: [4; 16],
            data_ids: vec![id],
            ttl_ms: 10_000
        })
        .await
        .unwrap());
    local.remove_shards(vec![id]).await;
    assert!(path.exists());
    remote
        .lease(LeaseCall::Release { owner: [4; 16] })
        .await
        .unwrap();
    assert!(!path.exists());

    let dir = tempfile::tempdir().unwrap();
    let (offline, _) = serve_drive(dir.path(), true).await;
    assert!(offline.lease(acquire(5, LockMode::Write)).await.unwrap());
}

#[test]
fn failures_keep_their_kind_across_the_wire() {
    let enospc = std::io::Error::from_raw_os_error(libc_enospc());
    let f = Failure::from_message(&Failure::of_io(&enospc).to_message());
    assert_eq!(f.clone().into_io().raw_os_error(), Some(libc_enospc()));
    assert!(matches!(
        Failure::from_message(&Failure::of_store(&StoreError::IndexCorrupt {
            drive: "d".into(),
            reason: "bad block | with a bar".into()
        })
        .to_message())
        .into_store("x"),
        StoreError::IndexCorrupt { reason, .. } if reason == "bad block | with a bar"
    ));
    for e in [
        ShardError::Missing,
        ShardError::Corrupt { block: 77 },
        ShardError::WrongLength {
            expected: 5,
            actual: 4,
        },
    ] {
        let back = Failure::from_message(&Failure::of_shard(&e).to_message()).into_shard();
        assert_eq!(format!("{back:?}"), format!("{e:?}"));
    }
    assert_eq!(
        Failure::from_message("plain text"),
        Failure::Other("plain text".into())
    );
}

fn libc_enospc() -> i32 {
    28
}

#[tokio::test]
async fn a_forged_geometry_is_refused_and_the_node_serves_on() {
    // A part size whose shard file length would overflow: refused when
    // the request is decoded, before any length is computed from it.
    let dir = tempfile::tempdir().unwrap();
    let (remote, _) = serve_drive(dir.path(), false).await;
    let forged = StripeGeometry {
        part_size: u64::MAX,
        stripe_size: 4096,
        data_shards: 1,
    };
    assert!(remote.open_shard(new_id(), forged).await.is_err());
    assert!(remote.buckets().await.unwrap().is_empty());
}
