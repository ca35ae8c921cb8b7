//! The object engine end to end on real drive directories.

mod common;

use common::*;
use std::sync::Arc;
use tarn_store::{
    Durability, ListParams, ObjectBody, PutOptions, Store, StoreError, Unchanged, VersionListParams,
};

const MIB: usize = 1 << 20;
const INLINE: usize = 128 << 10;

fn sizes() -> Vec<usize> {
    vec![
        0,
        1,
        INLINE - 1,
        INLINE,
        INLINE + 1,
        MIB - 1,
        MIB,
        MIB + 1,
        2 * MIB + 7,
        5 * MIB + 3,
    ]
}

#[test]
fn round_trips_on_four_drives() {
    let c = Cluster::new(4);
    run(async move {
        let store = c.open();
        assert_eq!(store.erasure_layout(), (2, 2));
        bucket(&store, "bk-b").await;
        for (i, size) in sizes().into_iter().enumerate() {
            let body = data(i as u64, size);
            let key = format!("obj-{size}");
            let info = put(&store, "bk-b", &key, &body).await;
            assert_eq!(info.size, size as u64);
            assert_eq!(get(&store, "bk-b", &key).await, body, "size {size}");
            // Chunked upload with odd chunk sizes and no declared length.
            let key2 = format!("chunked-{size}");
            put_chunked(&store, "bk-b", &key2, &body, 65_537).await;
            assert_eq!(
                get(&store, "bk-b", &key2).await,
                body,
                "chunked size {size}"
            );
            let head = store.head_object("bk-b", &key, None).await.unwrap();
            assert_eq!(head.size, size as u64);
        }
    });
}

#[test]
fn round_trip_100_mib_and_single_drive() {
    let c = Cluster::new(1);
    run(async move {
        let store = c.open();
        assert_eq!(store.erasure_layout(), (1, 0));
        bucket(&store, "bk-big").await;
        let body = data(7, 100 * MIB);
        put_chunked(&store, "bk-big", "x", &body, 1 << 20).await;
        let got = get(&store, "bk-big", "x").await;
        assert!(got == body, "100 MiB round trip");
        for size in sizes() {
            let body = data(size as u64, size);
            put(&store, "bk-big", "s", &body).await;
            assert_eq!(get(&store, "bk-big", "s").await, body);
        }
    });
}

#[test]
fn ranges_at_stripe_boundaries() {
    let c = Cluster::new(4);
    run(async move {
        let store = c.open();
        bucket(&store, "bk-r").await;
        let size = 3 * MIB + 100;
        let body = data(3, size);
        put(&store, "bk-r", "k", &body).await;
        let m = MIB as u64;
        let cases = [
            (0, 0),
            (0, m - 1),
            (m - 1, m),
            (m, m),
            (m - 1, 2 * m),
            (m + 1, 2 * m + 1),
            (2 * m, size as u64 - 1),
            (0, size as u64 + 50),
            (size as u64 - 1, size as u64 - 1),
        ];
        for (a, b) in cases {
            let want = &body[a as usize..=(b as usize).min(size - 1)];
            assert_eq!(
                get_range(&store, "bk-r", "k", a, b).await,
                want,
                "range {a}-{b}"
            );
        }
        let bad = store
            .get_object(
                "bk-r",
                "k",
                None,
                Some(tarn_store::ByteRange::From(size as u64)),
                None,
            )
            .await;
        assert!(matches!(bad, Err(StoreError::InvalidRange)));
        // Inline objects serve ranges too.
        let small = data(4, 1000);
        put(&store, "bk-r", "small", &small).await;
        assert_eq!(
            get_range(&store, "bk-r", "small", 10, 19).await,
            &small[10..20]
        );
    });
}

