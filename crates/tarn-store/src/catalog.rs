//! What a cluster keeps small and global, outside the drives: bucket records
//! and the system documents (users, keys, buckets' access settings). On one
//! node they live on the drives (bucket records in every drive's index, the
//! documents in the system bucket); a cluster keeps them in etcd
//! (`tarn-cluster`'s catalog), so that every node sees one answer.

use crate::drive_io::BoxFuture;
use crate::error::StoreError;
use crate::format::BucketRecord;

pub trait Catalog: Send + Sync {
    /// Records a new bucket unless one of that name exists (false then): two
    /// nodes creating one name at once never both succeed.
    fn create_bucket<'a>(
        &'a self,
        name: &'a str,
        rec: &'a BucketRecord,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;
    /// Replaces an existing bucket's record.
    fn put_bucket<'a>(
        &'a self,
        name: &'a str,
        rec: &'a BucketRecord,
    ) -> BoxFuture<'a, Result<(), StoreError>>;
    fn delete_bucket<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), StoreError>>;
    /// A bucket's record as the catalog has it now.
    fn bucket<'a>(
        &'a self,
        name: &'a str,
    ) -> BoxFuture<'a, Result<Option<BucketRecord>, StoreError>>;

    /// A system document's bytes, None when there is none.
    fn doc<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<Option<Vec<u8>>, StoreError>>;
    fn put_doc<'a>(&'a self, key: &'a str, bytes: Vec<u8>)
        -> BoxFuture<'a, Result<(), StoreError>>;
    fn delete_doc<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<(), StoreError>>;
    /// The keys of every document under `prefix`, in order.
    fn doc_keys<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Vec<String>, StoreError>>;
}
