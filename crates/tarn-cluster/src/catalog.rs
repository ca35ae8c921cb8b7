//! The cluster's catalog in etcd (`tarn_store::catalog::Catalog`): bucket
//! records under `buckets/`, system documents under `sys/`. Every node
//! reads them from here, and follows their changes with a watch (`node`).

use tarn_store::catalog::Catalog;
use tarn_store::drive_io::BoxFuture;
use tarn_store::format::BucketRecord;
use tarn_store::StoreError;

use crate::etcd::{Etcd, EtcdError};
use crate::keys::Keys;

pub struct EtcdCatalog {
    etcd: Etcd,
    keys: Keys,
}

impl EtcdCatalog {
    pub fn new(etcd: Etcd, keys: Keys) -> EtcdCatalog {
        EtcdCatalog { etcd, keys }
    }
}

fn unavailable(e: EtcdError) -> StoreError {
    StoreError::Catalog(e.to_string())
}

/// A bucket record as etcd holds it.
pub fn decode_bucket(key: &str, bytes: &[u8]) -> Result<BucketRecord, StoreError> {
    BucketRecord::decode(bytes).map_err(|e| StoreError::CorruptMetadata {
        drive: "etcd".into(),
        what: format!("{key}: {e}"),
    })
}

impl Catalog for EtcdCatalog {
    fn create_bucket<'a>(
        &'a self,
        name: &'a str,
        rec: &'a BucketRecord,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async move {
            self.etcd
                .compare_and_swap(&self.keys.bucket(name), 0, &rec.encode(), None)
                .await
                .map_err(unavailable)
        })
    }

    fn put_bucket<'a>(
        &'a self,
        name: &'a str,
        rec: &'a BucketRecord,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.etcd
                .put(&self.keys.bucket(name), &rec.encode(), None)
                .await
                .map(drop)
                .map_err(unavailable)
        })
    }

    fn delete_bucket<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.etcd
                .delete(&self.keys.bucket(name))
                .await
                .map(drop)
                .map_err(unavailable)
        })
    }

    fn bucket<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<BucketRecord>, StoreError>> {
        Box::pin(async move {
            let key = self.keys.bucket(name);
            let (kv, _) = self.etcd.get(&key).await.map_err(unavailable)?;
            kv.map(|kv| decode_bucket(&key, &kv.value)).transpose()
        })
    }

    fn doc<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>> {
        Box::pin(async move {
            let (kv, _) = self
                .etcd
                .get(&self.keys.doc(key))
                .await
                .map_err(unavailable)?;
            Ok(kv.map(|kv| kv.value))
        })
    }

    fn put_doc<'a>(
        &'a self,
        key: &'a str,
        bytes: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.etcd
                .put(&self.keys.doc(key), &bytes, None)
                .await
                .map(drop)
                .map_err(unavailable)
        })
    }

    fn delete_doc<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<(), StoreError>> {
        Box::pin(async move {
            self.etcd
                .delete(&self.keys.doc(key))
                .await
                .map(drop)
                .map_err(unavailable)
        })
    }

    fn doc_keys<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Vec<String>, StoreError>> {
        Box::pin(async move {
            let root = self.keys.docs();
            let (kvs, _) = self
                .etcd
                .get_prefix(&self.keys.doc(prefix))
                .await
                .map_err(unavailable)?;
            Ok(kvs
                .into_iter()
                .filter_map(|kv| kv.key.strip_prefix(&root).map(str::to_string))
                .collect())
        })
    }
}