#[test]
fn reads_survive_lost_drives_and_heal_restores_them() {
    let c = Cluster::new(4);
    let drives = c.drives.clone();
    let sizes = sizes();
    let bodies: Vec<Vec<u8>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| data(100 + i as u64, s))
        .collect();
    {
        let bodies = bodies.clone();
        let store = c.open();
        run(async move {
            bucket(&store, "bk-h").await;
            for (i, b) in bodies.iter().enumerate() {
                put(&store, "bk-h", &format!("k{i}"), b).await;
            }
        });
    }
    // Two of four drives replaced by empty directories: m = 2 losses.
    c.wipe(1);
    c.wipe(3);
    let store = c.open();
    assert!(
        store.drive_status().iter().all(|d| d.online),
        "empty drives are formatted and join"
    );
    let s2 = store.clone();
    let b2 = bodies.clone();
    run(async move {
        for (i, b) in b2.iter().enumerate() {
            assert_eq!(
                &get(&s2, "bk-h", &format!("k{i}")).await,
                b,
                "degraded read of k{i}"
            );
        }
        let report = s2.heal_all().await;
        assert_eq!(report.failures, 0, "{report:?}");
        assert!(
            report.shards_rebuilt > 0 && report.metadata_rewritten > 0,
            "{report:?}"
        );
        // A second heal finds nothing to do.
        let again = s2.heal_all().await;
        assert_eq!(
            (again.shards_rebuilt, again.metadata_rewritten),
            (0, 0),
            "{again:?}"
        );
    });
    drop(store);
    // Now the other two drives go: the healed ones alone must serve everything.
    for i in [0, 2] {
        std::fs::remove_dir_all(&drives[i]).unwrap();
    }
    let store = c.open();
    let offline: Vec<_> = store
        .drive_status()
        .into_iter()
        .filter(|d| !d.online)
        .collect();
    assert_eq!(offline.len(), 2, "missing drives are reported offline");
    assert!(
        !drives[0].exists() && !drives[2].exists(),
        "a missing drive directory is never re-created"
    );
    let b3 = bodies.clone();
    run(async move {
        for (i, b) in b3.iter().enumerate() {
            assert_eq!(
                &get(&store, "bk-h", &format!("k{i}")).await,
                b,
                "read from healed drives of k{i}"
            );
        }
        // Writes need 3 of 4 drives: refused cleanly, nothing visible.
        let err = store
            .put_object(
                "bk-h",
                "new",
                ObjectBody::from_bytes(data(9, 2 * MIB)),
                PutOptions::default(),
            )
            .await;
        assert!(matches!(err, Err(StoreError::QuorumLost { .. })), "{err:?}");
        assert!(store.head_object("bk-h", "new", None).await.is_err());
    });
}

#[test]
fn corrupt_and_truncated_shards_are_rebuilt() {
    let c = Cluster::new(4);
    let store = c.open();
    let body = data(55, 3 * MIB + 5);
    let s = store.clone();
    let b = body.clone();
    run(async move {
        bucket(&s, "bk-c").await;
        put(&s, "bk-c", "k", &b).await;
    });
    // Flip a bit in every shard file of drive 0, truncate those of drive 2.
    for f in c.shard_files(0) {
        let mut bytes = std::fs::read(&f).unwrap();
        bytes[1000] ^= 0x10;
        std::fs::write(&f, bytes).unwrap();
    }
    for f in c.shard_files(2) {
        let len = std::fs::metadata(&f).unwrap().len();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&f)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
    }
    let s = store.clone();
    run(async move {
        assert_eq!(
            get(&s, "bk-c", "k").await,
            body,
            "read despite bit flips and truncation"
        );
        assert_eq!(
            get_range(&s, "bk-c", "k", MIB as u64 - 3, MIB as u64 + 3).await,
            &body[MIB - 3..MIB + 4]
        );
        let report = s.heal_object("bk-c", "k").await.unwrap();
        assert_eq!(report.shards_rebuilt, 2, "{report:?}");
        let again = s.heal_object("bk-c", "k").await.unwrap();
        assert_eq!(again.shards_rebuilt, 0);
        assert_eq!(get(&s, "bk-c", "k").await, body);
    });
    // After healing, each drive's shard verifies on its own: drop the two others.
    drop(store);
    for i in [1, 3] {
        std::fs::remove_dir_all(&c.drives[i]).unwrap();
    }
    let store = c.open();
    run(async move {
        assert_eq!(get(&store, "bk-c", "k").await.len(), 3 * MIB + 5);
    });
}

