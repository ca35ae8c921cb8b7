//! The S3 operations on cache buckets (`cache`): GET and HEAD through the
//! cache, listings from the upstream, and the clear refusals of what a
//! cache bucket does not do.

use std::sync::Arc;

use s3s::{S3Error, S3ErrorCode, S3Result};
use tarn_store::{ByteRange, ListPage, ListParams, ObjectInfo, ReadConditions};

use s3s::dto::*;
use s3s::S3Response;
use tarn_store::ObjectBody;

use crate::cache::upstream::{Upstream, UpstreamError};
use crate::cache::{CacheBucket, CacheError, Writes};
use crate::error::s3_error;
use crate::ops::TarnS3;

pub(crate) fn cache_error(e: CacheError) -> S3Error {
    match e {
        // The upstream refused a request (a write, a bad part): its own
        // error, as it said it.
        CacheError::Upstream(UpstreamError::Status {
            status,
            code,
            message,
        }) if (400..500).contains(&status) && status != 429 => {
            let c = S3ErrorCode::from_bytes(code.as_bytes())
                .unwrap_or_else(|| S3ErrorCode::Custom(code.clone().into()));
            let mut err = S3Error::with_message(c, format!("the upstream answered: {message}"));
            if let Ok(st) = http::StatusCode::from_u16(status) {
                err.set_status_code(st);
            }
            err
        }
        CacheError::NoSuchKey => {
            S3Error::with_message(S3ErrorCode::NoSuchKey, "The specified key does not exist.")
        }
        CacheError::Store(e) => s3_error(e),
        CacheError::Invalid(m) => S3Error::with_message(S3ErrorCode::InvalidArgument, m),
        CacheError::Busy(m) => S3Error::with_message(S3ErrorCode::SlowDown, m),
        e @ (CacheError::Upstream(_) | CacheError::Changed | CacheError::Failed(_)) => {
            S3Error::with_message(
                S3ErrorCode::ServiceUnavailable,
                format!("the cache's upstream could not answer: {e}"),
            )
        }
        e => S3Error::with_message(S3ErrorCode::InternalError, e.to_string()),
    }
}

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

    /// A write to `bucket`: None when it is no cache bucket, the cache
    /// bucket when it writes through, an error when it refuses writes.
    pub(crate) fn cache_write(&self, bucket: &str) -> S3Result<Option<Arc<CacheBucket>>> {
        match self.cache_of(bucket) {
            Some(cb) if cb.writes == Writes::Through => Ok(Some(cb)),
            Some(_) => self.refuse_cache_write(bucket).map(|()| None),
            None => Ok(None),
        }
    }

    pub(crate) async fn put_through(
        &self,
        cb: &Arc<CacheBucket>,
        key: &str,
        body: ObjectBody,
        headers: &http::HeaderMap,
    ) -> S3Result<S3Response<PutObjectOutput>> {
        let (e, version_id) = cb
            .put_through(key, body, forwarded(headers, false))
            .await
            .map_err(cache_error)?;
        Ok(S3Response::new(PutObjectOutput {
            e_tag: Some(crate::util::etag(&e)),
            version_id,
            ..Default::default()
        }))
    }

    pub(crate) async fn delete_through(
        &self,
        cb: &Arc<CacheBucket>,
        key: &str,
        version_id: Option<&str>,
        if_match: Option<String>,
    ) -> S3Result<S3Response<DeleteObjectOutput>> {
        if version_id.is_some() {
            return Err(S3Error::with_message(
                S3ErrorCode::NotImplemented,
                "a cache bucket deletes the upstream's current object only (no versionId)",
            ));
        }
        cb.delete_through(key, if_match)
            .await
            .map_err(cache_error)?;
        Ok(S3Response::new(DeleteObjectOutput::default()))
    }

    pub(crate) async fn create_upload_through(
        &self,
        cb: &Arc<CacheBucket>,
        key: &str,
        headers: &http::HeaderMap,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        let h = forwarded(headers, false);
        let h: Vec<(&str, String)> = h.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
        let (_, doc) = cb
            .multipart_through(
                "POST",
                key,
                &[("uploads", "")],
                &h,
                Upstream::body_of(Default::default()),
            )
            .await
            .map_err(cache_error)?;
        let upload_id = tarn_client::object::xml::first(&doc, "UploadId").ok_or_else(|| {
            S3Error::with_message(
                S3ErrorCode::InternalError,
                "the upstream answered no UploadId",
            )
        })?;
        Ok(S3Response::new(CreateMultipartUploadOutput {
            bucket: Some(cb.name.clone()),
            key: Some(key.to_string()),
            upload_id: Some(upload_id),
            ..Default::default()
        }))
    }

    pub(crate) async fn upload_part_through(
        &self,
        cb: &Arc<CacheBucket>,
        key: &str,
        upload_id: &str,
        part_number: i32,
        body: ObjectBody,
        headers: &http::HeaderMap,
    ) -> S3Result<S3Response<UploadPartOutput>> {
        let e = cb
            .upload_part_through(key, upload_id, part_number, body, forwarded(headers, true))
            .await
            .map_err(cache_error)?;
        Ok(S3Response::new(UploadPartOutput {
            e_tag: Some(crate::util::etag(&e)),
            ..Default::default()
        }))
    }

    pub(crate) async fn complete_upload_through(
        &self,
        cb: &Arc<CacheBucket>,
        key: &str,
        upload_id: &str,
        parts: &[CompletedPart],
        mut headers: Vec<(&str, String)>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        let mut xml = String::from("<CompleteMultipartUpload>");
        for p in parts {
            let (Some(n), Some(e)) = (p.part_number, p.e_tag.as_ref()) else {
                return Err(S3Error::with_message(
                    S3ErrorCode::MalformedXML,
                    "every part needs PartNumber and ETag",
                ));
            };
            let e = match e {
                ETag::Strong(s) | ETag::Weak(s) => s,
            };
            xml.push_str(&format!(
                "<Part><PartNumber>{n}</PartNumber><ETag>\"{}\"</ETag></Part>",
                tarn_client::object::xml::escape(e.trim_matches('"'))
            ));
        }
        xml.push_str("</CompleteMultipartUpload>");
        headers.push(("content-type", "application/xml".into()));
        let (h, doc) = cb
            .multipart_through(
                "POST",
                key,
                &[("uploadId", upload_id)],
                &headers,
                Upstream::body_of(xml.into()),
            )
            .await
            .map_err(cache_error)?;
        // S3 may answer 200 with an error document.
        if let Some(code) = tarn_client::object::xml::first(&doc, "Code") {
            let message = tarn_client::object::xml::first(&doc, "Message").unwrap_or_default();
            return Err(cache_error(CacheError::Upstream(UpstreamError::Status {
                status: 400,
                code,
                message,
            })));
        }
        let e = tarn_client::object::xml::first(&doc, "ETag").unwrap_or_default();
        Ok(S3Response::new(CompleteMultipartUploadOutput {
            bucket: Some(cb.name.clone()),
            key: Some(key.to_string()),
            e_tag: Some(crate::util::etag(e.trim_matches('"'))),
            version_id: h
                .get("x-amz-version-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string),
            ..Default::default()
        }))
    }

    pub(crate) async fn abort_upload_through(
        &self,
        cb: &Arc<CacheBucket>,
        key: &str,
        upload_id: &str,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        cb.multipart_through(
            "DELETE",
            key,
            &[("uploadId", upload_id)],
            &[],
            Upstream::body_of(Default::default()),
        )
        .await
        .map_err(cache_error)?;
        Ok(S3Response::new(AbortMultipartUploadOutput::default()))
    }

    /// GET `.tarn-prefetch/PREFIX`: a prefetch of PREFIX started, its job
    /// answered as a JSON document.
    pub(crate) fn prefetch_by_get(
        &self,
        cb: &Arc<CacheBucket>,
        prefix: &str,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        let job = self
            .access
            .caches
            .prefetch(
                &cb.name,
                crate::cache::PrefetchSpec {
                    prefix: Some(prefix.to_string()),
                    keys: Vec::new(),
                },
            )
            .map_err(cache_error)?;
        let mut doc = serde_json::to_vec_pretty(&job.json()).expect("a job serializes");
        doc.push(b'\n');
        let len = doc.len() as i64;
        Ok(S3Response::new(GetObjectOutput {
            body: Some(StreamingBlob::from(s3s::Body::from(bytes::Bytes::from(
                doc,
            )))),
            content_length: Some(len),
            content_type: Some("application/json".into()),
            ..Default::default()
        }))
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
        cb.list(
            &params.prefix,
            params.delimiter.as_deref(),
            params.after.as_deref(),
            params.max_keys,
        )
        .await
        .map_err(cache_error)
    }

    /// What a HEAD says of an object: the engine's version, or a cache
    /// bucket's entry (validated as the bucket says).
    pub(crate) async fn object_info(
        &self,
        ext: &http::Extensions,
        bucket: &str,
        key: &str,
        version_id: Option<&str>,
        part_number: Option<i32>,
    ) -> S3Result<ObjectInfo> {
        match self.cache_of(bucket) {
            Some(cb) => {
                plain_read(version_id, part_number)?;
                let (_, info, _) = self
                    .cache_open(ext, &cb, key, None, &ReadConditions::default())
                    .await?;
                Ok(info)
            }
            None => self
                .store
                .head_object(bucket, key, version_id)
                .await
                .map_err(s3_error),
        }
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

/// The headers of a write the upstream must see: the object's type,
/// stored headers, user metadata, tags, ACL, conditions and declared
/// digests (for a part: its digests only). aws-chunked framing is this server's business.
fn forwarded(h: &http::HeaderMap, part: bool) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (k, v) in h {
        let name = k.as_str();
        let Ok(v) = v.to_str() else { continue };
        let keep = name == "content-md5"
            // Digests sent up front; an upload's algorithm is not (its
            // parts' checksums come in trailers this server checks).
            || (name.starts_with("x-amz-checksum-")
                && !part
                && name != "x-amz-checksum-algorithm"
                && name != "x-amz-checksum-type")
            || (!part
                && (matches!(
                    name,
                    "content-type"
                        | "cache-control"
                        | "content-disposition"
                        | "content-language"
                        | "expires"
                        | "x-amz-tagging"
                        // Conditions and ACLs are the upstream's to honour
                        // or refuse, never dropped.
                        | "if-match"
                        | "if-none-match"
                        | "x-amz-acl"
                ) || name.starts_with("x-amz-meta-")
                    || name.starts_with("x-amz-grant-")));
        if keep {
            out.push((name.to_string(), v.to_string()));
        } else if name == "content-encoding" && !part {
            let rest: Vec<&str> = v
                .split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty() && *e != "aws-chunked")
                .collect();
            if !rest.is_empty() {
                out.push((name.to_string(), rest.join(",")));
            }
        }
    }
    out
}
