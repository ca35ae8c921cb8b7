//! The S3 operations on cache buckets (`cache`): GET and HEAD through the
//! cache, listings from the upstream, and the clear refusals of what a
//! cache bucket does not do.

use std::sync::Arc;

use s3s::{S3Error, S3ErrorCode, S3Result};
use tarn_store::{ByteRange, ListPage, ListParams, ObjectInfo, ReadConditions};

use crate::cache::{CacheBucket, CacheError, Writes};
use crate::error::s3_error;
use crate::ops::TarnS3;

pub(crate) fn cache_error(e: CacheError) -> S3Error {
    match e {
        CacheError::NoSuchKey => {
            S3Error::with_message(S3ErrorCode::NoSuchKey, "The specified key does not exist.")
        }
        CacheError::Store(e) => s3_error(e),
        CacheError::Invalid(m) => S3Error::with_message(S3ErrorCode::InvalidArgument, m),
        e @ (CacheError::Upstream(_) | CacheError::Changed | CacheError::Failed(_)) => {
            S3Error::with_message(
                S3ErrorCode::ServiceUnavailable,
                format!("the cache's upstream could not answer: {e}"),
            )
        }
        e => S3Error::with_message(S3ErrorCode::InternalError, e.to_string()),
    }
}

/// The largest key in UTF-8 order under a common prefix: a listing that
/// resumes after a common prefix starts after every key it holds.
const AFTER_ALL: char = '\u{10FFFF}';

impl TarnS3 {
    pub(crate) fn cache_of(&self, bucket: &str) -> Option<Arc<CacheBucket>> {
        self.access.caches.get(bucket)
    }

    /// Writes into a cache bucket: refused with a clear error (write-through
    /// is not built yet, and `--writes through` is not accepted).
    pub(crate) fn refuse_cache_write(&self, bucket: &str) -> S3Result<()> {
        match self.cache_of(bucket) {
            Some(cb) if cb.writes == Writes::Refuse => Err(S3Error::with_message(
                S3ErrorCode::MethodNotAllowed,
                format!(
                    "bucket {bucket} is a read-only cache of {} (--writes refuse): write to the upstream",
                    cb.summary()["upstream"].as_str().unwrap_or_default()
                ),
            )),
            Some(_) => Err(S3Error::with_message(
                S3ErrorCode::NotImplemented,
                "writes through a cache bucket are not available yet",
            )),
            None => Ok(()),
        }
    }

    /// Operations a cache bucket does not offer.
    pub(crate) fn refuse_on_cache(&self, bucket: &str, what: &str) -> S3Result<()> {
        if self.cache_of(bucket).is_some() {
            return Err(S3Error::with_message(
                S3ErrorCode::NotImplemented,
                format!("{what} is not available on cache bucket {bucket}"),
            ));
        }
        Ok(())
    }

    /// One page of a listing: the engine's, or for a cache bucket the
    /// upstream's (its keys relative to the cache's prefix).
    pub(crate) async fn list_page(&self, bucket: &str, params: ListParams) -> S3Result<ListPage> {
        let Some(cb) = self.cache_of(bucket) else {
            return self
                .store
                .list_objects(bucket, params)
                .await
                .map_err(s3_error);
        };
        let after = params.after.map(|a| match &params.delimiter {
            Some(d) if a.ends_with(d.as_str()) && a.len() > params.prefix.len() => {
                format!("{a}{AFTER_ALL}")
            }
            _ => a,
        });
        let max = i32::try_from(params.max_keys).unwrap_or(1000);
        let page = cb
            .upstream
            .list(
                &params.prefix,
                params.delimiter.as_deref(),
                None,
                after.as_deref(),
                max,
            )
            .await
            .map_err(|e| cache_error(e.into()))?;
        let next_after = page
            .objects
            .last()
            .map(|o| o.key.clone())
            .into_iter()
            .chain(page.prefixes.last().cloned())
            .max();
        Ok(ListPage {
            objects: page
                .objects
                .into_iter()
                .map(|o| ObjectInfo {
                    bucket: bucket.to_string(),
                    key: o.key,
                    version_id: None,
                    is_latest: true,
                    delete_marker: false,
                    size: o.size,
                    etag: o.etag,
                    last_modified_ns: o.last_modified_ns,
                    content_type: String::new(),
                    headers: Vec::new(),
                    user_metadata: Vec::new(),
                    tags: Vec::new(),
                    checksum: None,
                    parts: Vec::new(),
                })
                .collect(),
            common_prefixes: page.prefixes,
            is_truncated: page.truncated,
            next_after,
        })
    }

    /// A GET or HEAD of a cache bucket's object: its entry (validated as
    /// the bucket says), with the request's conditions and range applied.
    pub(crate) async fn cache_open(
        &self,
        ext: &http::Extensions,
        cb: &Arc<CacheBucket>,
        key: &str,
        range: Option<ByteRange>,
        conditions: &ReadConditions,
    ) -> S3Result<(Arc<crate::cache::Entry>, ObjectInfo, (u64, u64))> {
        let entry = cb.entry(key).await.map_err(cache_error)?;
        let info = entry.info(&cb.name, key);
        if let Some(p) = crate::access::permit_of(ext) {
            p.allows_object(&info)?;
        }
        conditions.check(&info).map_err(s3_error)?;
        let span = match range {
            Some(r) => r.resolve(info.size).map_err(s3_error)?,
            None => (0, info.size),
        };
        Ok((entry, info, span))
    }
}

/// A cache bucket serves its objects whole or by byte range, as the
/// upstream's current version.
pub(crate) fn plain_read(version_id: Option<&str>, part_number: Option<i32>) -> S3Result<()> {
    if version_id.is_some() {
        return Err(S3Error::with_message(
            S3ErrorCode::NotImplemented,
            "a cache bucket serves the upstream's current version only (no versionId)",
        ));
    }
    if part_number.is_some() {
        return Err(S3Error::with_message(
            S3ErrorCode::NotImplemented,
            "a cache bucket does not serve objects by part number",
        ));
    }
    Ok(())
}