#[test]
fn listing_matches_a_model() {
    let c = Cluster::new(4);
    let store = c.open();
    run(async move {
        bucket(&store, "bk-l").await;
        let mut model = std::collections::BTreeSet::new();
        for i in 0..300u32 {
            let key = match i % 5 {
                0 => format!("a/{i:04}"),
                1 => format!("a/b/{i:04}"),
                2 => format!("c/{i:04}/x"),
                3 => format!("top{i:04}"),
                _ => format!("d-{i:04}"),
            };
            put(&store, "bk-l", &key, &data(i as u64, (i % 7) as usize * 10)).await;
            model.insert(key);
        }
        // Delete some so listings must skip them.
        for k in model
            .iter()
            .filter(|k| k.ends_with('7'))
            .cloned()
            .collect::<Vec<_>>()
        {
            store.delete_object("bk-l", &k, None).await.unwrap();
            model.remove(&k);
        }
        for (prefix, delimiter) in [
            ("", None),
            ("", Some("/")),
            ("a/", Some("/")),
            ("a/", None),
            ("c/", Some("/")),
            ("zzz", None),
            ("d-", Some("-")),
        ] {
            for page_size in [1usize, 7, 1000] {
                let mut keys = Vec::new();
                let mut prefixes = Vec::new();
                let mut after = None;
                loop {
                    let page = store
                        .list_objects(
                            "bk-l",
                            ListParams {
                                prefix: prefix.into(),
                                delimiter: delimiter.map(String::from),
                                after: after.clone(),
                                max_keys: page_size,
                            },
                        )
                        .await
                        .unwrap();
                    assert!(page.objects.len() + page.common_prefixes.len() <= page_size);
                    keys.extend(page.objects.iter().map(|o| o.key.clone()));
                    prefixes.extend(page.common_prefixes.clone());
                    if !page.is_truncated {
                        break;
                    }
                    after = page.next_after.clone();
                }
                let mut want_keys = Vec::new();
                let mut want_prefixes: Vec<String> = Vec::new();
                for k in model.iter().filter(|k| k.starts_with(prefix)) {
                    let rest = &k[prefix.len()..];
                    match delimiter.and_then(|d| {
                        rest.find(d)
                            .map(|p| format!("{prefix}{}", &rest[..p + d.len()]))
                    }) {
                        Some(cp) => {
                            if want_prefixes.last() != Some(&cp) {
                                want_prefixes.push(cp)
                            }
                        }
                        None => want_keys.push(k.clone()),
                    }
                }
                assert_eq!(
                    keys, want_keys,
                    "keys for prefix {prefix:?} delimiter {delimiter:?} page {page_size}"
                );
                assert_eq!(
                    prefixes, want_prefixes,
                    "prefixes for {prefix:?} {delimiter:?} page {page_size}"
                );
            }
        }
    });
}

#[test]
fn multipart_upload_lifecycle() {
    let c = Cluster::new(4);
    let store = c.open();
    run(async move {
        bucket(&store, "bk-m").await;
        // A live object with the same key must survive an aborted upload.
        put(&store, "bk-m", "k", b"live").await;
        let aborted = store
            .create_multipart_upload("bk-m", "k", PutOptions::default(), None)
            .await
            .unwrap();
        store
            .upload_part(
                "bk-m",
                "k",
                &aborted,
                1,
                ObjectBody::from_bytes(data(1, 6 * MIB)),
                None,
                None,
            )
            .await
            .unwrap();
        store
            .abort_multipart_upload("bk-m", "k", &aborted)
            .await
            .unwrap();
        assert_eq!(get(&store, "bk-m", "k").await, b"live");
        assert!(matches!(
            store.list_parts("bk-m", "k", &aborted, 0, 100).await,
            Err(StoreError::NoSuchUpload(_))
        ));

        let opts = PutOptions {
            content_type: Some("text/plain".into()),
            user_metadata: vec![("a".into(), "1".into())],
            ..Default::default()
        };
        let id = store
            .create_multipart_upload("bk-m", "k", opts, None)
            .await
            .unwrap();
        let parts = [data(10, 5 * MIB), data(11, 5 * MIB + 1), data(12, 17)];
        let mut etags = Vec::new();
        for (i, p) in parts.iter().enumerate() {
            let info = store
                .upload_part(
                    "bk-m",
                    "k",
                    &id,
                    i as u32 + 1,
                    ObjectBody::from_bytes(p.clone()),
                    None,
                    None,
                )
                .await
                .unwrap();
            etags.push((i as u32 + 1, info.etag));
        }
        // Re-upload of part 2 replaces it.
        let info = store
            .upload_part(
                "bk-m",
                "k",
                &id,
                2,
                ObjectBody::from_bytes(parts[1].clone()),
                None,
                None,
            )
            .await
            .unwrap();
        etags[1].1 = info.etag;
        let (listed, truncated, _) = store.list_parts("bk-m", "k", &id, 0, 2).await.unwrap();
        assert_eq!(
            listed.iter().map(|p| p.number).collect::<Vec<_>>(),
            vec![1, 2]
        );
        assert!(truncated);
        let (uploads, _, _) = store
            .list_multipart_uploads("bk-m", "", None, None, None, 100)
            .await
            .unwrap();
        assert_eq!(uploads.len(), 1);
        // Wrong order, wrong ETag and too-small parts are refused.
        let mut wrong = etags.clone();
        wrong.swap(0, 1);
        assert!(matches!(
            store
                .complete_multipart_upload("bk-m", "k", &id, &wrong, &PutOptions::default())
                .await,
            Err(StoreError::InvalidPartOrder)
        ));
        let mut bad = etags.clone();
        bad[0].1 = "0".repeat(32);
        assert!(matches!(
            store
                .complete_multipart_upload("bk-m", "k", &id, &bad, &PutOptions::default())
                .await,
            Err(StoreError::InvalidPart(1))
        ));
        let small = vec![etags[2].clone(), (4, etags[2].1.clone())];
        assert!(store
            .complete_multipart_upload("bk-m", "k", &id, &small, &PutOptions::default())
            .await
            .is_err());

        let info = store
            .complete_multipart_upload("bk-m", "k", &id, &etags, &PutOptions::default())
            .await
            .unwrap();
        assert!(info.etag.ends_with("-3"), "{}", info.etag);
        let whole: Vec<u8> = parts.concat();
        assert_eq!(get(&store, "bk-m", "k").await, whole);
        let head = store.head_object("bk-m", "k", None).await.unwrap();
        assert_eq!(head.content_type, "text/plain");
        assert_eq!(head.user_metadata, vec![("a".to_string(), "1".to_string())]);
        // partNumber reads.
        let p2 = store
            .get_object("bk-m", "k", None, None, Some(2))
            .await
            .unwrap();
        assert_eq!(p2.range, (5 * MIB as u64, 10 * MIB as u64 + 1));
        assert_eq!(p2.stream.collect().await.unwrap(), parts[1]);
        // The upload is gone.
        assert!(store
            .list_multipart_uploads("bk-m", "", None, None, None, 100)
            .await
            .unwrap()
            .0
            .is_empty());
        // Ranges across part boundaries.
        let a = 5 * MIB as u64 - 10;
        assert_eq!(
            get_range(&store, "bk-m", "k", a, a + 20).await,
            &whole[a as usize..a as usize + 21]
        );
    });
}

