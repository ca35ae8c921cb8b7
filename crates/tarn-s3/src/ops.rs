//! The S3 operations: each turns a typed request into engine calls.

use std::collections::HashMap;
use std::sync::Arc;

use s3s::dto::*;
use s3s::{S3Error, S3ErrorCode, S3Request, S3Response, S3Result, S3};
use tarn_store::{
    ByteRange, Durability, ListParams, ObjectInfo, PutOptions, ReadConditions, Store,
    VersionListParams, Versioning,
};

use crate::access::Ownership;
use crate::access::{permit_of, Access, BucketAccess, DeniedDeletes, Permit};
use crate::acl::{Acl, ACL_HEADER};
use crate::body::{checked_body, content_md5, object_body, ChecksumSpec, CHECKSUM_ALGORITHMS};
use crate::error::s3_error;
use crate::util::*;
use tarn_store::checksum::ChecksumType as ChecksumKind;

/// The S3 front of one node.
pub struct TarnS3 {
    pub(crate) store: Arc<Store>,
    pub(crate) access: Arc<Access>,
    pub(crate) region: String,
    /// Master and KMS keys of server-side encryption.
    pub(crate) keys: Arc<crate::sse::KeyRing>,
}

impl TarnS3 {
    /// Opens a copy source with its x-amz-copy-source-if-* conditions checked on
    /// the same metadata read that serves the bytes. For copies every failed
    /// condition is 412, never 304.
    /// The source must be readable by the caller: a pending object-ACL
    /// check (`Permit::source`) is decided on the version read.
    async fn open_copy_source(
        &self,
        ext: &http::Extensions,
        headers: &http::HeaderMap,
        source: &CopySource,
        conditions: ReadConditions,
        range: Option<ByteRange>,
    ) -> S3Result<tarn_store::GetResult> {
        let (bucket, key, version) = copy_source(source)?;
        self.refuse_on_cache(&bucket, "copying from a cache bucket")?;
        let customer = crate::sse::customer_key(headers, true)?;
        let got = self
            .get_decrypted(
                ext,
                &bucket,
                &key,
                version.as_deref(),
                range,
                None,
                &conditions,
                customer.as_ref(),
            )
            .await
            .map_err(|r| {
                use crate::error::precondition_failed;
                let e = match r {
                    crate::ops_sse::Refused::S3(e) => return e,
                    crate::ops_sse::Refused::Store(e) => e,
                };
                match e {
                    tarn_store::StoreError::NotModified { .. } => {
                        precondition_failed(match conditions.if_none_match {
                            Some(_) => "x-amz-copy-source-If-None-Match",
                            None => "x-amz-copy-source-If-Modified-Since",
                        })
                    }
                    tarn_store::StoreError::PreconditionFailed(c) => precondition_failed(match c {
                        "If-Match" => "x-amz-copy-source-If-Match",
                        _ => "x-amz-copy-source-If-Unmodified-Since",
                    }),
                    e => s3_error(e),
                }
            })?;
        if let Some(p) = permit_of(ext) {
            p.allows_source(self.access.bucket(&bucket).as_deref(), &got.info)?;
        }
        Ok(got)
    }

    pub fn new(store: Arc<Store>, access: Arc<Access>, region: impl Into<String>) -> Self {
        TarnS3 {
            store,
            access,
            region: region.into(),
            keys: Arc::new(crate::sse::KeyRing::default()),
        }
    }

    /// The keys server-side encryption wraps data keys with.
    pub fn with_keys(mut self, keys: Arc<crate::sse::KeyRing>) -> Self {
        self.keys = keys;
        self
    }

    /// The access settings of `bucket`: those the request's check judged
    /// it by when it is the request's bucket, else (root, which is not
    /// judged; a copy's source bucket) the current ones.
    pub(crate) fn bucket_access(
        &self,
        ext: &http::Extensions,
        bucket: &str,
    ) -> S3Result<Arc<BucketAccess>> {
        if let Some(b) = permit_of(ext)
            .and_then(|p| p.bucket.as_ref())
            .filter(|b| b.doc.bucket() == bucket)
        {
            return Ok(b.clone());
        }
        self.access
            .bucket(bucket)
            .ok_or_else(|| s3_error(tarn_store::StoreError::NoSuchBucket(bucket.to_string())))
    }

    /// The stored ACL header of an object a request writes into `bucket`
    /// (x-amz-acl, x-amz-grant-*, the bucket's object ownership).
    fn object_acl_header(
        &self,
        ext: &http::Extensions,
        headers: &http::HeaderMap,
        bucket: &str,
    ) -> S3Result<Option<(String, String)>> {
        let b = self.bucket_access(ext, bucket)?;
        let caller = permit_of(ext).and_then(Permit::caller);
        Ok(self
            .access
            .object_acl_for_write(&b, caller, headers)?
            .map(|v| (ACL_HEADER.to_string(), v)))
    }
}

/// S3 copies at most 5 GiB in one CopyObject; larger objects are copied with
/// UploadPartCopy ranges.
const COPY_SOURCE_MAX_BYTES: u64 = 5 << 30;

/// An owner as S3 lists it: Tarn's canonical ID and display name of a user
/// are its name.
fn owner_named(name: &str) -> Owner {
    Owner {
        display_name: Some(name.to_string()),
        id: Some(name.to_string()),
    }
}

/// The internal header of an upload that names the user who created it
/// (`Initiator` in ListParts and ListMultipartUploads); never returned.
const INITIATOR_HEADER: &str = "x-tarn-initiator";

/// The owner and initiator of an upload with these stored headers.
fn upload_people(b: &BucketAccess, headers: &[(String, String)]) -> (Owner, Initiator) {
    let owner = b.acl_of(headers).owner;
    let initiator = headers
        .iter()
        .find(|(k, _)| k == INITIATOR_HEADER)
        .map_or(owner.as_str(), |(_, v)| v.as_str());
    (
        owner_named(&owner),
        Initiator {
            display_name: Some(initiator.to_string()),
            id: Some(initiator.to_string()),
        },
    )
}

/// Characters XML 1.0 cannot carry at all (C0 controls but tab and line
/// feed, U+FFFE, U+FFFF), and carriage return, which parsers turn into a line
/// feed: a name with any of them is not what the client would read back.
fn xml_unsafe(s: &str) -> bool {
    s.chars()
        .any(|c| matches!(c, '\u{0}'..='\u{8}' | '\u{b}'..='\u{1f}' | '\u{fffe}' | '\u{ffff}'))
}

/// Whether a listing is URL-encoded: when the client asked, and also when a
/// name in it could not be written as XML 1.0 (a key with control characters).
/// AWS writes those as `&#x1;`, which XML parsers reject, so the whole
/// listing fails to parse in the aws CLI and boto3; here the response
/// encodes every name instead and says so in `<EncodingType>url`.
/// The names: the page's keys, its common prefixes, and the request's and
/// answer's other name fields (prefix, markers, delimiter).
fn listing_url_encoded<'a>(
    requested: &Option<EncodingType>,
    mut keys: impl Iterator<Item = &'a str>,
    common_prefixes: &[String],
    fields: &[Option<&str>],
) -> bool {
    requested
        .as_ref()
        .is_some_and(|e| e.as_str() == EncodingType::URL)
        || keys.any(xml_unsafe)
        || common_prefixes.iter().any(|p| xml_unsafe(p))
        || fields.iter().flatten().any(|f| xml_unsafe(f))
}

/// A key for a response element that has no encoding-type: left out when
/// XML 1.0 cannot carry it (the client knows the key it sent; an element
/// it cannot parse would fail the whole response).
fn xml_key(key: String) -> Option<String> {
    (!xml_unsafe(&key)).then_some(key)
}

fn encoding_type_of(url: bool) -> Option<EncodingType> {
    url.then(|| EncodingType::from_static(EncodingType::URL))
}

/// URL-encodes a name of a listing that asked for (or needs) it. `/` stays
/// as it is, as in S3: clients split keys on it before decoding.
fn encode_if(url: bool, s: String) -> String {
    if url {
        s.split('/')
            .map(|seg| urlencoding::encode(seg))
            .collect::<Vec<_>>()
            .join("/")
    } else {
        s
    }
}

/// A delimiter parameter: an empty one is no delimiter (S3 neither groups
/// by it nor echoes it).
fn delimiter_of(d: Option<String>) -> Option<String> {
    d.filter(|d| !d.is_empty())
}

/// The stored Content-Encoding: `aws-chunked` describes how the request body
/// was sent, not the object, and is left out (S3 does the same); nothing is
/// stored when it was the only coding. The rest is kept as it was sent
/// (`deflate, gzip` stays so, spaces included).
fn stored_content_encoding(v: Option<String>) -> Option<String> {
    let v = v?;
    let kept: Vec<&str> = v
        .split(',')
        .filter(|c| !c.trim().is_empty() && !c.trim().eq_ignore_ascii_case("aws-chunked"))
        .collect();
    let joined = kept.join(",");
    let joined = joined.trim();
    (!joined.is_empty()).then(|| joined.to_string())
}

/// The system headers S3 stores with an object, from any request input that
/// carries them (PutObject, CopyObject, CreateMultipartUpload).
macro_rules! stored_headers {
    ($i:expr) => {
        [
            ("cache-control", $i.cache_control.clone()),
            ("content-disposition", $i.content_disposition.clone()),
            (
                "content-encoding",
                stored_content_encoding($i.content_encoding.clone()),
            ),
            ("content-language", $i.content_language.clone()),
            ("expires", expires_string($i.expires.clone())),
        ]
    };
}

/// The x-amz-checksum-* headers of a request, in `CHECKSUM_ALGORITHMS` order.
macro_rules! declared_checksums {
    ($i:expr) => {
        [
            $i.checksum_crc32.as_ref(),
            $i.checksum_crc32c.as_ref(),
            $i.checksum_crc64nvme.as_ref(),
            $i.checksum_sha1.as_ref(),
            $i.checksum_sha256.as_ref(),
        ]
    };
}

