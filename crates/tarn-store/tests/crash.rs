//! Crash consistency: a fail point stops every disk operation after N more have
//! run, as if the process died at that instant. For many N the store is then
//! reopened and must show, for every key, either the old state or the new one:
//! never a torn object, never a listing entry that cannot be read, and every
//! operation that reported success must have taken effect.
//!
//! One test function per binary: the fail point is process-global.

mod common;

use common::*;
use tarn_store::{ListParams, ObjectBody, PutOptions, StoreError};

const MIB: usize = 1 << 20;

#[derive(Default, Debug)]
struct Outcome {
    new_inline: bool,
    new_ec: bool,
    over_b: bool,
    delete: bool,
    multipart: bool,
    over_c: bool,
}

#[test]
fn every_crash_point_leaves_old_or_new() {
    let keep = data(1, 2 * MIB + 3);
    let over_a = data(2, 300 << 10);
    let over_b = data(3, 3 * MIB);
    let over_c = data(4, 100);
    let small = data(5, 10);
    let new_inline = data(6, 1000);
    let new_ec = data(7, 3 * MIB + 1);
    let mp_parts = [data(8, 5 * MIB), data(9, 1024)];
    let mp_whole = mp_parts.concat();

    let mut points_with_damage = 0;
    for n in (0..160).step_by(4) {
        let c = Cluster::new(4);
        let store = c.open();
        let (keep2, a2, small2) = (keep.clone(), over_a.clone(), small.clone());
        let s = store.clone();
        run(async move {
            bucket(&s, "crash").await;
            put(&s, "crash", "keep", &keep2).await;
            put(&s, "crash", "over", &a2).await;
            put(&s, "crash", "del", &small2).await;
        });

        tarn_io::fault::arm(n);
        let s = store.clone();
        let (ni, ne, ob, oc, parts) = (
            new_inline.clone(),
            new_ec.clone(),
            over_b.clone(),
            over_c.clone(),
            mp_parts.clone(),
        );
        let outcome = std::sync::Arc::new(std::sync::Mutex::new(Outcome::default()));
        let o = outcome.clone();
        run(async move {
            let put = |k: &'static str, b: Vec<u8>| {
                let s = s.clone();
                async move {
                    s.put_object("crash", k, ObjectBody::from_bytes(b), PutOptions::default())
                        .await
                        .is_ok()
                }
            };
            let r = put("new-inline", ni).await;
            o.lock().unwrap().new_inline = r;
            let r = put("new-ec", ne).await;
            o.lock().unwrap().new_ec = r;
            let r = put("over", ob).await;
            o.lock().unwrap().over_b = r;
            let r = s.delete_object("crash", "del", None).await.is_ok();
            o.lock().unwrap().delete = r;
            let mp = async {
                let id = s
                    .create_multipart_upload("crash", "mp", PutOptions::default(), None)
                    .await?;
                let mut list = Vec::new();
                for (i, p) in parts.iter().enumerate() {
                    let info = s
                        .upload_part(
                            "crash",
                            "mp",
                            &id,
                            i as u32 + 1,
                            ObjectBody::from_bytes(p.clone()),
                            None,
                            None,
                        )
                        .await?;
                    list.push((i as u32 + 1, info.etag));
                }
                s.complete_multipart_upload("crash", "mp", &id, &list, &PutOptions::default())
                    .await?;
                Ok::<_, StoreError>(())
            };
            let r = mp.await.is_ok();
            o.lock().unwrap().multipart = r;
            let r = put("over", oc).await;
            o.lock().unwrap().over_c = r;
        });
        tarn_io::fault::disarm();
        drop(store);

        // Restart and check.
        let store = c.open();
        let outcome = std::mem::take(&mut *outcome.lock().unwrap());
        let all_ok = outcome.new_inline
            && outcome.new_ec
            && outcome.over_b
            && outcome.delete
            && outcome.multipart
            && outcome.over_c;
        if !all_ok {
            points_with_damage += 1;
        }
        let (keep, over_a, over_b, over_c, small, new_inline, new_ec, mp_whole) = (
            keep.clone(),
            over_a.clone(),
            over_b.clone(),
            over_c.clone(),
            small.clone(),
            new_inline.clone(),
            new_ec.clone(),
            mp_whole.clone(),
        );
        run(async move {
            let read = |k: &'static str| {
                let s = store.clone();
                async move {
                    match s.get_object("crash", k, None, None, None).await {
                        Ok(r) => Some(r.stream.collect().await.unwrap_or_else(|e| {
                            panic!("n={n}: {k} listed as readable but read failed: {e}")
                        })),
                        Err(StoreError::NoSuchKey { .. }) => None,
                        Err(e) => panic!("n={n}: {k}: unexpected error {e}"),
                    }
                }
            };
            assert_eq!(
                read("keep").await.as_deref(),
                Some(&keep[..]),
                "n={n}: untouched object damaged"
            );
            let check = |name: &str,
                         got: Option<Vec<u8>>,
                         allowed: &[Option<&[u8]>],
                         must: Option<&[u8]>| {
                assert!(
                    allowed.contains(&got.as_deref()),
                    "n={n}: {name} is torn or unexpected ({:?} bytes)",
                    got.as_ref().map(|g| g.len())
                );
                if let Some(m) = must {
                    assert_eq!(
                        got.as_deref(),
                        Some(m),
                        "n={n}: {name} was acknowledged but is not there"
                    );
                }
            };
            check(
                "new-inline",
                read("new-inline").await,
                &[None, Some(&new_inline)],
                outcome.new_inline.then_some(&new_inline[..]),
            );
            check(
                "new-ec",
                read("new-ec").await,
                &[None, Some(&new_ec)],
                outcome.new_ec.then_some(&new_ec[..]),
            );
            let over = read("over").await;
            let must_over = if outcome.over_c {
                Some(&over_c[..])
            } else if outcome.over_b {
                Some(&over_b[..])
            } else {
                None
            };
            check(
                "over",
                over,
                &[Some(&over_a), Some(&over_b), Some(&over_c)],
                must_over,
            );
            let del = read("del").await;
            check("del", del, &[None, Some(&small)], None);
            if outcome.delete {
                assert!(
                    read("del").await.is_none(),
                    "n={n}: acknowledged delete undone"
                );
            }
            check(
                "mp",
                read("mp").await,
                &[None, Some(&mp_whole)],
                outcome.multipart.then_some(&mp_whole[..]),
            );

            // The listing shows exactly the readable keys, with their sizes.
            let page = store
                .list_objects(
                    "crash",
                    ListParams {
                        max_keys: 1000,
                        ..Default::default()
                    },
                )
                .await
                .unwrap();
            for o in &page.objects {
                let k: &'static str = Box::leak(o.key.clone().into_boxed_str());
                let body = read(k)
                    .await
                    .unwrap_or_else(|| panic!("n={n}: {k} listed but not readable"));
                assert_eq!(
                    body.len() as u64,
                    o.size,
                    "n={n}: {k} listed size differs from its body"
                );
            }
            for k in ["keep", "new-inline", "new-ec", "over", "del", "mp"] {
                if read(k).await.is_some() {
                    assert!(
                        page.objects.iter().any(|o| o.key == k),
                        "n={n}: {k} readable but not listed"
                    );
                }
            }
            let report = store.heal_all().await;
            assert_eq!(
                report.failures, 0,
                "n={n}: heal after crash failed: {report:?}"
            );
        });
    }
    assert!(
        points_with_damage > 10,
        "the fail point must cut the workload at many points"
    );
}
