//! Small JSON documents (users, buckets' access settings): on one node in
//! the engine's system bucket, written through the object engine with its
//! quorum and healing, never reachable over S3; in a cluster in the store's
//! catalog (etcd), where every node reads the same.

use std::sync::Arc;

use futures::StreamExt;
use serde::Serialize;
use tarn_store::{ListParams, ObjectBody, PutOptions, Store, StoreError, SYSTEM_BUCKET};

/// The bytes of one document.
pub async fn read(store: &Arc<Store>, key: &str) -> Result<Vec<u8>, StoreError> {
    if let Some(c) = store.catalog() {
        return c.doc(key).await?.ok_or_else(|| StoreError::NoSuchKey {
            bucket: SYSTEM_BUCKET.into(),
            key: key.into(),
        });
    }
    let got = store
        .get_object_if(SYSTEM_BUCKET, key, None, None, None, &Default::default())
        .await?;
    let mut bytes = Vec::with_capacity(got.info.size as usize);
    let mut stream = got.stream;
    while let Some(chunk) = stream.next().await {
        bytes.extend_from_slice(&chunk?);
    }
    Ok(bytes)
}

pub async fn write<T: Serialize>(store: &Arc<Store>, key: &str, doc: &T) -> Result<(), StoreError> {
    let json = serde_json::to_vec(doc).expect("a system document serializes");
    if let Some(c) = store.catalog() {
        return c.put_doc(key, json).await;
    }
    store
        .put_object(
            SYSTEM_BUCKET,
            key,
            ObjectBody::from_bytes(json),
            PutOptions {
                content_type: Some("application/json".into()),
                ..Default::default()
            },
        )
        .await?;
    Ok(())
}

pub async fn delete(store: &Arc<Store>, key: &str) -> Result<(), StoreError> {
    if let Some(c) = store.catalog() {
        return c.delete_doc(key).await;
    }
    store.delete_object(SYSTEM_BUCKET, key, None).await?;
    Ok(())
}

/// The keys of every document under `prefix`.
pub async fn list(store: &Arc<Store>, prefix: &str) -> Result<Vec<String>, StoreError> {
    if let Some(c) = store.catalog() {
        return c.doc_keys(prefix).await;
    }
    let mut keys = Vec::new();
    let mut after = None;
    loop {
        let page = store
            .list_objects(
                SYSTEM_BUCKET,
                ListParams {
                    prefix: prefix.into(),
                    delimiter: None,
                    after: after.clone(),
                    max_keys: 1000,
                },
            )
            .await?;
        keys.extend(page.objects.into_iter().map(|o| o.key));
        if !page.is_truncated {
            return Ok(keys);
        }
        after = keys.last().cloned();
    }
}