/// The response fields GET and HEAD share, for the struct-update syntax:
/// `Output { content_length: …, ..object_fields!(Output, info, checksums, type) }`.
macro_rules! object_fields {
    ($ty:ident, $info:expr, $checksums:expr, $checksum_type:expr) => {{
        let info: &ObjectInfo = &$info;
        let [crc32, crc32c, crc64nvme, sha1, sha256]: [Option<String>; 5] = $checksums;
        $ty {
            accept_ranges: Some("bytes".into()),
            content_type: Some(info.content_type.clone()),
            e_tag: Some(etag(&info.etag)),
            last_modified: Some(timestamp(info.last_modified_ns)),
            metadata: metadata_map(info),
            version_id: info.version_id.clone(),
            cache_control: header_of(info, "cache-control"),
            content_disposition: header_of(info, "content-disposition"),
            content_encoding: header_of(info, "content-encoding"),
            content_language: header_of(info, "content-language"),
            expires: header_of(info, "expires")
                .and_then(|e| Timestamp::parse(TimestampFormat::HttpDate, &e).ok()),
            checksum_crc32: crc32,
            checksum_crc32c: crc32c,
            checksum_crc64nvme: crc64nvme,
            checksum_sha1: sha1,
            checksum_sha256: sha256,
            checksum_type: $checksum_type,
            ..Default::default()
        }
    }};
}

/// Declared body length: the decoded length of aws-chunked bodies, else
/// Content-Length.
fn declared_len(headers: &http::HeaderMap, content_length: Option<i64>) -> Option<u64> {
    if let Some(v) = headers
        .get("x-amz-decoded-content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
    {
        return Some(v);
    }
    let streaming = headers
        .get("x-amz-content-sha256")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("STREAMING-"));
    if streaming {
        return None;
    }
    content_length.and_then(|l| u64::try_from(l).ok())
}

fn put_options(
    content_type: Option<String>,
    headers: [(&str, Option<String>); 5],
    metadata: Option<HashMap<String, String>>,
    tags: Vec<(String, String)>,
) -> PutOptions {
    let mut user_metadata: Vec<(String, String)> = metadata
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| (k.to_ascii_lowercase(), v))
        .collect();
    user_metadata.sort();
    PutOptions {
        content_type,
        headers: headers
            .into_iter()
            .filter_map(|(k, v)| v.map(|v| (k.to_string(), v)))
            .collect(),
        user_metadata,
        tags,
        ..Default::default()
    }
}