#[test]
fn versioning_and_delete_markers() {
    let c = Cluster::new(4);
    let store = c.open();
    run(async move {
        bucket(&store, "bk-v").await;
        put(&store, "bk-v", "k", b"null-version").await;
        store.set_bucket_versioning("bk-v", true).await.unwrap();
        let v1 = put(&store, "bk-v", "k", b"one").await.version_id.unwrap();
        let v2 = put(&store, "bk-v", "k", b"two").await.version_id.unwrap();
        assert_eq!(get(&store, "bk-v", "k").await, b"two");
        let del = store.delete_object("bk-v", "k", None).await.unwrap();
        assert!(del.delete_marker);
        assert!(matches!(
            store.get_object("bk-v", "k", None, None, None).await,
            Err(StoreError::DeleteMarker { .. })
        ));
        assert_eq!(get_version(&store, "bk-v", "k", &v1).await, b"one");
        assert_eq!(
            get_version(&store, "bk-v", "k", "null").await,
            b"null-version"
        );
        let page = store
            .list_object_versions(
                "bk-v",
                VersionListParams {
                    max_keys: 100,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(page.versions.len(), 4);
        assert!(page.versions[0].delete_marker && page.versions[0].is_latest);
        // Listing hides the key while the marker is latest.
        assert!(store
            .list_objects(
                "bk-v",
                ListParams {
                    max_keys: 100,
                    ..Default::default()
                }
            )
            .await
            .unwrap()
            .objects
            .is_empty());
        // Deleting the marker brings v2 back.
        store
            .delete_object("bk-v", "k", del.version_id.as_deref())
            .await
            .unwrap();
        assert_eq!(get(&store, "bk-v", "k").await, b"two");
        store.delete_object("bk-v", "k", Some(&v2)).await.unwrap();
        assert_eq!(get(&store, "bk-v", "k").await, b"one");
        // Version listing pages by key and version id markers.
        let mut all = Vec::new();
        let mut p = VersionListParams {
            max_keys: 1,
            ..Default::default()
        };
        loop {
            let page = store.list_object_versions("bk-v", p.clone()).await.unwrap();
            all.extend(page.versions.iter().map(|v| v.version_id.clone()));
            if !page.is_truncated {
                break;
            }
            p.key_marker = page.next_key_marker;
            p.version_id_marker = page.next_version_id_marker;
        }
        assert_eq!(all.len(), 2);
    });
}

#[test]
fn lifecycle_expiry_acts_only_on_what_it_judged() {
    let c = Cluster::new(4);
    let store = c.open();
    run(async move {
        bucket(&store, "bk-lc").await;
        let old = put(&store, "bk-lc", "k", b"old").await;
        // Rewritten after the scan read it: left alone.
        put(&store, "bk-lc", "k", b"new").await;
        let judged = Unchanged::Current {
            version: "null".into(),
            mod_time_ns: old.last_modified_ns,
        };
        assert!(store
            .expire_if_unchanged("bk-lc", "k", judged)
            .await
            .unwrap()
            .is_none());
        assert_eq!(get(&store, "bk-lc", "k").await, b"new");
        let now = store.head_object("bk-lc", "k", None).await.unwrap();
        let judged = Unchanged::Current {
            version: "null".into(),
            mod_time_ns: now.last_modified_ns,
        };
        assert!(store
            .expire_if_unchanged("bk-lc", "k", judged)
            .await
            .unwrap()
            .is_some());
        assert!(store.head_object("bk-lc", "k", None).await.is_err());
        // Versioned: a current version expires into one delete marker; a
        // second try finds a marker current and does nothing.
        store.set_bucket_versioning("bk-lc", true).await.unwrap();
        let v1 = put(&store, "bk-lc", "v", b"one").await;
        let judged = Unchanged::Current {
            version: v1.version_id.clone().unwrap(),
            mod_time_ns: v1.last_modified_ns,
        };
        let r = store
            .expire_if_unchanged("bk-lc", "v", judged.clone())
            .await
            .unwrap()
            .unwrap();
        assert!(r.delete_marker);
        assert!(store
            .expire_if_unchanged("bk-lc", "v", judged)
            .await
            .unwrap()
            .is_none());
        // The marker is not alone (v1 is behind it): not removed as lone.
        let marker = r.version_id.unwrap();
        let lone = Unchanged::SoleDeleteMarker {
            version: marker.clone(),
        };
        assert!(store
            .expire_if_unchanged("bk-lc", "v", lone.clone())
            .await
            .unwrap()
            .is_none());
        // v1 is noncurrent now: expired by its id; then the marker is alone.
        let v1_id = v1.version_id.unwrap();
        assert!(store
            .expire_if_unchanged(
                "bk-lc",
                "v",
                Unchanged::Version {
                    version: v1_id.clone()
                }
            )
            .await
            .unwrap()
            .is_some());
        assert!(store
            .expire_if_unchanged("bk-lc", "v", Unchanged::Version { version: v1_id })
            .await
            .unwrap()
            .is_none());
        assert!(store
            .expire_if_unchanged("bk-lc", "v", lone)
            .await
            .unwrap()
            .is_some());
        let page = store
            .list_object_versions(
                "bk-lc",
                VersionListParams {
                    max_keys: 100,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert!(page.versions.is_empty());
    });
}

#[test]
fn buckets_tags_and_durability_classes() {
    let c = Cluster::new(4);
    let store = c.open();
    let c2 = Cluster::new(4);
    let _ = c2;
    run(async move {
        assert!(matches!(
            store
                .create_bucket("Bad_Name", Durability::ErasureCoded)
                .await,
            Err(StoreError::InvalidBucketName(_))
        ));
        store
            .create_bucket("rep", Durability::Replicated(3))
            .await
            .unwrap();
        store
            .create_bucket("one", Durability::SingleCopy)
            .await
            .unwrap();
        assert!(matches!(
            store.create_bucket("one", Durability::ErasureCoded).await,
            Err(StoreError::BucketExists(_))
        ));
        for b in ["rep", "one"] {
            let body = data(9, 2 * MIB + 1);
            put(&store, b, "k", &body).await;
            assert_eq!(get(&store, b, "k").await, body);
        }
        store
            .put_object_tags("rep", "k", None, vec![("t".into(), "1".into())])
            .await
            .unwrap();
        let head = store.head_object("rep", "k", None).await.unwrap();
        assert_eq!(head.tags, vec![("t".to_string(), "1".to_string())]);
        assert_eq!(
            get(&store, "rep", "k").await.len(),
            2 * MIB + 1,
            "tagging never touches the body"
        );
        assert!(matches!(
            store.delete_bucket("rep").await,
            Err(StoreError::BucketNotEmpty(_))
        ));
        store.delete_object("rep", "k", None).await.unwrap();
        // Deleting a missing key succeeds.
        store.delete_object("rep", "k", None).await.unwrap();
        store.delete_bucket("rep").await.unwrap();
        assert!(matches!(
            store.head_bucket("rep"),
            Err(StoreError::NoSuchBucket(_))
        ));
        assert_eq!(store.list_buckets().len(), 1);
    });
}

#[test]
fn restart_keeps_everything() {
    let c = Cluster::new(4);
    let bodies: Vec<(String, Vec<u8>)> = (0..20)
        .map(|i| (format!("k{i}"), data(i, i as usize * 50_000)))
        .collect();
    {
        let store = c.open();
        let b = bodies.clone();
        run(async move {
            bucket(&store, "bk-p").await;
            for (k, v) in &b {
                put(&store, "bk-p", k, v).await;
            }
        });
    }
    let store = c.open();
    run(async move {
        assert_eq!(store.list_buckets().len(), 1);
        for (k, v) in &bodies {
            assert_eq!(&get(&store, "bk-p", k).await, v);
        }
    });
}

#[test]
fn wrong_drive_order_is_refused_per_drive() {
    let c = Cluster::new(4);
    drop(c.open());
    let mut swapped = c.config();
    swapped.drives.swap(0, 1);
    let store = Store::open(swapped).unwrap();
    let status = store.drive_status();
    assert!(!status[0].online && !status[1].online, "{status:?}");
    assert!(status[0].reason.as_deref().unwrap().contains("position"));
}

#[test]
fn bad_bodies_leave_nothing_visible() {
    let c = Cluster::new(4);
    let store = c.open();
    run(async move {
        bucket(&store, "bk-x").await;
        put(&store, "bk-x", "k", b"original").await;
        // Body shorter than declared.
        let short = ObjectBody {
            stream: Box::pin(futures::stream::iter([Ok(bytes::Bytes::from(data(
                1,
                3 * MIB,
            )))])),
            declared_len: Some(4 * MIB as u64),
            finish: None,
        };
        assert!(matches!(
            store
                .put_object("bk-x", "k", short, PutOptions::default())
                .await,
            Err(StoreError::IncompleteBody { .. })
        ));
        // Body stream failing mid-way.
        let failing = ObjectBody {
            stream: Box::pin(futures::stream::iter([
                Ok(bytes::Bytes::from(data(1, 2 * MIB))),
                Err(StoreError::Body("client reset".into())),
            ])),
            declared_len: None,
            finish: None,
        };
        assert!(store
            .put_object("bk-x", "k", failing, PutOptions::default())
            .await
            .is_err());
        // Wrong Content-MD5.
        let opts = PutOptions {
            content_md5: Some([0; 16]),
            ..Default::default()
        };
        assert!(matches!(
            store
                .put_object("bk-x", "k", ObjectBody::from_bytes(b"abc".to_vec()), opts)
                .await,
            Err(StoreError::BadDigest)
        ));
        assert_eq!(get(&store, "bk-x", "k").await, b"original");
    });
    // No shard files left behind by the failed writes.
    for i in 0..4 {
        assert!(
            c.shard_files(i).is_empty(),
            "drive {i} has leftovers: {:?}",
            c.shard_files(i)
        );
        let tmp: Vec<_> = std::fs::read_dir(c.drives[i].join(".tarn/tmp"))
            .unwrap()
            .collect();
        assert!(tmp.is_empty());
    }
}

#[test]
fn orphaned_shards_are_swept_after_the_grace_period() {
    let c = Cluster::new(4);
    let store = c.open();
    let body = data(31, 3 * MIB);
    let s = store.clone();
    let b = body.clone();
    run(async move {
        bucket(&s, "bk-o").await;
        put(&s, "bk-o", "k", &b).await;
    });
    let referenced = c.shard_files(0);
    // Two old orphans (a write that renamed its shards and crashed before the
    // commit) and one fresh file (a write committing right now).
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(7200);
    let mk = |drive: usize, id: &str, age: Option<std::time::SystemTime>| {
        let p = c.drives[drive].join("data").join(&id[..2]).join(id);
        std::fs::write(&p, b"orphan").unwrap();
        if let Some(t) = age {
            std::fs::File::options()
                .write(true)
                .open(&p)
                .unwrap()
                .set_modified(t)
                .unwrap();
        }
        p
    };
    let o1 = mk(0, "ab000000000000000000000000000001", Some(old));
    let o2 = mk(3, "cd000000000000000000000000000002", Some(old));
    let fresh = mk(1, "ef000000000000000000000000000003", None);
    let s = store.clone();
    run(async move {
        let report = s.heal_all().await;
        assert_eq!(report.orphans_removed, 2, "{report:?}");
        assert_eq!(report.failures, 0);
    });
    assert!(!o1.exists() && !o2.exists());
    assert!(
        fresh.exists(),
        "files younger than the grace period are left alone"
    );
    for f in referenced {
        assert!(f.exists(), "referenced shard {f:?} must survive the sweep");
    }
    run(async move {
        assert_eq!(
            store
                .sweep_orphans(std::time::Duration::ZERO)
                .await
                .unwrap(),
            1
        );
        assert_eq!(get(&store, "bk-o", "k").await, body);
    });
}

#[test]
fn a_stalled_write_is_never_swept_as_an_orphan() {
    // Shards are written in place before their metadata commits. A client that
    // stalls mid-body leaves unreferenced shard files on disk; the sweep must
    // leave them alone however old they look, and the write must still commit.
    let c = Cluster::new(4);
    let store = c.open();
    let drive0 = c.drives[0].clone();
    let body = data(77, 5 * MIB);
    run(async move {
        bucket(&store, "bk-stall").await;
        let (go, wait) = tokio::sync::oneshot::channel::<()>();
        let first = bytes::Bytes::copy_from_slice(&body[..3 * MIB]);
        let rest = bytes::Bytes::copy_from_slice(&body[3 * MIB..]);
        let stream = futures::stream::unfold((0, Some(wait)), move |(step, wait)| {
            let (first, rest) = (first.clone(), rest.clone());
            async move {
                match step {
                    0 => Some((Ok(first), (1, wait))),
                    1 => {
                        let _ = wait.expect("gate").await;
                        Some((Ok(rest), (2, None)))
                    }
                    _ => None,
                }
            }
        });
        let s = store.clone();
        let put = tokio::spawn(async move {
            let b = ObjectBody {
                stream: Box::pin(stream),
                declared_len: Some(5 * MIB as u64),
                finish: None,
            };
            s.put_object("bk-stall", "k", b, PutOptions::default())
                .await
        });
        let shard_count = || {
            let mut n = 0;
            for sub in std::fs::read_dir(drive0.join("data")).unwrap().flatten() {
                n += std::fs::read_dir(sub.path()).unwrap().count();
            }
            n
        };
        for _ in 0..500 {
            if shard_count() > 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(
            shard_count(),
            1,
            "the stalled write has its shard file on drive 0"
        );
        assert_eq!(
            store
                .sweep_orphans(std::time::Duration::ZERO)
                .await
                .unwrap(),
            0
        );
        assert_eq!(
            shard_count(),
            1,
            "the sweep must not remove an in-flight write"
        );
        go.send(()).unwrap();
        put.await.unwrap().unwrap();
        assert_eq!(
            store
                .sweep_orphans(std::time::Duration::ZERO)
                .await
                .unwrap(),
            0
        );
        assert_eq!(get(&store, "bk-stall", "k").await, body);
    });
}

#[test]
fn a_slow_reader_never_blocks_a_writer_and_keeps_its_bytes() {
    // A GET used to hold the key's read lock for its whole stream, so a PUT of
    // the same key waited at its commit for the slowest reader. Readers now pin
    // their version's shards instead: the writer commits at once, the reader
    // still receives the old bytes intact, and the old shards go when it is done.
    let c = Cluster::new(4);
    let store = c.open();
    let drive0 = c.drives[0].clone();
    let old = data(1, 6 * MIB);
    let new = data(2, 6 * MIB);
    run(async move {
        bucket(&store, "bk-pin").await;
        put(&store, "bk-pin", "k", &old).await;
        let shard_count = || {
            let mut n = 0;
            for sub in std::fs::read_dir(drive0.join("data")).unwrap().flatten() {
                n += std::fs::read_dir(sub.path()).unwrap().count();
            }
            n
        };
        // Open a stream and do not read it yet.
        let slow = store
            .get_object("bk-pin", "k", None, None, None)
            .await
            .unwrap();
        let overwrite = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            put(&store, "bk-pin", "k", &new),
        )
        .await;
        assert!(overwrite.is_ok(), "the writer waited for an idle reader");
        assert_eq!(get(&store, "bk-pin", "k").await, new);
        // Delete too, while the reader still holds the first version.
        store.delete_object("bk-pin", "k", None).await.unwrap();
        assert_eq!(
            shard_count(),
            1,
            "the pinned version's shard stays while it is read"
        );
        assert_eq!(
            slow.stream.collect().await.unwrap(),
            old,
            "the reader gets the old bytes, intact"
        );
        for _ in 0..200 {
            if shard_count() == 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(
            shard_count(),
            0,
            "retired shards are deleted after the last reader"
        );
    });
}

#[test]
fn objects_stay_readable_after_the_stripe_size_shrinks() {
    // Buffers come from pools sized by the configured stripe, but stored
    // objects keep the stripe they were written with. Reopening with a smaller
    // --stripe-size made every read of older objects assert on buffer capacity.
    let c = Cluster::new(4);
    let body = data(41, 3 * MIB + 9);
    {
        let store = c.open();
        let b = body.clone();
        run(async move {
            bucket(&store, "bk-stripe").await;
            put(&store, "bk-stripe", "k", &b).await;
        });
    }
    let mut cfg = c.config();
    cfg.stripe_size_bytes = 64 << 10;
    let store = Store::open(cfg).unwrap();
    run(async move {
        assert_eq!(get(&store, "bk-stripe", "k").await, body);
        assert_eq!(
            get_range(&store, "bk-stripe", "k", MIB as u64 - 5, MIB as u64 + 5).await,
            &body[MIB - 5..MIB + 6]
        );
        assert_eq!(store.heal_all().await.failures, 0);
    });
}

/// Every body PUT to bucket/key at once.
async fn put_all(
    store: &Arc<Store>,
    (bucket, key): (&str, &str),
    bodies: &[Vec<u8>],
    opts: &PutOptions,
) -> Vec<Result<tarn_store::ObjectInfo, StoreError>> {
    let puts = bodies
        .iter()
        .map(|b| store.put_object(bucket, key, ObjectBody::from_bytes(b.clone()), opts.clone()));
    futures::future::join_all(puts).await
}

/// Writers of one key at once share its durable writes (group commit):
/// each is answered as if committed alone in some order, conditions are
/// checked against the writers before it, versions superseded within a
/// round leave nothing behind, and a versioned key keeps every one.
#[test]
fn concurrent_writers_of_one_key_share_its_commits() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Cluster::new(4);
    let store = c.open();
    let s = store.clone();
    run(async move {
        let store = s;
        bucket(&store, "bk-g").await;
        // Half the bodies inline, half in shard files.
        let bodies: Vec<Vec<u8>> = (0..24u64)
            .map(|i| {
                data(
                    i,
                    if i % 2 == 0 { 1000 } else { INLINE + 4096 } + i as usize,
                )
            })
            .collect();
        let infos: Vec<_> = put_all(&store, ("bk-g", "k"), &bodies, &PutOptions::default())
            .await
            .into_iter()
            .map(|r| r.expect("put"))
            .collect();
        let rounds = store.stats.commit_rounds.load(Relaxed);
        let versions = store.stats.commit_versions.load(Relaxed);
        assert_eq!(versions, 24);
        assert!(rounds < versions, "{rounds} durable writes for 24 writers");
        let mut times: Vec<u64> = infos.iter().map(|i| i.last_modified_ns).collect();
        times.sort();
        times.dedup();
        assert_eq!(times.len(), 24, "each writer has a commit time of its own");
        let newest = (0..24).max_by_key(|&i| infos[i].last_modified_ns).unwrap();
        assert_eq!(get(&store, "bk-g", "k").await, bodies[newest]);
        let head = store.head_object("bk-g", "k", None).await.unwrap();
        assert_eq!(head.etag, infos[newest].etag);
        // The superseded versions' shard files are gone before the answers.
        let want = if newest % 2 == 1 { 1 } else { 0 };
        for d in 0..4 {
            assert_eq!(c.shard_files(d).len(), want, "shard files on drive {d}");
        }

        // Creating a key: exactly one writer wins, the others are refused
        // and leave no data.
        let create = PutOptions {
            if_none_match: Some("*".into()),
            ..Default::default()
        };
        let results = put_all(&store, ("bk-g", "new"), &bodies, &create).await;
        let won: Vec<usize> = (0..24).filter(|&i| results[i].is_ok()).collect();
        assert_eq!(won.len(), 1, "one creator wins");
        for r in &results {
            if let Err(e) = r {
                assert!(matches!(e, StoreError::PreconditionFailed(_)), "{e}");
            }
        }
        assert_eq!(get(&store, "bk-g", "new").await, bodies[won[0]]);
        let files: usize = (0..4).map(|d| c.shard_files(d).len()).sum();
        assert_eq!(files, 4 * (want + won[0] % 2));

        // Replacing one ETag: one writer wins, the rest see it changed.
        let current = store.head_object("bk-g", "k", None).await.unwrap().etag;
        let swap = PutOptions {
            if_match: Some(current),
            ..Default::default()
        };
        let won = put_all(&store, ("bk-g", "k"), &bodies, &swap)
            .await
            .iter()
            .filter(|r| r.is_ok())
            .count();
        assert_eq!(won, 1, "one compare-and-swap wins");

        // A versioned key keeps every writer's version.
        store.set_bucket_versioning("bk-g", true).await.unwrap();
        let infos: Vec<_> = put_all(&store, ("bk-g", "v"), &bodies[..12], &PutOptions::default())
            .await
            .into_iter()
            .map(|r| r.expect("versioned put"))
            .collect();
        for (i, info) in infos.iter().enumerate() {
            let vid = info.version_id.clone().expect("a version id");
            let got = get_version(&store, "bk-g", "v", &vid).await;
            assert_eq!(got, bodies[i], "version of writer {i}");
        }
        let page = store
            .list_object_versions(
                "bk-g",
                VersionListParams {
                    prefix: "v".into(),
                    max_keys: 100,
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        assert_eq!(page.versions.len(), 12);
    });
}