fn expires_string(e: Option<Timestamp>) -> Option<String> {
    e.map(|t| {
        let mut buf = Vec::new();
        let _ = t.format(TimestampFormat::HttpDate, &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

fn header_of(info: &ObjectInfo, name: &str) -> Option<String> {
    info.headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.clone())
}

fn metadata_map(info: &ObjectInfo) -> Option<HashMap<String, String>> {
    if info.user_metadata.is_empty() {
        None
    } else {
        Some(info.user_metadata.iter().cloned().collect())
    }
}

fn condition_string(c: Option<&ETagCondition>) -> Option<String> {
    c.map(|c| match c {
        ETagCondition::Any => "*".to_string(),
        ETagCondition::ETag(e) => e.value().to_string(),
    })
}

fn read_conditions(
    if_match: Option<&ETagCondition>,
    if_none_match: Option<&ETagCondition>,
    if_modified_since: Option<&Timestamp>,
    if_unmodified_since: Option<&Timestamp>,
) -> ReadConditions {
    ReadConditions {
        if_match: condition_string(if_match),
        if_none_match: condition_string(if_none_match),
        if_modified_since_s: if_modified_since.map(timestamp_secs),
        if_unmodified_since_s: if_unmodified_since.map(timestamp_secs),
    }
}

/// Evaluates GET/HEAD conditional headers (RFC 9110 order, as S3 does).
fn check_conditions(
    info: &ObjectInfo,
    if_match: Option<&ETagCondition>,
    if_none_match: Option<&ETagCondition>,
    if_modified_since: Option<&Timestamp>,
    if_unmodified_since: Option<&Timestamp>,
) -> S3Result<()> {
    read_conditions(
        if_match,
        if_none_match,
        if_modified_since,
        if_unmodified_since,
    )
    .check(info)
    .map_err(s3_error)
}

/// Runs a GET whose stream becomes the response body as it is: where the
/// front marked the request's connection as sending from files, the
/// store may hand its blocks on as views of their files
/// (`tarn_store::store::SENDS_FROM_FILES`).
async fn sends_from_files<F: std::future::Future>(ext: &http::Extensions, get: F) -> F::Output {
    let on = ext.get::<tarn_store::store::SendsFromFiles>().is_some();
    tarn_store::store::SENDS_FROM_FILES.scope(on, get).await
}

fn range_of(r: Option<Range>) -> Option<ByteRange> {
    r.map(|r| match r {
        Range::Int {
            first,
            last: Some(last),
        } => ByteRange::Closed(first, last),
        Range::Int { first, last: None } => ByteRange::From(first),
        Range::Suffix { length } => ByteRange::Suffix(length),
    })
}

/// The checksum a GET or HEAD with `x-amz-checksum-mode: ENABLED` returns:
/// the whole object's, or for `partNumber` the part's (a multipart object
/// keeps each part's checksum), with its type. None for a byte range.
fn response_checksum(
    info: &ObjectInfo,
    part_number: Option<u32>,
    ranged: bool,
) -> Option<(String, String)> {
    if ranged {
        return None;
    }
    match part_number {
        Some(n) if !info.parts.is_empty() => info
            .parts
            .iter()
            .find(|p| p.number == n)
            .and_then(|p| p.checksum.clone()),
        _ => info.checksum.clone(),
    }
}

/// An x-amz-checksum-type value of a request.
fn checksum_type_arg(t: &ChecksumType) -> S3Result<ChecksumKind> {
    ChecksumKind::parse(t.as_str()).ok_or_else(|| {
        S3Error::with_message(
            S3ErrorCode::InvalidRequest,
            format!(
                "Unknown x-amz-checksum-type {}: expected COMPOSITE or FULL_OBJECT.",
                t.as_str()
            ),
        )
    })
}

pub(crate) fn checksum_type_of(c: &Option<(String, String)>) -> Option<ChecksumType> {
    c.as_ref()
        .map(|(_, v)| ChecksumType::from(ChecksumKind::of_value(v).as_str().to_string()))
}

pub(crate) fn checksum_fields(c: &Option<(String, String)>) -> [Option<String>; 5] {
    let mut out: [Option<String>; 5] = Default::default();
    if let Some((algo, v)) = c {
        if let Some(i) = CHECKSUM_ALGORITHMS.iter().position(|a| a == algo) {
            out[i] = Some(v.clone());
        }
    }
    out
}

/// Cache buckets pass objects through to their upstream: encryption asked
/// of one is refused, never dropped.
fn refuse_encryption_on_cache(headers: &http::HeaderMap) -> S3Result<()> {
    if crate::sse::asked(headers)? != crate::sse::Asked::Nothing {
        return Err(S3Error::with_message(
            S3ErrorCode::NotImplemented,
            "A cache bucket stores what its upstream holds: server-side encryption is not supported on it; nothing was stored.",
        ));
    }
    Ok(())
}

fn copy_source(cs: &CopySource) -> S3Result<(String, String, Option<String>)> {
    match cs {
        CopySource::Bucket {
            bucket,
            key,
            version_id,
        } => Ok((
            bucket.to_string(),
            key.to_string(),
            version_id.as_deref().map(str::to_string),
        )),
        _ => Err(S3Error::with_message(
            S3ErrorCode::NotImplemented,
            "access point copy sources are not supported",
        )),
    }
}

#[async_trait::async_trait]
impl S3 for TarnS3 {
    async fn get_bucket_acl(
        &self,
        req: S3Request<GetBucketAclInput>,
    ) -> S3Result<S3Response<GetBucketAclOutput>> {
        self.op_get_bucket_acl(req).await
    }

    async fn put_bucket_acl(
        &self,
        req: S3Request<PutBucketAclInput>,
    ) -> S3Result<S3Response<PutBucketAclOutput>> {
        self.op_put_bucket_acl(req).await
    }

    async fn get_object_attributes(
        &self,
        req: S3Request<GetObjectAttributesInput>,
    ) -> S3Result<S3Response<GetObjectAttributesOutput>> {
        let hide = hides_missing(&req.extensions);
        self.op_get_object_attributes(req)
            .await
            .map_err(|e| missing_unless_listable(e, hide))
    }

    async fn get_object_acl(
        &self,
        req: S3Request<GetObjectAclInput>,
    ) -> S3Result<S3Response<GetObjectAclOutput>> {
        self.refuse_on_cache(&req.input.bucket, "GetObjectAcl")?;
        self.op_get_object_acl(req).await
    }

    async fn put_object_acl(
        &self,
        req: S3Request<PutObjectAclInput>,
    ) -> S3Result<S3Response<PutObjectAclOutput>> {
        self.refuse_on_cache(&req.input.bucket, "PutObjectAcl")?;
        self.op_put_object_acl(req).await
    }

    async fn get_bucket_policy(
        &self,
        req: S3Request<GetBucketPolicyInput>,
    ) -> S3Result<S3Response<GetBucketPolicyOutput>> {
        self.op_get_bucket_policy(req).await
    }

    async fn get_object_lock_configuration(
        &self,
        req: S3Request<GetObjectLockConfigurationInput>,
    ) -> S3Result<S3Response<GetObjectLockConfigurationOutput>> {
        self.refuse_on_cache(&req.input.bucket, "GetObjectLockConfiguration")?;
        self.op_get_object_lock_configuration(req).await
    }

    async fn put_object_lock_configuration(
        &self,
        req: S3Request<PutObjectLockConfigurationInput>,
    ) -> S3Result<S3Response<PutObjectLockConfigurationOutput>> {
        self.refuse_on_cache(&req.input.bucket, "PutObjectLockConfiguration")?;
        self.op_put_object_lock_configuration(req).await
    }

    async fn get_object_retention(
        &self,
        req: S3Request<GetObjectRetentionInput>,
    ) -> S3Result<S3Response<GetObjectRetentionOutput>> {
        self.refuse_on_cache(&req.input.bucket, "GetObjectRetention")?;
        self.op_get_object_retention(req).await
    }

    async fn put_object_retention(
        &self,
        req: S3Request<PutObjectRetentionInput>,
    ) -> S3Result<S3Response<PutObjectRetentionOutput>> {
        self.refuse_on_cache(&req.input.bucket, "PutObjectRetention")?;
        self.op_put_object_retention(req).await
    }

    async fn get_object_legal_hold(
        &self,
        req: S3Request<GetObjectLegalHoldInput>,
    ) -> S3Result<S3Response<GetObjectLegalHoldOutput>> {
        self.refuse_on_cache(&req.input.bucket, "GetObjectLegalHold")?;
        self.op_get_object_legal_hold(req).await
    }

    async fn put_object_legal_hold(
        &self,
        req: S3Request<PutObjectLegalHoldInput>,
    ) -> S3Result<S3Response<PutObjectLegalHoldOutput>> {
        self.refuse_on_cache(&req.input.bucket, "PutObjectLegalHold")?;
        self.op_put_object_legal_hold(req).await
    }

    async fn get_bucket_encryption(
        &self,
        req: S3Request<GetBucketEncryptionInput>,
    ) -> S3Result<S3Response<GetBucketEncryptionOutput>> {
        self.refuse_on_cache(&req.input.bucket, "GetBucketEncryption")?;
        self.op_get_bucket_encryption(req).await
    }

    async fn put_bucket_encryption(
        &self,
        req: S3Request<PutBucketEncryptionInput>,
    ) -> S3Result<S3Response<PutBucketEncryptionOutput>> {
        self.refuse_on_cache(&req.input.bucket, "PutBucketEncryption")?;
        self.op_put_bucket_encryption(req).await
    }

    async fn delete_bucket_encryption(
        &self,
        req: S3Request<DeleteBucketEncryptionInput>,
    ) -> S3Result<S3Response<DeleteBucketEncryptionOutput>> {
        self.refuse_on_cache(&req.input.bucket, "DeleteBucketEncryption")?;
        self.op_delete_bucket_encryption(req).await
    }

    async fn put_bucket_policy(
        &self,
        req: S3Request<PutBucketPolicyInput>,
    ) -> S3Result<S3Response<PutBucketPolicyOutput>> {
        self.op_put_bucket_policy(req).await
    }

    async fn delete_bucket_policy(
        &self,
        req: S3Request<DeleteBucketPolicyInput>,
    ) -> S3Result<S3Response<DeleteBucketPolicyOutput>> {
        self.op_delete_bucket_policy(req).await
    }

    async fn get_bucket_policy_status(
        &self,
        req: S3Request<GetBucketPolicyStatusInput>,
    ) -> S3Result<S3Response<GetBucketPolicyStatusOutput>> {
        self.op_get_bucket_policy_status(req).await
    }

    async fn get_public_access_block(
        &self,
        req: S3Request<GetPublicAccessBlockInput>,
    ) -> S3Result<S3Response<GetPublicAccessBlockOutput>> {
        self.op_get_public_access_block(req).await
    }

    async fn put_public_access_block(
        &self,
        req: S3Request<PutPublicAccessBlockInput>,
    ) -> S3Result<S3Response<PutPublicAccessBlockOutput>> {
        self.op_put_public_access_block(req).await
    }

    async fn delete_public_access_block(
        &self,
        req: S3Request<DeletePublicAccessBlockInput>,
    ) -> S3Result<S3Response<DeletePublicAccessBlockOutput>> {
        self.op_delete_public_access_block(req).await
    }

    async fn get_bucket_tagging(
        &self,
        req: S3Request<GetBucketTaggingInput>,
    ) -> S3Result<S3Response<GetBucketTaggingOutput>> {
        self.op_get_bucket_tagging(req).await
    }

    async fn put_bucket_tagging(
        &self,
        req: S3Request<PutBucketTaggingInput>,
    ) -> S3Result<S3Response<PutBucketTaggingOutput>> {
        self.op_put_bucket_tagging(req).await
    }

    async fn delete_bucket_tagging(
        &self,
        req: S3Request<DeleteBucketTaggingInput>,
    ) -> S3Result<S3Response<DeleteBucketTaggingOutput>> {
        self.op_delete_bucket_tagging(req).await
    }

    async fn get_bucket_logging(
        &self,
        req: S3Request<GetBucketLoggingInput>,
    ) -> S3Result<S3Response<GetBucketLoggingOutput>> {
        self.op_get_bucket_logging(req).await
    }

    async fn put_bucket_logging(
        &self,
        req: S3Request<PutBucketLoggingInput>,
    ) -> S3Result<S3Response<PutBucketLoggingOutput>> {
        self.op_put_bucket_logging(req).await
    }

    async fn get_bucket_request_payment(
        &self,
        req: S3Request<GetBucketRequestPaymentInput>,
    ) -> S3Result<S3Response<GetBucketRequestPaymentOutput>> {
        self.op_get_bucket_request_payment(req).await
    }

    async fn put_bucket_request_payment(
        &self,
        req: S3Request<PutBucketRequestPaymentInput>,
    ) -> S3Result<S3Response<PutBucketRequestPaymentOutput>> {
        self.op_put_bucket_request_payment(req).await
    }

    async fn get_bucket_lifecycle_configuration(
        &self,
        req: S3Request<GetBucketLifecycleConfigurationInput>,
    ) -> S3Result<S3Response<GetBucketLifecycleConfigurationOutput>> {
        self.op_get_bucket_lifecycle_configuration(req).await
    }

    async fn put_bucket_lifecycle_configuration(
        &self,
        req: S3Request<PutBucketLifecycleConfigurationInput>,
    ) -> S3Result<S3Response<PutBucketLifecycleConfigurationOutput>> {
        self.op_put_bucket_lifecycle_configuration(req).await
    }

    async fn delete_bucket_lifecycle(
        &self,
        req: S3Request<DeleteBucketLifecycleInput>,
    ) -> S3Result<S3Response<DeleteBucketLifecycleOutput>> {
        self.op_delete_bucket_lifecycle(req).await
    }

    async fn get_bucket_cors(
        &self,
        req: S3Request<GetBucketCorsInput>,
    ) -> S3Result<S3Response<GetBucketCorsOutput>> {
        self.op_get_bucket_cors(req).await
    }

    async fn put_bucket_cors(
        &self,
        req: S3Request<PutBucketCorsInput>,
    ) -> S3Result<S3Response<PutBucketCorsOutput>> {
        self.op_put_bucket_cors(req).await
    }

    async fn delete_bucket_cors(
        &self,
        req: S3Request<DeleteBucketCorsInput>,
    ) -> S3Result<S3Response<DeleteBucketCorsOutput>> {
        self.op_delete_bucket_cors(req).await
    }

    async fn get_bucket_ownership_controls(
        &self,
        req: S3Request<GetBucketOwnershipControlsInput>,
    ) -> S3Result<S3Response<GetBucketOwnershipControlsOutput>> {
        self.op_get_bucket_ownership_controls(req).await
    }

    async fn put_bucket_ownership_controls(
        &self,
        req: S3Request<PutBucketOwnershipControlsInput>,
    ) -> S3Result<S3Response<PutBucketOwnershipControlsOutput>> {
        self.op_put_bucket_ownership_controls(req).await
    }

    async fn delete_bucket_ownership_controls(
        &self,
        req: S3Request<DeleteBucketOwnershipControlsInput>,
    ) -> S3Result<S3Response<DeleteBucketOwnershipControlsOutput>> {
        self.op_delete_bucket_ownership_controls(req).await
    }

    async fn list_buckets(
        &self,
        req: S3Request<ListBucketsInput>,
    ) -> S3Result<S3Response<ListBucketsOutput>> {
        let i = req.input;
        let caller = permit_of(&req.extensions).and_then(Permit::caller);
        let max = match i.max_buckets {
            None => usize::MAX,
            Some(n) if !(1..=10_000).contains(&n) => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    "max-buckets must be an integer between 1 and 10000",
                ))
            }
            Some(n) => n as usize,
        };
        let after = i
            .continuation_token
            .as_deref()
            .map(decode_token)
            .transpose()?;
        let prefix = i.prefix.clone().unwrap_or_default();
        // Every bucket of this node is in its one region.
        let other_region = i
            .bucket_region
            .as_ref()
            .is_some_and(|r| r.as_str() != self.region);
        if self.store.buckets_partial() {
            return Err(crate::error::s3_error(self.store.partial_buckets_error()));
        }
        let mut all = self.store.list_buckets();
        all.retain(|b| self.lists_bucket(caller, &b.name));
        all.sort_by(|a, b| a.name.cmp(&b.name));
        let mut page: Vec<Bucket> = Vec::new();
        let mut truncated = false;
        for b in all.into_iter().filter(|b| {
            !other_region
                && b.name.starts_with(&prefix)
                && after.as_ref().is_none_or(|a| b.name.as_str() > a.as_str())
        }) {
            if page.len() == max {
                truncated = true;
                break;
            }
            page.push(Bucket {
                name: Some(b.name),
                creation_date: Some(timestamp(b.created_ns)),
                bucket_region: Some(self.region.clone()),
            });
        }
        let next = truncated
            .then(|| {
                page.last()
                    .and_then(|b| b.name.as_deref())
                    .map(encode_token)
            })
            .flatten();
        Ok(S3Response::new(ListBucketsOutput {
            buckets: Some(page),
            owner: caller.map(owner_named),
            continuation_token: next,
            prefix: i.prefix,
        }))
    }

    async fn create_bucket(
        &self,
        req: S3Request<CreateBucketInput>,
    ) -> S3Result<S3Response<CreateBucketOutput>> {
        if let Some(loc) = req
            .input
            .create_bucket_configuration
            .as_ref()
            .and_then(|c| c.location_constraint.as_ref())
        {
            if loc.as_str() != self.region
                && !(self.region == "us-east-1" && loc.as_str().is_empty())
            {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidLocationConstraint,
                    "The specified location-constraint is not valid",
                ));
            }
        }
        // Durability class per bucket: x-tarn-durability: erasure | replicated:N | single.
        let durability = match req
            .headers
            .get("x-tarn-durability")
            .and_then(|v| v.to_str().ok())
        {
            None | Some("erasure") => Durability::ErasureCoded,
            Some("single") => Durability::SingleCopy,
            Some(s) => match s
                .strip_prefix("replicated:")
                .and_then(|n| n.parse::<u8>().ok())
            {
                Some(n) if n >= 1 => Durability::Replicated(n),
                _ => {
                    return Err(S3Error::with_message(
                        S3ErrorCode::InvalidArgument,
                        "x-tarn-durability must be erasure, single or replicated:N",
                    ))
                }
            },
        };
        let caller = permit_of(&req.extensions)
            .and_then(Permit::caller)
            .ok_or_else(|| S3Error::new(S3ErrorCode::AccessDenied))?
            .to_string();
        // New buckets are made as AWS makes them: ACLs disabled
        // (BucketOwnerEnforced) unless x-amz-object-ownership says
        // otherwise, and public access blocked.
        let asked_ownership = req
            .headers
            .get("x-amz-object-ownership")
            .map(|v| Ownership::parse(v.to_str().unwrap_or("")))
            .transpose()?;
        let ownership = asked_ownership.unwrap_or_else(|| self.access.default_ownership());
        let asked_acl = self.access.requested_acl(&req.headers, &caller, &caller)?;
        let bucket = req.input.bucket.as_str();
        // An existing bucket is answered as such before what the request
        // asks of a new one is judged (AWS: 409 BucketAlreadyOwnedByYou for
        // one's own bucket asked with an ACL it cannot have, not 400).
        if self.access.bucket(bucket).is_some() {
            self.create_existing_bucket(
                &req.headers,
                bucket,
                &caller,
                durability,
                asked_ownership,
                asked_acl.as_ref(),
            )?;
            return Ok(S3Response::new(CreateBucketOutput {
                location: Some(format!("/{bucket}")),
            }));
        }
        let acl = asked_acl.clone().unwrap_or_else(|| Acl::private(&caller));
        if ownership == Ownership::BucketOwnerEnforced && !acl.owner_only(&caller) {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidBucketAclWithObjectOwnership,
                "Bucket cannot have ACLs set with ObjectOwnership's BucketOwnerEnforced setting",
            ));
        }
        if acl.is_public() && self.access.blocks_new_buckets() {
            return Err(S3Error::with_message(
                S3ErrorCode::AccessDenied,
                "A new bucket blocks public access: create it, delete its public access block, then put the ACL.",
            ));
        }
        match self
            .access
            .create_bucket(
                &caller,
                &req.input.bucket,
                durability,
                ownership,
                acl,
                req.input.object_lock_enabled_for_bucket.unwrap_or(false),
            )
            .await
        {
            Ok(()) => {}
            Err(tarn_store::StoreError::BucketExists(_)) => {
                self.create_existing_bucket(
                    &req.headers,
                    bucket,
                    &caller,
                    durability,
                    asked_ownership,
                    asked_acl.as_ref(),
                )?;
            }
            Err(e) => return Err(s3_error(e)),
        }
        Ok(S3Response::new(CreateBucketOutput {
            location: Some(format!("/{}", req.input.bucket)),
        }))
    }

    async fn head_bucket(
        &self,
        req: S3Request<HeadBucketInput>,
    ) -> S3Result<S3Response<HeadBucketOutput>> {
        self.store
            .head_bucket(&req.input.bucket)
            .map_err(s3_error)?;
        Ok(S3Response::new(HeadBucketOutput {
            bucket_region: Some(self.region.clone()),
            ..Default::default()
        }))
    }

    async fn delete_bucket(
        &self,
        req: S3Request<DeleteBucketInput>,
    ) -> S3Result<S3Response<DeleteBucketOutput>> {
        if self.cache_of(&req.input.bucket).is_some() {
            return Err(S3Error::with_message(
                S3ErrorCode::MethodNotAllowed,
                format!(
                    "bucket {} is a cache bucket: remove it with `tarn admin cache remove`",
                    req.input.bucket
                ),
            ));
        }
        self.access
            .delete_bucket(&req.input.bucket)
            .await
            .map_err(s3_error)?;
        Ok(S3Response::new(DeleteBucketOutput {}))
    }

    async fn get_bucket_location(
        &self,
        req: S3Request<GetBucketLocationInput>,
    ) -> S3Result<S3Response<GetBucketLocationOutput>> {
        self.store
            .head_bucket(&req.input.bucket)
            .map_err(s3_error)?;
        let location_constraint = (self.region != "us-east-1")
            .then(|| BucketLocationConstraint::from(self.region.clone()));
        Ok(S3Response::new(GetBucketLocationOutput {
            location_constraint,
        }))
    }

    async fn get_bucket_versioning(
        &self,
        req: S3Request<GetBucketVersioningInput>,
    ) -> S3Result<S3Response<GetBucketVersioningOutput>> {
        let b = self
            .store
            .head_bucket(&req.input.bucket)
            .map_err(s3_error)?;
        let status = match b.versioning {
            Versioning::Unversioned => None,
            Versioning::Enabled => Some(BucketVersioningStatus::from_static(
                BucketVersioningStatus::ENABLED,
            )),
            Versioning::Suspended => Some(BucketVersioningStatus::from_static(
                BucketVersioningStatus::SUSPENDED,
            )),
        };
        Ok(S3Response::new(GetBucketVersioningOutput {
            status,
            mfa_delete: None,
        }))
    }

    async fn put_bucket_versioning(
        &self,
        req: S3Request<PutBucketVersioningInput>,
    ) -> S3Result<S3Response<PutBucketVersioningOutput>> {
        self.refuse_cache_write(&req.input.bucket)?;
        let enabled = match req
            .input
            .versioning_configuration
            .status
            .as_ref()
            .map(|s| s.as_str())
        {
            Some(BucketVersioningStatus::ENABLED) => true,
            Some(BucketVersioningStatus::SUSPENDED) => false,
            _ => {
                return Err(S3Error::with_message(
                    S3ErrorCode::MalformedXML,
                    "Versioning status must be Enabled or Suspended",
                ))
            }
        };
        self.store
            .set_bucket_versioning(&req.input.bucket, enabled)
            .await
            .map_err(s3_error)?;
        Ok(S3Response::new(PutBucketVersioningOutput {}))
    }

    async fn put_object(
        &self,
        req: S3Request<PutObjectInput>,
    ) -> S3Result<S3Response<PutObjectOutput>> {
        let through = self.cache_write(&req.input.bucket)?;
        if through.is_some() {
            refuse_encryption_on_cache(&req.headers)?;
        }
        // A form upload whose key named ${filename}: the front writes the
        // name into the 201 body or redirect s3s makes from the form's key.
        let substituted = req
            .extensions
            .get::<crate::post::Substituted>()
            .map(|s| crate::post::percent_encode(&s.0));
        let headers = req.headers.clone();
        let trailers = req.trailing_headers.clone();
        let i = req.input;
        let acl = self.object_acl_header(&req.extensions, &headers, &i.bucket)?;
        let spec = ChecksumSpec::from_request(&headers, declared_checksums!(i))?;
        let md5 = content_md5(i.content_md5.as_ref())?;
        let tags = parse_tagging_header(i.tagging.as_ref())?;
        let mut opts = put_options(
            i.content_type.clone(),
            stored_headers!(i),
            i.metadata.clone(),
            tags,
        );
        opts.headers.extend(acl);
        opts.content_md5 = md5;
        opts.if_none_match = condition_string(i.if_none_match.as_ref());
        opts.if_match = condition_string(i.if_match.as_ref());
        let sealing = match through {
            Some(_) => None,
            None => self.sealing(&req.extensions, &headers, &i.bucket, &i.key)?,
        };
        // A form's body carries no checksum: its signed policy stands for it.
        let form = req.extensions.get::<crate::post::FormUpload>().is_some();
        opts.lock = self.lock_for_write(&req.extensions, &headers, &i.bucket, !form)?;
        if let Some(s) = &sealing {
            s.apply(&mut opts);
        }
        let body = object_body(
            i.body,
            declared_len(&headers, i.content_length),
            spec,
            trailers,
        );
        let mut resp = if let Some(cb) = through {
            self.put_through(&cb, &i.key, body, &headers).await?
        } else {
            let info = self
                .store
                .put_object(&i.bucket, &i.key, body, opts)
                .await
                .map_err(s3_error)?;
            let [crc32, crc32c, crc64nvme, sha1, sha256] = checksum_fields(&info.checksum);
            let mut resp = S3Response::new(PutObjectOutput {
                e_tag: Some(etag(&info.etag)),
                version_id: info.version_id,
                checksum_crc32: crc32,
                checksum_crc32c: crc32c,
                checksum_crc64nvme: crc64nvme,
                checksum_sha1: sha1,
                checksum_sha256: sha256,
                ..Default::default()
            });
            if let Some(s) = &sealing {
                crate::sse::add_headers(&mut resp.headers, &s.response);
            }
            resp
        };
        if let Some(v) = substituted.and_then(|s| http::HeaderValue::from_str(&s).ok()) {
            resp.headers.insert(crate::post::FILENAME_HEADER, v);
        }
        Ok(resp)
    }

    async fn get_object(
        &self,
        req: S3Request<GetObjectInput>,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        let hide = hides_missing(&req.extensions);
        self.read_object(req)
            .await
            .map_err(|e| missing_unless_listable(e, hide))
    }

    async fn head_object(
        &self,
        req: S3Request<HeadObjectInput>,
    ) -> S3Result<S3Response<HeadObjectOutput>> {
        let hide = hides_missing(&req.extensions);
        self.head_of_object(req)
            .await
            .map_err(|e| missing_unless_listable(e, hide))
    }

    async fn delete_object(
        &self,
        req: S3Request<DeleteObjectInput>,
    ) -> S3Result<S3Response<DeleteObjectOutput>> {
        let through = self.cache_write(&req.input.bucket)?;
        let i = req.input;
        if let Some(cb) = through {
            let if_match = condition_string(i.if_match.as_ref());
            return self
                .delete_through(&cb, &i.key, i.version_id.as_deref(), if_match)
                .await;
        }
        let bypass = permit_of(&req.extensions).is_some_and(|p| p.bypass_governance);
        let r = self
            .store
            .delete_object_with(
                &i.bucket,
                &i.key,
                i.version_id.as_deref(),
                condition_string(i.if_match.as_ref()).as_deref(),
                bypass,
            )
            .await
            .map_err(s3_error)?;
        Ok(S3Response::new(DeleteObjectOutput {
            delete_marker: r.delete_marker.then_some(true),
            version_id: r.version_id,
            ..Default::default()
        }))
    }

    async fn delete_objects(
        &self,
        req: S3Request<DeleteObjectsInput>,
    ) -> S3Result<S3Response<DeleteObjectsOutput>> {
        let through = self.cache_write(&req.input.bucket)?;
        let i = req.input;
        let refused = req.extensions.get::<DeniedDeletes>();
        let permit = permit_of(&req.extensions);
        // Root's permit carries the bypass it asked for; others' are
        // judged key by key.
        let bypass_all = permit.is_some_and(|p| p.bypass_governance);
        let bypass_keys = req.extensions.get::<crate::access::BypassAllowed>();
        self.store.head_bucket(&i.bucket).map_err(s3_error)?;
        if i.delete.objects.len() > 1000 {
            return Err(S3Error::with_message(
                S3ErrorCode::MalformedXML,
                "at most 1000 keys per DeleteObjects",
            ));
        }
        // A key no object can have makes the request malformed: refused
        // whole, before anything is deleted.
        if let Some(o) = i
            .delete
            .objects
            .iter()
            .find(|o| o.key.len() > tarn_store::KEY_MAX_BYTES)
        {
            return Err(S3Error::with_message(
                S3ErrorCode::KeyTooLongError,
                format!(
                    "a key of {} bytes is longer than the {} bytes allowed; nothing was deleted",
                    o.key.len(),
                    tarn_store::KEY_MAX_BYTES
                ),
            ));
        }
        let quiet = i.delete.quiet.unwrap_or(false);
        let mut deleted = Vec::new();
        let mut errors = Vec::new();
        for o in i.delete.objects {
            if refused.is_some_and(|r| r.0.contains(&(o.key.clone(), o.version_id.clone()))) {
                errors.push(Error {
                    code: Some("AccessDenied".into()),
                    key: Some(o.key),
                    message: Some("Access Denied".into()),
                    version_id: o.version_id,
                });
                continue;
            }
            let r = match &through {
                Some(cb) => match o.version_id {
                    Some(_) => Err(S3Error::with_message(
                        S3ErrorCode::NotImplemented,
                        "a cache bucket deletes the upstream's current object only (no versionId)",
                    )),
                    None => cb
                        .delete_through(&o.key, None)
                        .await
                        .map(|_| tarn_store::DeleteResult {
                            delete_marker: false,
                            version_id: None,
                        })
                        .map_err(crate::ops_cache::cache_error),
                },
                None => self
                    .store
                    .delete_object_with(
                        &i.bucket,
                        &o.key,
                        o.version_id.as_deref(),
                        None,
                        bypass_all || bypass_keys.is_some_and(|b| b.0.contains(&o.key)),
                    )
                    .await
                    .map_err(s3_error),
            };
            match r {
                Ok(r) => {
                    if !quiet {
                        deleted.push(DeletedObject {
                            key: Some(o.key),
                            version_id: o.version_id.clone(),
                            delete_marker: r.delete_marker.then_some(true),
                            delete_marker_version_id: if r.delete_marker {
                                r.version_id
                            } else {
                                None
                            },
                        });
                    }
                }
                Err(s3e) => {
                    errors.push(Error {
                        code: Some(s3e.code().as_str().to_string()),
                        key: Some(o.key),
                        message: s3e.message().map(str::to_string),
                        version_id: o.version_id,
                    });
                }
            }
        }
        Ok(S3Response::new(DeleteObjectsOutput {
            deleted: Some(deleted),
            errors: (!errors.is_empty()).then_some(errors),
            ..Default::default()
        }))
    }

    async fn copy_object(
        &self,
        req: S3Request<CopyObjectInput>,
    ) -> S3Result<S3Response<CopyObjectOutput>> {
        self.refuse_cache_write(&req.input.bucket)?;
        let i = req.input;
        let acl = self.object_acl_header(&req.extensions, &req.headers, &i.bucket)?;
        let (sb, sk, sv) = copy_source(&i.copy_source)?;
        let conditions = read_conditions(
            i.copy_source_if_match.as_ref(),
            i.copy_source_if_none_match.as_ref(),
            i.copy_source_if_modified_since.as_ref(),
            i.copy_source_if_unmodified_since.as_ref(),
        );
        let got = self
            .open_copy_source(
                &req.extensions,
                &req.headers,
                &i.copy_source,
                conditions,
                None,
            )
            .await?;
        let src = got.info.clone();
        let sealing = self.sealing(&req.extensions, &req.headers, &i.bucket, &i.key)?;
        let asks_encryption = crate::sse::asked(&req.headers)? != crate::sse::Asked::Nothing;
        if src.size > COPY_SOURCE_MAX_BYTES {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidRequest,
                "The specified copy source is larger than the maximum allowable size for a copy source: 5368709120",
            ));
        }
        let replace_meta = i
            .metadata_directive
            .as_ref()
            .is_some_and(|d| d.as_str() == MetadataDirective::REPLACE);
        let replace_tags = i
            .tagging_directive
            .as_ref()
            .is_some_and(|d| d.as_str() == TaggingDirective::REPLACE);
        if sb == i.bucket
            && sk == i.key
            && sv.is_none()
            && !replace_meta
            && !replace_tags
            && !asks_encryption
        {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidRequest,
                "This copy request is illegal because it is trying to copy an object to itself without changing the object's metadata, storage class, website redirect location or encryption attributes.",
            ));
        }
        let tags = if replace_tags {
            parse_tagging_header(i.tagging.as_ref())?
        } else {
            src.tags.clone()
        };
        let mut opts = if replace_meta {
            put_options(
                i.content_type.clone(),
                stored_headers!(i),
                i.metadata.clone(),
                tags,
            )
        } else {
            PutOptions {
                content_type: Some(src.content_type.clone()),
                // The copy's ACL is the request's, never the source's.
                // Nor its encryption: the copy gets the request's.
                headers: src
                    .headers
                    .iter()
                    .filter(|(k, _)| {
                        k != ACL_HEADER && k != INITIATOR_HEADER && !crate::sse::is_internal(k)
                    })
                    .cloned()
                    .collect(),
                user_metadata: src.user_metadata.clone(),
                tags,
                ..Default::default()
            }
        };
        opts.headers.extend(acl);
        // The copy is checked end to end against the source: its MD5 ETag
        // (kept an MD5 ETag whatever the size, as clients verify copies by
        // it) and its checksum. A composite (multipart) checksum does not
        // describe the single-part copy: the copy gets the full checksum of
        // the same algorithm instead.
        // (An MD5 ETag is 32 hex digits; fast and multipart ones carry `-N`.)
        // (An SSE-KMS or SSE-C source's ETag is a keyed digest, not its MD5.)
        if !crate::sse::keyed_etag(&src) {
            opts.content_md5 = tarn_store::format::id_from_hex(src.etag.trim_matches('"'));
        }
        if let Some(s) = &sealing {
            s.apply(&mut opts);
        }
        // The copy's lock is the request's (or the bucket's default), never
        // the source's.
        opts.lock = self.lock_for_write(&req.extensions, &req.headers, &i.bucket, false)?;
        let spec = match &src.checksum {
            Some((algo, v)) if ChecksumKind::of_value(v) == ChecksumKind::Composite => {
                ChecksumSpec {
                    header: None,
                    trailer: Some(algo.clone()),
                }
            }
            c => ChecksumSpec {
                header: c.clone(),
                trailer: None,
            },
        };
        let len = got.range.1 - got.range.0;
        let body = checked_body(futures::StreamExt::boxed(got.stream), Some(len), spec, None);
        let info = self
            .store
            .put_object(&i.bucket, &i.key, body, opts)
            .await
            .map_err(s3_error)?;
        let mut resp = S3Response::new(CopyObjectOutput {
            copy_object_result: Some(CopyObjectResult {
                e_tag: Some(etag(&info.etag)),
                last_modified: Some(timestamp(info.last_modified_ns)),
                ..Default::default()
            }),
            copy_source_version_id: src.version_id,
            version_id: info.version_id,
            ..Default::default()
        });
        if let Some(s) = &sealing {
            crate::sse::add_headers(&mut resp.headers, &s.response);
        }
        Ok(resp)
    }

    async fn list_objects(
        &self,
        req: S3Request<ListObjectsInput>,
    ) -> S3Result<S3Response<ListObjectsOutput>> {
        let mut i = req.input;
        i.delimiter = delimiter_of(i.delimiter.take());
        let max = max_keys(i.max_keys)?;
        let prefix = i.prefix.clone().unwrap_or_default();
        let page = self
            .list_page(
                &i.bucket,
                ListParams {
                    prefix: prefix.clone(),
                    delimiter: i.delimiter.clone(),
                    after: i.marker.clone().filter(|m| !m.is_empty()),
                    max_keys: max,
                },
            )
            .await?;
        let url = listing_url_encoded(
            &i.encoding_type,
            page.objects.iter().map(|o| o.key.as_str()),
            &page.common_prefixes,
            &[
                Some(&prefix),
                i.marker.as_deref(),
                i.delimiter.as_deref(),
                page.next_after.as_deref(),
            ],
        );
        let b = self.bucket_access(&req.extensions, &i.bucket)?;
        let contents: Vec<Object> = page
            .objects
            .iter()
            .map(|o| list_entry(o, url, &b))
            .collect();
        let next_marker = if page.is_truncated && i.delimiter.is_some() {
            page.next_after.clone().map(|m| encode_if(url, m))
        } else {
            None
        };
        Ok(S3Response::new(ListObjectsOutput {
            name: Some(i.bucket),
            prefix: Some(encode_if(url, prefix)),
            // Always present in V1 listings, empty when none was given.
            marker: Some(encode_if(url, i.marker.unwrap_or_default())),
            max_keys: Some(max as i32),
            is_truncated: Some(page.is_truncated),
            contents: Some(contents),
            common_prefixes: Some(
                page.common_prefixes
                    .into_iter()
                    .map(|p| CommonPrefix {
                        prefix: Some(encode_if(url, p)),
                    })
                    .collect(),
            ),
            delimiter: i.delimiter.map(|d| encode_if(url, d)),
            next_marker,
            encoding_type: encoding_type_of(url),
            ..Default::default()
        }))
    }

    async fn list_objects_v2(
        &self,
        req: S3Request<ListObjectsV2Input>,
    ) -> S3Result<S3Response<ListObjectsV2Output>> {
        let mut i = req.input;
        i.delimiter = delimiter_of(i.delimiter.take());
        let max = max_keys(i.max_keys)?;
        let prefix = i.prefix.clone().unwrap_or_default();
        let after = match &i.continuation_token {
            Some(t) => Some(decode_token(t)?),
            None => i.start_after.clone().filter(|s| !s.is_empty()),
        };
        let page = self
            .list_page(
                &i.bucket,
                ListParams {
                    prefix: prefix.clone(),
                    delimiter: i.delimiter.clone(),
                    after,
                    max_keys: max,
                },
            )
            .await?;
        let url = listing_url_encoded(
            &i.encoding_type,
            page.objects.iter().map(|o| o.key.as_str()),
            &page.common_prefixes,
            &[
                Some(&prefix),
                i.start_after.as_deref(),
                i.delimiter.as_deref(),
            ],
        );
        let fetch_owner = i.fetch_owner.unwrap_or(false);
        let b = self.bucket_access(&req.extensions, &i.bucket)?;
        let contents: Vec<Object> = page
            .objects
            .iter()
            .map(|o| {
                let mut e = list_entry(o, url, &b);
                if !fetch_owner {
                    e.owner = None;
                }
                e
            })
            .collect();
        let key_count = (contents.len() + page.common_prefixes.len()) as i32;
        Ok(S3Response::new(ListObjectsV2Output {
            name: Some(i.bucket),
            prefix: Some(encode_if(url, prefix)),
            max_keys: Some(max as i32),
            key_count: Some(key_count),
            continuation_token: i.continuation_token,
            is_truncated: Some(page.is_truncated),
            next_continuation_token: if page.is_truncated {
                page.next_after.as_deref().map(encode_token)
            } else {
                None
            },
            contents: Some(contents),
            common_prefixes: Some(
                page.common_prefixes
                    .into_iter()
                    .map(|p| CommonPrefix {
                        prefix: Some(encode_if(url, p)),
                    })
                    .collect(),
            ),
            delimiter: i.delimiter.map(|d| encode_if(url, d)),
            encoding_type: encoding_type_of(url),
            start_after: i.start_after.map(|s| encode_if(url, s)),
            ..Default::default()
        }))
    }

    async fn list_object_versions(
        &self,
        req: S3Request<ListObjectVersionsInput>,
    ) -> S3Result<S3Response<ListObjectVersionsOutput>> {
        self.refuse_on_cache(&req.input.bucket, "ListObjectVersions")?;
        let mut i = req.input;
        i.delimiter = delimiter_of(i.delimiter.take());
        let max = max_keys(i.max_keys)?;
        let prefix = i.prefix.clone().unwrap_or_default();
        if let Some(v) = i.version_id_marker.as_deref().filter(|v| !v.is_empty()) {
            if i.key_marker.as_deref().is_none_or(str::is_empty) {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    "A version-id marker cannot be specified without a key marker.",
                ));
            }
            if tarn_store::parse_version(v).is_none() {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    "Invalid version id specified",
                ));
            }
        }
        let page = self
            .store
            .list_object_versions(
                &i.bucket,
                VersionListParams {
                    prefix: prefix.clone(),
                    delimiter: i.delimiter.clone(),
                    key_marker: i.key_marker.clone().filter(|k| !k.is_empty()),
                    version_id_marker: i.version_id_marker.clone().filter(|v| !v.is_empty()),
                    max_keys: max,
                },
            )
            .await
            .map_err(s3_error)?;
        let url = listing_url_encoded(
            &i.encoding_type,
            page.versions.iter().map(|v| v.key.as_str()),
            &page.common_prefixes,
            &[
                Some(&prefix),
                i.key_marker.as_deref(),
                i.delimiter.as_deref(),
                page.next_key_marker.as_deref(),
            ],
        );
        let b = self.bucket_access(&req.extensions, &i.bucket)?;
        let mut versions = Vec::new();
        let mut markers = Vec::new();
        for v in page.versions {
            let vid = Some(v.version_id.clone().unwrap_or_else(|| "null".into()));
            if v.delete_marker {
                markers.push(DeleteMarkerEntry {
                    is_latest: Some(v.is_latest),
                    key: Some(encode_if(url, v.key.clone())),
                    last_modified: Some(timestamp(v.last_modified_ns)),
                    owner: Some(owner_named(&b.acl_of(&v.headers).owner)),
                    version_id: vid,
                });
            } else {
                versions.push(ObjectVersion {
                    e_tag: Some(etag(&v.etag)),
                    is_latest: Some(v.is_latest),
                    key: Some(encode_if(url, v.key.clone())),
                    last_modified: Some(timestamp(v.last_modified_ns)),
                    owner: Some(owner_named(&b.acl_of(&v.headers).owner)),
                    size: Some(v.size as i64),
                    storage_class: Some(ObjectVersionStorageClass::from_static(
                        ObjectVersionStorageClass::STANDARD,
                    )),
                    version_id: vid,
                    ..Default::default()
                });
            }
        }
        Ok(S3Response::new(ListObjectVersionsOutput {
            common_prefixes: Some(
                page.common_prefixes
                    .into_iter()
                    .map(|p| CommonPrefix {
                        prefix: Some(encode_if(url, p)),
                    })
                    .collect(),
            ),
            delete_markers: Some(markers),
            delimiter: i.delimiter.map(|d| encode_if(url, d)),
            encoding_type: encoding_type_of(url),
            is_truncated: Some(page.is_truncated),
            key_marker: i.key_marker.map(|k| encode_if(url, k)),
            max_keys: Some(max as i32),
            name: Some(i.bucket),
            next_key_marker: if page.is_truncated {
                page.next_key_marker.map(|k| encode_if(url, k))
            } else {
                None
            },
            next_version_id_marker: if page.is_truncated {
                page.next_version_id_marker
            } else {
                None
            },
            prefix: Some(encode_if(url, prefix)),
            version_id_marker: i.version_id_marker,
            versions: Some(versions),
            ..Default::default()
        }))
    }

    async fn create_multipart_upload(
        &self,
        req: S3Request<CreateMultipartUploadInput>,
    ) -> S3Result<S3Response<CreateMultipartUploadOutput>> {
        let through = self.cache_write(&req.input.bucket)?;
        if let Some(cb) = through {
            refuse_encryption_on_cache(&req.headers)?;
            return self
                .create_upload_through(&cb, &req.input.key, &req.headers)
                .await;
        }
        let sealing = self.sealing(
            &req.extensions,
            &req.headers,
            &req.input.bucket,
            &req.input.key,
        )?;
        let i = req.input;
        let acl = self.object_acl_header(&req.extensions, &req.headers, &i.bucket)?;
        let tags = parse_tagging_header(i.tagging.as_ref())?;
        let mut opts = put_options(
            i.content_type.clone(),
            stored_headers!(i),
            i.metadata.clone(),
            tags,
        );
        opts.headers.extend(acl);
        if let Some(s) = &sealing {
            opts.headers.extend(s.stored.iter().cloned());
        }
        if let Some(who) = permit_of(&req.extensions).and_then(Permit::caller) {
            opts.headers
                .push((INITIATOR_HEADER.to_string(), who.to_string()));
        }
        // A multipart object's creation is its upload's start (its
        // Last-Modified too): the default retention counts from now.
        opts.lock = self.lock_for_write(&req.extensions, &req.headers, &i.bucket, false)?;
        let algo = i
            .checksum_algorithm
            .as_ref()
            .map(|a| a.as_str().to_ascii_uppercase());
        match &algo {
            Some(a) if !CHECKSUM_ALGORITHMS.contains(&a.as_str()) => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidRequest,
                    format!("Checksum algorithm {a} is not supported."),
                ))
            }
            Some(a) => {
                let asked = i
                    .checksum_type
                    .as_ref()
                    .map(checksum_type_arg)
                    .transpose()?;
                let t = ChecksumKind::resolve(a, asked)
                    .map_err(|m| S3Error::with_message(S3ErrorCode::InvalidRequest, m))?;
                opts.checksum_type = Some(t);
            }
            None if i.checksum_type.is_some() => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidRequest,
                    "x-amz-checksum-type needs x-amz-checksum-algorithm.",
                ))
            }
            None => {}
        }
        let checksum_type = opts.checksum_type;
        let id = self
            .store
            .create_multipart_upload(&i.bucket, &i.key, opts, algo.clone())
            .await
            .map_err(s3_error)?;
        let mut resp = S3Response::new(CreateMultipartUploadOutput {
            bucket: Some(i.bucket),
            key: xml_key(i.key),
            upload_id: Some(id),
            checksum_algorithm: algo.map(ChecksumAlgorithm::from),
            checksum_type: checksum_type.map(|t| ChecksumType::from(t.as_str().to_string())),
            ..Default::default()
        });
        if let Some(s) = &sealing {
            crate::sse::add_headers(&mut resp.headers, &s.response);
        }
        Ok(resp)
    }

    async fn upload_part(
        &self,
        req: S3Request<UploadPartInput>,
    ) -> S3Result<S3Response<UploadPartOutput>> {
        let through = self.cache_write(&req.input.bucket)?;
        let headers = req.headers.clone();
        let trailers = req.trailing_headers.clone();
        let i = req.input;
        let spec = ChecksumSpec::from_request(&headers, declared_checksums!(i))?;
        let md5 = content_md5(i.content_md5.as_ref())?;
        if i.part_number < 1 {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidArgument,
                "Part number must be an integer between 1 and 10000",
            ));
        }
        let body = object_body(
            i.body,
            declared_len(&headers, i.content_length),
            spec,
            trailers,
        );
        if let Some(cb) = through {
            return self
                .upload_part_through(&cb, &i.key, &i.upload_id, i.part_number, body, &headers)
                .await;
        }
        let (seal, encryption) = self
            .part_sealing(&req.extensions, &headers, &i.bucket, &i.key, &i.upload_id)
            .await?;
        let part = self
            .store
            .upload_part_sealed(
                &i.bucket,
                &i.key,
                &i.upload_id,
                i.part_number as u32,
                body,
                md5,
                None,
                seal,
            )
            .await
            .map_err(s3_error)?;
        let [crc32, crc32c, crc64nvme, sha1, sha256] = checksum_fields(&part.checksum);
        let mut resp = S3Response::new(UploadPartOutput {
            e_tag: Some(etag(&part.etag)),
            checksum_crc32: crc32,
            checksum_crc32c: crc32c,
            checksum_crc64nvme: crc64nvme,
            checksum_sha1: sha1,
            checksum_sha256: sha256,
            ..Default::default()
        });
        crate::sse::add_headers(&mut resp.headers, &encryption);
        Ok(resp)
    }

    async fn upload_part_copy(
        &self,
        req: S3Request<UploadPartCopyInput>,
    ) -> S3Result<S3Response<UploadPartCopyOutput>> {
        self.refuse_cache_write(&req.input.bucket)?;
        let i = req.input;
        let bad_range = || {
            S3Error::with_message(
                S3ErrorCode::InvalidRange,
                "The x-amz-copy-source-range value must be of the form bytes=first-last and within the object",
            )
        };
        let range = match &i.copy_source_range {
            None => None,
            Some(r) => match Range::parse(r).map_err(|_| {
                S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    "invalid x-amz-copy-source-range",
                )
            })? {
                Range::Int {
                    first,
                    last: Some(last),
                } => Some((first, last)),
                _ => return Err(bad_range()),
            },
        };
        let conditions = read_conditions(
            i.copy_source_if_match.as_ref(),
            i.copy_source_if_none_match.as_ref(),
            i.copy_source_if_modified_since.as_ref(),
            i.copy_source_if_unmodified_since.as_ref(),
        );
        let (seal, encryption) = self
            .part_sealing(
                &req.extensions,
                &req.headers,
                &i.bucket,
                &i.key,
                &i.upload_id,
            )
            .await?;
        let got = self
            .open_copy_source(
                &req.extensions,
                &req.headers,
                &i.copy_source,
                conditions,
                range.map(|(a, b)| ByteRange::Closed(a, b)),
            )
            .await?;
        // Unlike GET, a copy range may not run past the end of the source.
        if range.is_some_and(|(_, last)| last >= got.info.size) {
            return Err(bad_range());
        }
        let src_version = got.info.version_id.clone();
        let len = got.range.1 - got.range.0;
        // A part of an upload with a checksum algorithm carries that
        // checksum, computed here from the copied bytes.
        let algo = self
            .store
            .upload_checksum_algorithm(&i.bucket, &i.key, &i.upload_id)
            .await
            .map_err(s3_error)?;
        let body = checked_body(
            futures::StreamExt::boxed(got.stream),
            Some(len),
            ChecksumSpec {
                header: None,
                trailer: algo,
            },
            None,
        );
        let part = self
            .store
            .upload_part_sealed(
                &i.bucket,
                &i.key,
                &i.upload_id,
                i.part_number as u32,
                body,
                None,
                None,
                seal,
            )
            .await
            .map_err(s3_error)?;
        let mut resp = S3Response::new(UploadPartCopyOutput {
            copy_part_result: Some({
                let [crc32, crc32c, crc64nvme, sha1, sha256] = checksum_fields(&part.checksum);
                CopyPartResult {
                    e_tag: Some(etag(&part.etag)),
                    last_modified: Some(timestamp(part.last_modified_ns)),
                    checksum_crc32: crc32,
                    checksum_crc32c: crc32c,
                    checksum_crc64nvme: crc64nvme,
                    checksum_sha1: sha1,
                    checksum_sha256: sha256,
                }
            }),
            copy_source_version_id: src_version,
            ..Default::default()
        });
        crate::sse::add_headers(&mut resp.headers, &encryption);
        Ok(resp)
    }

    async fn complete_multipart_upload(
        &self,
        req: S3Request<CompleteMultipartUploadInput>,
    ) -> S3Result<S3Response<CompleteMultipartUploadOutput>> {
        let through = self.cache_write(&req.input.bucket)?;
        let mut i = req.input;
        let parts = i
            .multipart_upload
            .take()
            .and_then(|m| m.parts)
            .unwrap_or_default();
        if let Some(cb) = through {
            let conditions: Vec<(&str, String)> = [
                ("if-match", condition_string(i.if_match.as_ref())),
                ("if-none-match", condition_string(i.if_none_match.as_ref())),
            ]
            .into_iter()
            .filter_map(|(k, v)| Some((k, v?)))
            .collect();
            return self
                .complete_upload_through(&cb, &i.key, &i.upload_id, &parts, conditions)
                .await;
        }
        let mut list = Vec::with_capacity(parts.len());
        let mut part_checksums = Vec::new();
        for p in parts {
            let (Some(n), Some(e)) = (p.part_number, p.e_tag.as_ref()) else {
                return Err(S3Error::with_message(
                    S3ErrorCode::MalformedXML,
                    "every part needs PartNumber and ETag",
                ));
            };
            if n < 1 {
                return Err(S3Error::new(S3ErrorCode::InvalidPart));
            }
            list.push((n as u32, e.value().to_string()));
            for (a, v) in CHECKSUM_ALGORITHMS.iter().zip(declared_checksums!(p)) {
                if let Some(v) = v {
                    part_checksums.push((n as u32, a.to_string(), v.clone()));
                }
            }
        }
        // The whole object's checksum the client expects (one at most).
        let declared = ChecksumSpec::from_request(&req.headers, declared_checksums!(i))?.header;
        let opts = PutOptions {
            if_none_match: condition_string(i.if_none_match.as_ref()),
            if_match: condition_string(i.if_match.as_ref()),
            checksum: declared,
            checksum_type: i
                .checksum_type
                .as_ref()
                .map(checksum_type_arg)
                .transpose()?,
            part_checksums,
            ..Default::default()
        };
        let info = self
            .store
            .complete_multipart_upload(&i.bucket, &i.key, &i.upload_id, &list, &opts)
            .await
            .map_err(s3_error)?;
        let [crc32, crc32c, crc64nvme, sha1, sha256] = checksum_fields(&info.checksum);
        let encryption = crate::sse::response_headers(&info.headers, None);
        let mut resp = S3Response::new(CompleteMultipartUploadOutput {
            bucket: Some(i.bucket.clone()),
            key: xml_key(i.key.clone()),
            e_tag: Some(etag(&info.etag)),
            location: Some(format!("/{}/{}", i.bucket, urlencoding::encode(&i.key))),
            version_id: info.version_id,
            checksum_type: checksum_type_of(&info.checksum),
            checksum_crc32: crc32,
            checksum_crc32c: crc32c,
            checksum_crc64nvme: crc64nvme,
            checksum_sha1: sha1,
            checksum_sha256: sha256,
            ..Default::default()
        });
        crate::sse::add_headers(&mut resp.headers, &encryption);
        Ok(resp)
    }

    async fn abort_multipart_upload(
        &self,
        req: S3Request<AbortMultipartUploadInput>,
    ) -> S3Result<S3Response<AbortMultipartUploadOutput>> {
        let through = self.cache_write(&req.input.bucket)?;
        let i = req.input;
        if let Some(cb) = through {
            return self.abort_upload_through(&cb, &i.key, &i.upload_id).await;
        }
        self.store
            .abort_multipart_upload(&i.bucket, &i.key, &i.upload_id)
            .await
            .map_err(s3_error)?;
        Ok(S3Response::new(AbortMultipartUploadOutput::default()))
    }

    async fn list_parts(
        &self,
        req: S3Request<ListPartsInput>,
    ) -> S3Result<S3Response<ListPartsOutput>> {
        let i = req.input;
        let max = match i.max_parts {
            None => 1000,
            Some(n) if n < 0 => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    "max-parts must be non-negative",
                ))
            }
            Some(n) => (n as usize).min(1000),
        };
        let after = i.part_number_marker.unwrap_or(0).max(0) as u32;
        let (parts, truncated, upload) = self
            .store
            .list_parts(&i.bucket, &i.key, &i.upload_id, after, max)
            .await
            .map_err(s3_error)?;
        let (owner, initiator) = upload_people(
            &*self.bucket_access(&req.extensions, &i.bucket)?,
            &upload.headers,
        );
        let next = parts.last().map(|p| p.number as i32);
        let parts = parts
            .into_iter()
            .map(|p| {
                let [crc32, crc32c, crc64nvme, sha1, sha256] = checksum_fields(&p.checksum);
                Part {
                    e_tag: Some(etag(&p.etag)),
                    last_modified: Some(timestamp(p.last_modified_ns)),
                    part_number: Some(p.number as i32),
                    size: Some(p.size as i64),
                    checksum_crc32: crc32,
                    checksum_crc32c: crc32c,
                    checksum_crc64nvme: crc64nvme,
                    checksum_sha1: sha1,
                    checksum_sha256: sha256,
                }
            })
            .collect();
        Ok(S3Response::new(ListPartsOutput {
            bucket: Some(i.bucket),
            key: Some(i.key),
            upload_id: Some(i.upload_id),
            is_truncated: Some(truncated),
            max_parts: Some(max as i32),
            part_number_marker: i.part_number_marker,
            next_part_number_marker: if truncated { next } else { None },
            parts: Some(parts),
            owner: Some(owner),
            initiator: Some(initiator),
            storage_class: Some(StorageClass::from_static(StorageClass::STANDARD)),
            ..Default::default()
        }))
    }

    async fn list_multipart_uploads(
        &self,
        req: S3Request<ListMultipartUploadsInput>,
    ) -> S3Result<S3Response<ListMultipartUploadsOutput>> {
        let mut i = req.input;
        i.delimiter = delimiter_of(i.delimiter.take());
        let max = match i.max_uploads {
            None => 1000,
            Some(n) if n < 0 => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    "max-uploads must be non-negative",
                ))
            }
            Some(n) => (n as usize).min(1000),
        };
        let prefix = i.prefix.clone().unwrap_or_default();
        let (uploads, prefixes, truncated) = self
            .store
            .list_multipart_uploads(
                &i.bucket,
                &prefix,
                i.delimiter.as_deref(),
                i.key_marker.as_deref(),
                i.upload_id_marker.as_deref(),
                max,
            )
            .await
            .map_err(s3_error)?;
        let url = listing_url_encoded(
            &i.encoding_type,
            uploads.iter().map(|u| u.key.as_str()),
            &prefixes,
            &[
                Some(&prefix),
                i.key_marker.as_deref(),
                i.delimiter.as_deref(),
            ],
        );
        let next_key = uploads.last().map(|u| encode_if(url, u.key.clone()));
        let next_id = uploads.last().map(|u| u.upload_id.clone());
        let b = self.bucket_access(&req.extensions, &i.bucket)?;
        let uploads = uploads
            .into_iter()
            .map(|u| {
                let (owner, initiator) = upload_people(&b, &u.headers);
                MultipartUpload {
                    initiated: Some(timestamp(u.initiated_ns)),
                    key: Some(encode_if(url, u.key)),
                    upload_id: Some(u.upload_id),
                    owner: Some(owner),
                    initiator: Some(initiator),
                    storage_class: Some(StorageClass::from_static(StorageClass::STANDARD)),
                    ..Default::default()
                }
            })
            .collect();
        Ok(S3Response::new(ListMultipartUploadsOutput {
            bucket: Some(i.bucket),
            prefix: Some(encode_if(url, prefix)),
            key_marker: i.key_marker.map(|k| encode_if(url, k)),
            upload_id_marker: i.upload_id_marker,
            max_uploads: Some(max as i32),
            is_truncated: Some(truncated),
            next_key_marker: if truncated { next_key } else { None },
            next_upload_id_marker: if truncated { next_id } else { None },
            uploads: Some(uploads),
            common_prefixes: Some(
                prefixes
                    .into_iter()
                    .map(|p| CommonPrefix {
                        prefix: Some(encode_if(url, p)),
                    })
                    .collect(),
            ),
            delimiter: i.delimiter.map(|d| encode_if(url, d)),
            encoding_type: encoding_type_of(url),
            ..Default::default()
        }))
    }

    async fn get_object_tagging(
        &self,
        req: S3Request<GetObjectTaggingInput>,
    ) -> S3Result<S3Response<GetObjectTaggingOutput>> {
        self.refuse_on_cache(&req.input.bucket, "GetObjectTagging")?;
        let i = req.input;
        let info = self
            .store
            .head_object(&i.bucket, &i.key, i.version_id.as_deref())
            .await
            .map_err(s3_error)?;
        let tag_set = info
            .tags
            .iter()
            .map(|(k, v)| Tag {
                key: Some(k.clone()),
                value: Some(v.clone()),
            })
            .collect();
        Ok(S3Response::new(GetObjectTaggingOutput {
            tag_set,
            version_id: info.version_id,
        }))
    }

    async fn put_object_tagging(
        &self,
        req: S3Request<PutObjectTaggingInput>,
    ) -> S3Result<S3Response<PutObjectTaggingOutput>> {
        self.refuse_cache_write(&req.input.bucket)?;
        let i = req.input;
        let tags = crate::util::tag_pairs(i.tagging.tag_set);
        check_tags(&tags)?;
        let vid = self
            .store
            .put_object_tags(&i.bucket, &i.key, i.version_id.as_deref(), tags)
            .await
            .map_err(s3_error)?;
        Ok(S3Response::new(PutObjectTaggingOutput { version_id: vid }))
    }

    async fn delete_object_tagging(
        &self,
        req: S3Request<DeleteObjectTaggingInput>,
    ) -> S3Result<S3Response<DeleteObjectTaggingOutput>> {
        self.refuse_cache_write(&req.input.bucket)?;
        let i = req.input;
        let vid = self
            .store
            .put_object_tags(&i.bucket, &i.key, i.version_id.as_deref(), Vec::new())
            .await
            .map_err(s3_error)?;
        Ok(S3Response::new(DeleteObjectTaggingOutput {
            version_id: vid,
        }))
    }
}

fn list_entry(o: &ObjectInfo, url: bool, b: &BucketAccess) -> Object {
    Object {
        key: Some(encode_if(url, o.key.clone())),
        e_tag: Some(etag(&o.etag)),
        last_modified: Some(timestamp(o.last_modified_ns)),
        size: Some(o.size as i64),
        storage_class: Some(ObjectStorageClass::from_static(
            ObjectStorageClass::STANDARD,
        )),
        owner: Some(owner_named(&b.acl_of(&o.headers).owner)),
        ..Default::default()
    }
}

/// Whether a missing key must be answered as a refusal: the caller may not
/// list the bucket (S3 answers 404 only to those who could have listed the
/// key's absence anyway, 403 to others, so that reads do not reveal which
/// keys exist).
fn hides_missing(ext: &http::Extensions) -> bool {
    permit_of(ext).is_some_and(|p| p.hide_missing)
}

fn missing_unless_listable(e: S3Error, hide: bool) -> S3Error {
    if hide && *e.code() == S3ErrorCode::NoSuchKey {
        crate::access::denied()
    } else {
        e
    }
}

impl TarnS3 {
    /// CreateBucket of a bucket that exists. S3 in us-east-1 answers 200 to
    /// a CreateBucket of a bucket the caller already owns (and changes
    /// nothing); other regions 409 BucketAlreadyOwnedByYou. A durability,
    /// object ownership or ACL the bucket does not have would not be
    /// honoured: 409 as well. Another's bucket: 409 BucketAlreadyExists.
    fn create_existing_bucket(
        &self,
        headers: &http::HeaderMap,
        bucket: &str,
        caller: &str,
        durability: Durability,
        asked_ownership: Option<Ownership>,
        asked_acl: Option<&Acl>,
    ) -> S3Result<()> {
        let existing = self
            .access
            .bucket(bucket)
            .filter(|b| b.doc.owner == caller)
            .ok_or_else(|| {
                S3Error::with_message(
                    S3ErrorCode::BucketAlreadyExists,
                    "The requested bucket name is not available.",
                )
            })?;
        let same = (!headers.contains_key("x-tarn-durability")
            || self
                .store
                .head_bucket(bucket)
                .is_ok_and(|b| b.durability == durability))
            && asked_ownership.is_none_or(|o| existing.doc.ownership == Some(o))
            && asked_acl.is_none_or(|a| existing.doc.grants == a.grants);
        if self.region != "us-east-1" || !same {
            return Err(s3_error(tarn_store::StoreError::BucketExists(
                bucket.to_string(),
            )));
        }
        Ok(())
    }

    async fn read_object(
        &self,
        req: S3Request<GetObjectInput>,
    ) -> S3Result<S3Response<GetObjectOutput>> {
        let i = req.input;
        let part_number = match i.part_number {
            Some(n) if !(1..=10_000).contains(&n) => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    "Part number must be an integer between 1 and 10000",
                ))
            }
            n => n.map(|n| n as u32),
        };
        // Conditions are evaluated on the version before any byte is read, on
        // the same metadata read that serves the GET.
        let conditions = read_conditions(
            i.if_match.as_ref(),
            i.if_none_match.as_ref(),
            i.if_modified_since.as_ref(),
            i.if_unmodified_since.as_ref(),
        );
        let range = range_of(i.range);
        if let Some(cb) = self.cache_of(&i.bucket) {
            if let Some(prefix) = i.key.strip_prefix(crate::cache::PREFETCH_KEY_PREFIX) {
                return self.prefetch_by_get(&cb, prefix);
            }
            crate::ops_cache::plain_read(i.version_id.as_deref(), i.part_number)?;
            let (entry, info, (start, end)) = self
                .cache_open(&req.extensions, &cb, &i.key, range, &conditions)
                .await?;
            let content_range = range
                .is_some()
                .then(|| format!("bytes {}-{}/{}", start, end.saturating_sub(1), info.size));
            let body = sends_from_files(&req.extensions, cb.body(&i.key, entry, start, end)).await;
            return Ok(S3Response::new(GetObjectOutput {
                body: Some(StreamingBlob::wrap(body)),
                content_length: Some((end - start) as i64),
                content_range,
                ..object_fields!(GetObjectOutput, info, Default::default(), None)
            }));
        }
        crate::sse::refuse_on_read(&req.headers)?;
        let customer = crate::sse::customer_key(&req.headers, false)?;
        let got = self.get_decrypted(
            &req.extensions,
            &i.bucket,
            &i.key,
            i.version_id.as_deref(),
            range,
            part_number,
            &conditions,
            customer.as_ref(),
        );
        let got = sends_from_files(&req.extensions, got)
            .await
            .map_err(crate::ops_sse::Refused::into_s3)?;
        let info = got.info;
        if let Some(p) = permit_of(&req.extensions) {
            p.allows_object(&info)?;
        }
        let (start, end) = got.range;
        let partial = range.is_some() || part_number.is_some();
        let content_range = partial
            .then(|| format!("bytes {}-{}/{}", start, end.saturating_sub(1), info.size))
            .filter(|_| end > start || info.size > 0);
        let checksum = i
            .checksum_mode
            .as_ref()
            .is_some_and(|m| m.as_str() == ChecksumMode::ENABLED)
            .then(|| response_checksum(&info, part_number, range.is_some()))
            .flatten();
        let parts_count = part_number.map(|_| info.parts_count() as i32);
        let encryption = crate::sse::response_headers(&info.headers, customer.as_ref());
        let mut resp = S3Response::new(GetObjectOutput {
            body: Some(StreamingBlob::wrap(got.stream)),
            content_length: Some((end - start) as i64),
            content_range,
            tag_count: (!info.tags.is_empty()).then_some(info.tags.len() as i32),
            parts_count,
            ..object_fields!(
                GetObjectOutput,
                info,
                checksum_fields(&checksum),
                checksum_type_of(&checksum)
            )
        });
        crate::sse::add_headers(&mut resp.headers, &encryption);
        let (mode, until, hold) = crate::ops_lock::lock_fields(permit_of(&req.extensions), &info);
        resp.output.object_lock_mode = mode;
        resp.output.object_lock_retain_until_date = until;
        resp.output.object_lock_legal_hold_status = hold;
        Ok(resp)
    }

    async fn head_of_object(
        &self,
        req: S3Request<HeadObjectInput>,
    ) -> S3Result<S3Response<HeadObjectOutput>> {
        let i = req.input;
        let info = self
            .object_info(
                &req.extensions,
                &i.bucket,
                &i.key,
                i.version_id.as_deref(),
                i.part_number,
            )
            .await?;
        if let Some(p) = permit_of(&req.extensions) {
            p.allows_object(&info)?;
        }
        crate::sse::refuse_on_read(&req.headers)?;
        let customer = crate::sse::customer_key(&req.headers, false)?;
        self.check_customer_key(&req.extensions, &info, customer.as_ref())?;
        check_conditions(
            &info,
            i.if_match.as_ref(),
            i.if_none_match.as_ref(),
            i.if_modified_since.as_ref(),
            i.if_unmodified_since.as_ref(),
        )?;
        let (len, content_range, parts_count) = match (i.part_number, range_of(i.range)) {
            (Some(n), _) => {
                let (a, b) = info.part_range(n.max(0) as u32).map_err(s3_error)?;
                (
                    b - a,
                    Some(format!("bytes {}-{}/{}", a, b.saturating_sub(1), info.size)),
                    Some(info.parts_count() as i32),
                )
            }
            (None, Some(r)) => {
                let (a, b) = r.resolve(info.size).map_err(s3_error)?;
                (
                    b - a,
                    Some(format!("bytes {}-{}/{}", a, b - 1, info.size)),
                    None,
                )
            }
            (None, None) => (info.size, None, None),
        };
        let checksum = i
            .checksum_mode
            .as_ref()
            .is_some_and(|m| m.as_str() == ChecksumMode::ENABLED)
            .then(|| {
                response_checksum(
                    &info,
                    i.part_number.map(|n| n.max(0) as u32),
                    i.range.is_some(),
                )
            })
            .flatten();
        let mut resp = S3Response::new(HeadObjectOutput {
            content_length: Some(len as i64),
            content_range,
            parts_count,
            ..object_fields!(
                HeadObjectOutput,
                info,
                checksum_fields(&checksum),
                checksum_type_of(&checksum)
            )
        });
        crate::sse::add_headers(
            &mut resp.headers,
            &crate::sse::response_headers(&info.headers, customer.as_ref()),
        );
        let (mode, until, hold) = crate::ops_lock::lock_fields(permit_of(&req.extensions), &info);
        resp.output.object_lock_mode = mode;
        resp.output.object_lock_retain_until_date = until;
        resp.output.object_lock_legal_hold_status = hold;
        // HeadObject's model has no tag count; S3 sends the header anyway.
        if !info.tags.is_empty() {
            resp.headers.insert(
                "x-amz-tagging-count",
                http::HeaderValue::from(info.tags.len()),
            );
        }
        Ok(resp)
    }
}
