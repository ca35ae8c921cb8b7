//! Who may do what: bucket ownership, bucket policies, ACLs, the public
//! access block and object ownership controls, checked for every S3 request
//! before it reaches the engine (`S3Access::check`, with per-key checks for
//! DeleteObjects and the copy source of copies).
//!
//! The model, in the order a request is judged:
//! 1. `root` (the bootstrap credentials) is the administrator and may do
//!    everything.
//! 2. An explicit Deny in the bucket policy refuses the request (the bucket
//!    owner may still read, replace and delete the policy itself).
//! 3. An Allow in the bucket policy grants it; with RestrictPublicBuckets,
//!    an Allow that reaches everyone counts for nothing.
//! 4. The bucket owner may do everything on the bucket.
//! 5. Unless ACLs are disabled (object ownership BucketOwnerEnforced, the
//!    default), the bucket ACL and the object's ACL grant what they name;
//!    with IgnorePublicAcls grants to everyone count for nothing.
//! 6. Anything else is AccessDenied.
//!
//! Each bucket's settings are one JSON document in the system bucket
//! (`access/buckets/<name>.json`), cached here with the policy parsed, so a
//! check costs a few hash lookups. A bucket without a document (made before
//! permissions existed) is root's, with the defaults of a new bucket.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use s3s::access::{S3Access, S3AccessContext};
use s3s::dto::{CopySource, DeleteObjectsInput, PostObjectInput};
use s3s::path::S3Path;
use s3s::{S3Error, S3ErrorCode, S3Request, S3Result};
use serde::{Deserialize, Serialize};
use tarn_store::{Durability, ObjectInfo, Store, StoreError};

use crate::acl::{Acl, Grant, Permission, ACL_HEADER};
use crate::error::s3_error;
use crate::iam::{Iam, ROOT_USER};
use crate::policy::{Policy, RequestContext, Verdict};
use crate::sysdoc;

const BUCKETS_PREFIX: &str = "access/buckets/";
const DOC_FORMAT: u32 = 1;

/// The client's address, put into each request's extensions by the server
/// (the `aws:SourceIp` condition key).
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub IpAddr);

/// Put into a request's extensions by the server when its connection is
/// TLS, with the protocol's version (`"1.2"`, `"1.3"`): the
/// `aws:SecureTransport` condition key is then true, `s3:TlsVersion` that.
#[derive(Debug, Clone, Copy)]
pub struct SecureTransport(pub &'static str);

/// What the permission check decided for one request: the one entry it
/// puts into the request's extensions for the operation.
#[derive(Debug, Clone, Default)]
pub struct Permit {
    /// The caller's user name (None: anonymous).
    pub caller: Option<Arc<str>>,
    /// The settings of the bucket the request was judged by (None for root,
    /// which is not judged, and for requests without a bucket).
    pub bucket: Option<Arc<BucketAccess>>,
    /// Allowed only if the object's own ACL grants it.
    pub object: Option<ObjectCheck>,
    /// The same, for the source object of a copy.
    pub source: Option<ObjectCheck>,
    /// A read of an object that is missing is refused (403), not 404: the
    /// caller may not list the bucket.
    pub hide_missing: bool,
    /// The request asked to bypass GOVERNANCE retention
    /// (`x-amz-bypass-governance-retention: true`) and the caller holds
    /// s3:BypassGovernanceRetention.
    pub bypass_governance: bool,
    /// GET/HEAD: the caller may see the version's retention
    /// (s3:GetObjectRetention) and legal hold (s3:GetObjectLegalHold).
    pub sees_lock: (bool, bool),
}

impl Permit {
    pub fn caller(&self) -> Option<&str> {
        self.caller.as_deref()
    }

    /// Root's permit: judged by nothing, allowed everything.
    fn root(caller: Option<Arc<str>>, headers: &http::HeaderMap) -> Permit {
        Permit {
            caller,
            bypass_governance: asks_bypass(headers),
            sees_lock: (true, true),
            ..Permit::default()
        }
    }

    /// Whether the request may go on with the object it read (the pending
    /// object-ACL check, if any).
    pub fn allows_object(&self, info: &ObjectInfo) -> S3Result<()> {
        object_allowed(
            self.object.as_ref(),
            self.caller(),
            self.bucket.as_deref(),
            info,
        )
    }

    /// The same for the source object of a copy, in its bucket `b`.
    pub fn allows_source(&self, b: Option<&BucketAccess>, info: &ObjectInfo) -> S3Result<()> {
        object_allowed(self.source.as_ref(), self.caller(), b, info)
    }
}

/// The permit of a request. Every S3 request has one (the service always
/// authenticates, so `Checker` judges each); None only outside it.
pub fn permit_of(ext: &http::Extensions) -> Option<&Permit> {
    ext.get::<Permit>()
}

/// A request allowed only if the object's own ACL grants it; the
/// operation checks it against the object it reads (`object_allowed`).
#[derive(Debug, Clone)]
pub struct ObjectCheck {
    permission: Permission,
    bucket_owner: String,
    ignore_public: bool,
}

/// The (key, version) pairs of a DeleteObjects the caller may not delete.
#[derive(Debug, Clone, Default)]
pub struct DeniedDeletes(pub HashSet<(String, Option<String>)>);

/// The keys of a DeleteObjects for which the caller may bypass GOVERNANCE
/// retention (it asked, and holds s3:BypassGovernanceRetention on them).
#[derive(Debug, Clone, Default)]
pub struct BypassAllowed(pub HashSet<String>);

/// The request asks to bypass GOVERNANCE retention.
pub fn asks_bypass(headers: &http::HeaderMap) -> bool {
    headers
        .get("x-amz-bypass-governance-retention")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

/// The extra permissions a write that sets object lock needs: retention
/// (mode and date) s3:PutObjectRetention, a legal hold s3:PutObjectLegalHold.
fn lock_actions(op: &str, headers: &http::HeaderMap) -> Vec<&'static str> {
    let mut out = Vec::new();
    if matches!(op, "PutObject" | "CopyObject" | "CreateMultipartUpload") {
        if headers.contains_key("x-amz-object-lock-mode")
            || headers.contains_key("x-amz-object-lock-retain-until-date")
        {
            out.push("s3:PutObjectRetention");
        }
        if headers.contains_key("x-amz-object-lock-legal-hold") {
            out.push("s3:PutObjectLegalHold");
        }
    }
    out
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Ownership {
    /// ACLs are disabled; the bucket owner owns every object.
    BucketOwnerEnforced,
    /// Objects written with `bucket-owner-full-control` become the bucket
    /// owner's; others the writer's.
    BucketOwnerPreferred,
    /// The writer owns each object.
    ObjectWriter,
}

impl Ownership {
    pub fn parse(s: &str) -> S3Result<Self> {
        match s {
            "BucketOwnerEnforced" => Ok(Ownership::BucketOwnerEnforced),
            "BucketOwnerPreferred" => Ok(Ownership::BucketOwnerPreferred),
            "ObjectWriter" => Ok(Ownership::ObjectWriter),
            _ => Err(S3Error::with_message(
                S3ErrorCode::InvalidArgument,
                format!("Invalid object ownership {s:?}: BucketOwnerEnforced, BucketOwnerPreferred or ObjectWriter"),
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Ownership::BucketOwnerEnforced => "BucketOwnerEnforced",
            Ownership::BucketOwnerPreferred => "BucketOwnerPreferred",
            Ownership::ObjectWriter => "ObjectWriter",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PublicAccessBlock {
    pub block_public_acls: bool,
    pub ignore_public_acls: bool,
    pub block_public_policy: bool,
    pub restrict_public_buckets: bool,
}

impl PublicAccessBlock {
    pub const ALL: PublicAccessBlock = PublicAccessBlock {
        block_public_acls: true,
        ignore_public_acls: true,
        block_public_policy: true,
        restrict_public_buckets: true,
    };
}

/// A bucket's access settings as stored.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BucketDoc {
    format: u32,
    bucket: String,
    /// The bucket this document belongs to: a document left from a deleted
    /// bucket of the same name never applies to a new one.
    created_ns: u64,
    pub owner: String,
    /// None: the controls were deleted (objects are their writers').
    pub ownership: Option<Ownership>,
    pub grants: Vec<Grant>,
    pub policy: Option<String>,
    pub public_access_block: Option<PublicAccessBlock>,
    /// The bucket's tags (PutBucketTagging), in the order given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tags: Vec<(String, String)>,
    /// The lifecycle rules (PutBucketLifecycleConfiguration).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifecycle: Option<crate::lifecycle::Lifecycle>,
    /// The CORS rules (PutBucketCors).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cors: Option<crate::cors::Cors>,
    /// Default encryption of new objects (PutBucketEncryption).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encryption: Option<crate::sse::BucketEncryption>,
    /// Default retention of new versions (PutObjectLockConfiguration); the
    /// lock itself is the engine's bucket record's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lock_default: Option<crate::ops_lock::DefaultRetention>,
}

impl BucketDoc {
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// When the bucket was created (tells buckets of one name apart).
    pub fn created_ns(&self) -> u64 {
        self.created_ns
    }
}

/// A bucket's settings as checked: the document with its policy parsed.
#[derive(Debug)]
pub struct BucketAccess {
    pub doc: BucketDoc,
    pub acl: Acl,
    pub policy: Option<Policy>,
}

impl BucketAccess {
    fn new(doc: BucketDoc, policy: Option<Policy>) -> Self {
        let acl = Acl {
            owner: doc.owner.clone(),
            grants: doc.grants.clone(),
        };
        BucketAccess { doc, acl, policy }
    }

    /// ACLs are disabled.
    pub fn enforced(&self) -> bool {
        self.doc.ownership == Some(Ownership::BucketOwnerEnforced)
    }

    pub fn pab(&self) -> PublicAccessBlock {
        self.doc.public_access_block.unwrap_or_default()
    }

    /// The ACL of an object of this bucket.
    pub fn object_acl(&self, info: &ObjectInfo) -> Acl {
        self.acl_of(&info.headers)
    }

    /// The ACL of an object version or upload with these stored headers.
    pub fn acl_of(&self, headers: &[(String, String)]) -> Acl {
        if !self.enforced() {
            if let Some(acl) = headers
                .iter()
                .find(|(k, _)| k == ACL_HEADER)
                .and_then(|(_, v)| Acl::decode(v))
            {
                return acl;
            }
        }
        Acl::private(&self.doc.owner)
    }
}

/// The document of a new bucket: ACLs disabled and public access blocked,
/// as AWS makes new buckets.
fn new_doc(
    bucket: &str,
    created_ns: u64,
    owner: &str,
    ownership: Ownership,
    acl: Acl,
) -> BucketDoc {
    BucketDoc {
        format: DOC_FORMAT,
        bucket: bucket.to_string(),
        created_ns,
        owner: owner.to_string(),
        ownership: Some(ownership),
        grants: acl.grants,
        policy: None,
        public_access_block: Some(PublicAccessBlock::ALL),
        tags: Vec::new(),
        lifecycle: None,
        cors: None,
        encryption: None,
        lock_default: None,
    }
}

fn doc_key(bucket: &str) -> String {
    format!("{BUCKETS_PREFIX}{bucket}.json")
}

pub(crate) fn denied() -> S3Error {
    S3Error::with_message(S3ErrorCode::AccessDenied, "Access Denied")
}

/// The policy action of an operation on a bucket or object, and whether it
/// names an object. `versioned`: the request names a version.
fn action_of(op: &str, versioned: bool) -> Option<&'static str> {
    let v = |plain, version| Some(if versioned { version } else { plain });
    match op {
        "ListObjects" | "ListObjectsV2" | "HeadBucket" => Some("s3:ListBucket"),
        "ListObjectVersions" => Some("s3:ListBucketVersions"),
        "ListMultipartUploads" => Some("s3:ListBucketMultipartUploads"),
        "GetBucketLocation" => Some("s3:GetBucketLocation"),
        "GetBucketVersioning" => Some("s3:GetBucketVersioning"),
        "PutBucketVersioning" => Some("s3:PutBucketVersioning"),
        "DeleteBucket" => Some("s3:DeleteBucket"),
        "GetBucketAcl" => Some("s3:GetBucketAcl"),
        "PutBucketAcl" => Some("s3:PutBucketAcl"),
        "GetBucketPolicy" => Some("s3:GetBucketPolicy"),
        "PutBucketPolicy" => Some("s3:PutBucketPolicy"),
        "DeleteBucketPolicy" => Some("s3:DeleteBucketPolicy"),
        "GetBucketPolicyStatus" => Some("s3:GetBucketPolicyStatus"),
        "GetPublicAccessBlock" => Some("s3:GetBucketPublicAccessBlock"),
        "PutPublicAccessBlock" | "DeletePublicAccessBlock" => Some("s3:PutBucketPublicAccessBlock"),
        "GetBucketOwnershipControls" => Some("s3:GetBucketOwnershipControls"),
        "GetBucketTagging" => Some("s3:GetBucketTagging"),
        "GetBucketCors" => Some("s3:GetBucketCORS"),
        "PutBucketCors" | "DeleteBucketCors" => Some("s3:PutBucketCORS"),
        "GetBucketLifecycleConfiguration" => Some("s3:GetLifecycleConfiguration"),
        "PutBucketLifecycleConfiguration" | "DeleteBucketLifecycle" => {
            Some("s3:PutLifecycleConfiguration")
        }
        "PutBucketTagging" | "DeleteBucketTagging" => Some("s3:PutBucketTagging"),
        "GetBucketLogging" => Some("s3:GetBucketLogging"),
        "PutBucketLogging" => Some("s3:PutBucketLogging"),
        "GetBucketRequestPayment" => Some("s3:GetBucketRequestPayment"),
        "PutBucketRequestPayment" => Some("s3:PutBucketRequestPayment"),
        "PutBucketOwnershipControls" | "DeleteBucketOwnershipControls" => {
            Some("s3:PutBucketOwnershipControls")
        }
        "GetObject" | "HeadObject" => v("s3:GetObject", "s3:GetObjectVersion"),
        "PutObject"
        | "CreateMultipartUpload"
        | "UploadPart"
        | "CompleteMultipartUpload"
        | "CopyObject"
        | "UploadPartCopy" => Some("s3:PutObject"),
        "DeleteObject" => v("s3:DeleteObject", "s3:DeleteObjectVersion"),
        "AbortMultipartUpload" => Some("s3:AbortMultipartUpload"),
        "ListParts" => Some("s3:ListMultipartUploadParts"),
        "GetObjectTagging" => v("s3:GetObjectTagging", "s3:GetObjectVersionTagging"),
        "PutObjectTagging" => v("s3:PutObjectTagging", "s3:PutObjectVersionTagging"),
        "DeleteObjectTagging" => v("s3:DeleteObjectTagging", "s3:DeleteObjectVersionTagging"),
        "GetObjectAcl" => v("s3:GetObjectAcl", "s3:GetObjectVersionAcl"),
        "GetObjectAttributes" => v("s3:GetObjectAttributes", "s3:GetObjectVersionAttributes"),
        "PutObjectAcl" => v("s3:PutObjectAcl", "s3:PutObjectVersionAcl"),
        "GetObjectRetention" => Some("s3:GetObjectRetention"),
        "PutObjectRetention" => Some("s3:PutObjectRetention"),
        "GetObjectLegalHold" => Some("s3:GetObjectLegalHold"),
        "PutObjectLegalHold" => Some("s3:PutObjectLegalHold"),
        "GetObjectLockConfiguration" => Some("s3:GetBucketObjectLockConfiguration"),
        "PutObjectLockConfiguration" => Some("s3:PutBucketObjectLockConfiguration"),
        _ => None,
    }
}

/// What a bucket ACL grant of a permission allows.
fn bucket_acl_permission(action: &str) -> Option<Permission> {
    match action {
        "s3:ListBucket" | "s3:ListBucketVersions" | "s3:ListBucketMultipartUploads" => {
            Some(Permission::Read)
        }
        "s3:PutObject"
        | "s3:DeleteObject"
        | "s3:DeleteObjectVersion"
        | "s3:AbortMultipartUpload"
        | "s3:ListMultipartUploadParts" => Some(Permission::Write),
        "s3:GetBucketAcl" => Some(Permission::ReadAcp),
        "s3:PutBucketAcl" => Some(Permission::WriteAcp),
        _ => None,
    }
}

/// What an object ACL grant of a permission allows.
fn object_acl_permission(action: &str) -> Option<Permission> {
    match action {
        "s3:GetObject" | "s3:GetObjectVersion" => Some(Permission::Read),
        "s3:GetObjectAcl" | "s3:GetObjectVersionAcl" => Some(Permission::ReadAcp),
        "s3:PutObjectAcl" | "s3:PutObjectVersionAcl" => Some(Permission::WriteAcp),
        _ => None,
    }
}

/// A policy-management action the bucket owner can never lock itself out of.
fn owner_always(action: &str) -> bool {
    matches!(
        action,
        "s3:GetBucketPolicy" | "s3:PutBucketPolicy" | "s3:DeleteBucketPolicy"
    )
}

/// The outcome of judging one action on one resource.
#[derive(Debug)]
enum Decision {
    Allow,
    Deny,
    /// Allowed only if the object's ACL grants this.
    ObjectAcl(ObjectCheck),
}

/// One parameter of a query string, decoded.
fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (urlencoding::decode(k).ok()? == name)
            .then(|| urlencoding::decode(v).ok().map(|v| v.into_owned()))
            .flatten()
    })
}

/// The values of a request's condition keys.
struct Ctx<'a> {
    user: Option<&'a str>,
    headers: &'a http::HeaderMap,
    query: Option<&'a str>,
    peer: Option<IpAddr>,
    /// The TLS version when the request came over TLS.
    tls: Option<&'static str>,
    /// The tags of the object the request names, read only when the
    /// bucket's policy has an `s3:ExistingObjectTag/KEY` condition.
    existing_tags: Option<&'a [(String, String)]>,
}

impl Ctx<'_> {
    fn query_param(&self, name: &str) -> Option<String> {
        query_param(self.query?, name)
    }

    fn header(&self, name: &str) -> Option<String> {
        self.headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    }

    fn presigned(&self) -> bool {
        self.query_param("X-Amz-Signature").is_some() || self.query_param("Signature").is_some()
    }
}

impl RequestContext for Ctx<'_> {
    fn principal(&self) -> Option<&str> {
        self.user
    }

    fn values(&self, key: &str) -> Option<Vec<String>> {
        match key {
            // The tag keys of x-amz-tagging, a set.
            "s3:requestobjecttagkeys" => {
                let tagging = self.header("x-amz-tagging")?;
                let tags = crate::util::parse_tagging_header(Some(&tagging)).ok()?;
                Some(tags.into_iter().map(|(k, _)| k).collect())
            }
            k => self.value(k).map(|v| vec![v]),
        }
    }

    fn source_ip(&self) -> Option<IpAddr> {
        self.peer
    }

    fn value(&self, key: &str) -> Option<String> {
        let now = || {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs())
        };
        match key {
            "aws:sourceip" => self.peer.map(|p| p.to_string()),
            "aws:securetransport" => Some(self.tls.is_some().to_string()),
            "aws:currenttime" => time::OffsetDateTime::from_unix_timestamp(now() as i64)
                .ok()
                .and_then(|t| {
                    t.format(&time::format_description::well_known::Rfc3339)
                        .ok()
                }),
            "aws:epochtime" => Some(now().to_string()),
            "aws:useragent" => self.header("user-agent"),
            "aws:referer" => self.header("referer"),
            "aws:username" | "aws:userid" => self.user.map(str::to_string),
            "aws:principaltype" => Some(
                if self.user.is_some() {
                    "User"
                } else {
                    "Anonymous"
                }
                .into(),
            ),
            "s3:prefix" => self.query_param("prefix"),
            "s3:delimiter" => self.query_param("delimiter"),
            "s3:max-keys" => self.query_param("max-keys"),
            "s3:versionid" => self.query_param("versionId"),
            "s3:authtype" => self.user.map(|_| {
                if self.presigned() {
                    "REST-QUERY-STRING"
                } else {
                    "REST-HEADER"
                }
                .to_string()
            }),
            "s3:signatureversion" => self.user.map(|_| {
                let v2 = self.query_param("Signature").is_some()
                    || self
                        .header("authorization")
                        .is_some_and(|a| a.starts_with("AWS "));
                if v2 { "AWS" } else { "AWS4-HMAC-SHA256" }.to_string()
            }),
            "s3:object-lock-mode" => self.header("x-amz-object-lock-mode"),
            "s3:object-lock-retain-until-date" => {
                self.header("x-amz-object-lock-retain-until-date")
            }
            "s3:object-lock-legal-hold" => self.header("x-amz-object-lock-legal-hold"),
            "s3:object-lock-remaining-retention-days" => {
                let until = self.header("x-amz-object-lock-retain-until-date")?;
                let t = time::OffsetDateTime::parse(
                    &until,
                    &time::format_description::well_known::Rfc3339,
                )
                .ok()?;
                Some(((t.unix_timestamp() - now() as i64).max(0) / 86_400).to_string())
            }
            // Milliseconds since the request was signed.
            "s3:signatureage" => {
                let signed = self
                    .header("x-amz-date")
                    .or_else(|| self.query_param("X-Amz-Date"))?;
                let t = time::PrimitiveDateTime::parse(
                    &signed,
                    time::macros::format_description!("[year][month][day]T[hour][minute][second]Z"),
                )
                .ok()?
                .assume_utc();
                Some(((now() as i64 - t.unix_timestamp()).max(0) * 1000).to_string())
            }
            // The region of the signature's scope.
            "aws:requestedregion" => {
                let credential = self.query_param("X-Amz-Credential").or_else(|| {
                    let a = self.header("authorization")?;
                    let c = a.split("Credential=").nth(1)?;
                    Some(c.split(',').next()?.to_string())
                })?;
                credential.split('/').nth(2).map(str::to_string)
            }
            // Tarn's one account: its id is twelve zeros.
            "aws:principalarn" => self
                .user
                .map(|u| format!("arn:aws:iam::000000000000:user/{u}")),
            "s3:requestobjecttagkeys" => self.values(key).map(|v| v.join(",")),
            k if k.starts_with(crate::policy::EXISTING_TAG_PREFIX) => {
                let want = &k[crate::policy::EXISTING_TAG_PREFIX.len()..];
                self.existing_tags?
                    .iter()
                    .find(|(t, _)| t.eq_ignore_ascii_case(want))
                    .map(|(_, v)| v.clone())
            }
            k if k.starts_with("s3:requestobjecttag/") => {
                let want = &k["s3:requestobjecttag/".len()..];
                let tagging = self.header("x-amz-tagging")?;
                crate::util::parse_tagging_header(Some(&tagging))
                    .ok()?
                    .into_iter()
                    .find(|(t, _)| t.eq_ignore_ascii_case(want))
                    .map(|(_, v)| v)
            }
            "s3:tlsversion" => self.tls.map(str::to_string),
            // VPCs, organizations, MFA, AWS services: never.
            k if k.starts_with("aws:") => None,
            k => k.strip_prefix("s3:").and_then(|h| self.header(h)),
        }
    }
}

/// Permission checks and the buckets' access settings.
pub struct Access {
    store: Arc<Store>,
    pub iam: Arc<Iam>,
    /// The cache buckets (their settings are read and changed with the
    /// other buckets' settings).
    pub caches: Arc<crate::cache::Caches>,
    buckets: RwLock<HashMap<String, Arc<BucketAccess>>>,
    loaded: AtomicBool,
    /// One change of bucket settings (or bucket creation) at a time.
    changes: tokio::sync::Mutex<()>,
    /// New buckets get the defaults from before April 2023 (ObjectWriter,
    /// no public access block) instead of AWS's current ones.
    legacy_defaults: AtomicBool,
}

impl Access {
    pub fn new(store: Arc<Store>, iam: Arc<Iam>) -> Arc<Self> {
        Arc::new(Access {
            caches: crate::cache::Caches::new(store.clone(), iam.clone()),
            store,
            iam,
            buckets: RwLock::new(HashMap::new()),
            loaded: AtomicBool::new(false),
            changes: tokio::sync::Mutex::new(()),
            legacy_defaults: AtomicBool::new(false),
        })
    }

    pub fn is_loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire) && self.iam.is_loaded()
    }

    /// Reads every bucket's settings (after the users: policies name them).
    pub async fn load(&self) -> Result<(), crate::iam::IamError> {
        self.iam.load().await?;
        self.read_all(false).await?;
        self.load_caches().await
    }

    /// Reads the users and every bucket's settings again: another node of a
    /// cluster changed them.
    pub async fn reload(&self) -> Result<(), crate::iam::IamError> {
        self.iam.reload().await?;
        self.read_all(true).await?;
        self.load_caches().await?;
        if let Err(error) = self.caches.join_jobs().await {
            tracing::warn!(%error, "cannot read the cluster's prefetch jobs");
        }
        Ok(())
    }

    async fn load_caches(&self) -> Result<(), crate::iam::IamError> {
        self.caches.load().await.map_err(|e| match e {
            crate::cache::CacheError::Store(e) => crate::iam::IamError::Store(e),
            e => crate::iam::IamError::Corrupt {
                what: "cache bucket settings".into(),
                reason: e.to_string(),
            },
        })
    }

    /// A bucket another node made a moment ago, not seen here yet: its
    /// record and settings are read from the catalog. Whether it exists.
    pub async fn refresh_bucket(&self, name: &str) -> bool {
        if !self.store.refresh_bucket(name).await {
            return false;
        }
        if self
            .buckets
            .read()
            .expect("access table")
            .contains_key(name)
        {
            return true;
        }
        if let Err(error) = self.reload().await {
            tracing::warn!(bucket = %name, %error, "cannot read the settings of a new bucket");
        }
        true
    }

    async fn read_all(&self, again: bool) -> Result<(), crate::iam::IamError> {
        let _g = self.changes.lock().await;
        if self.loaded.load(Ordering::Acquire) && !again {
            return Ok(());
        }
        let mut map = HashMap::new();
        for key in sysdoc::list(&self.store, BUCKETS_PREFIX).await? {
            let bytes = sysdoc::read(&self.store, &key).await?;
            let corrupt = |reason: String| crate::iam::IamError::Corrupt {
                what: key.clone(),
                reason,
            };
            let doc: BucketDoc =
                serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()))?;
            if doc.format != DOC_FORMAT || doc_key(&doc.bucket) != key {
                return Err(corrupt(format!(
                    "format {} for {:?}",
                    doc.format, doc.bucket
                )));
            }
            // A stored policy was valid when put; users it names may have
            // been removed since, which only makes it name nobody.
            let policy = match &doc.policy {
                Some(text) => Some(
                    Policy::parse(text, &doc.bucket, &|_| true)
                        .map_err(|e| corrupt(format!("its policy: {e}")))?,
                ),
                None => None,
            };
            map.insert(doc.bucket.clone(), Arc::new(BucketAccess::new(doc, policy)));
        }
        *self.buckets.write().expect("access table") = map;
        self.loaded.store(true, Ordering::Release);
        Ok(())
    }

    /// The settings of every bucket that has its own.
    pub fn buckets(&self) -> Vec<Arc<BucketAccess>> {
        let all: Vec<Arc<BucketAccess>> = self
            .buckets
            .read()
            .expect("access table")
            .values()
            .cloned()
            .collect();
        all.into_iter()
            .filter(|b| self.store.bucket_created_ns(&b.doc.bucket) == Some(b.doc.created_ns))
            .collect()
    }

    /// The settings of an existing bucket; None when there is no such bucket.
    pub fn bucket(&self, name: &str) -> Option<Arc<BucketAccess>> {
        let created_ns = self.store.bucket_created_ns(name)?;
        if let Some(b) = self.buckets.read().expect("access table").get(name) {
            if b.doc.created_ns == created_ns {
                return Some(b.clone());
            }
        }
        let doc = new_doc(
            name,
            created_ns,
            ROOT_USER,
            Ownership::BucketOwnerEnforced,
            Acl::private(ROOT_USER),
        );
        Some(Arc::new(BucketAccess::new(doc, None)))
    }

    fn user_exists(&self) -> impl Fn(&str) -> bool + '_ {
        |u| self.iam.user_exists(u)
    }

    /// Creates a bucket owned by `owner`. Its settings are written right
    /// after it; if that fails, the (empty) bucket is removed again.
    pub fn set_legacy_bucket_defaults(&self, on: bool) {
        self.legacy_defaults.store(on, Ordering::Relaxed);
    }

    /// The object ownership of a bucket created without one.
    pub fn default_ownership(&self) -> Ownership {
        if self.legacy_defaults.load(Ordering::Relaxed) {
            Ownership::ObjectWriter
        } else {
            Ownership::BucketOwnerEnforced
        }
    }

    /// Whether new buckets start with their public access blocked.
    pub fn blocks_new_buckets(&self) -> bool {
        !self.legacy_defaults.load(Ordering::Relaxed)
    }

    pub async fn create_bucket(
        &self,
        owner: &str,
        name: &str,
        durability: Durability,
        ownership: Ownership,
        acl: Acl,
        object_lock: bool,
    ) -> Result<(), StoreError> {
        let _g = self.changes.lock().await;
        self.store
            .create_bucket_with(name, durability, object_lock)
            .await?;
        let created_ns = self.store.head_bucket(name)?.created_ns;
        let mut doc = new_doc(name, created_ns, owner, ownership, acl);
        if !self.blocks_new_buckets() {
            doc.public_access_block = None;
        }
        if let Err(e) = sysdoc::write(&self.store, &doc_key(name), &doc).await {
            let _ = self.store.delete_bucket(name).await;
            return Err(e);
        }
        self.buckets
            .write()
            .expect("access table")
            .insert(name.to_string(), Arc::new(BucketAccess::new(doc, None)));
        Ok(())
    }

    /// Deletes an empty bucket and its settings.
    pub async fn delete_bucket(&self, name: &str) -> Result<(), StoreError> {
        let _g = self.changes.lock().await;
        self.store.delete_bucket(name).await?;
        self.buckets.write().expect("access table").remove(name);
        // A document left behind (a failed delete) never applies to a new
        // bucket of the same name: it names the old bucket's creation time.
        if let Err(e) = sysdoc::delete(&self.store, &doc_key(name)).await {
            tracing::warn!(bucket = name, error = %e, "the deleted bucket's settings stay behind");
        }
        // Its lifecycle lease too (a new bucket of the name would not take
        // it: the lease names the old one's creation time).
        let lease = crate::lifecycle::lease_key(name);
        if let Err(e) = self
            .store
            .delete_object(tarn_store::SYSTEM_BUCKET, &lease, None)
            .await
        {
            tracing::warn!(bucket = name, error = %e, "the deleted bucket's lifecycle lease stays behind");
        }
        Ok(())
    }

    /// Changes a bucket's settings: `change` edits the document (and may
    /// refuse); the new document is written, then takes effect.
    pub async fn update(
        &self,
        name: &str,
        change: impl FnOnce(&mut BucketDoc) -> S3Result<()>,
    ) -> S3Result<()> {
        let _g = self.changes.lock().await;
        let b = self
            .bucket(name)
            .ok_or_else(|| s3_error(StoreError::NoSuchBucket(name.to_string())))?;
        let mut doc = b.doc.clone();
        change(&mut doc)?;
        // An unchanged policy stays as parsed (users it names may have been
        // removed since it was put; that must not block other changes).
        let policy = match &doc.policy {
            Some(_) if doc.policy == b.doc.policy => b.policy.clone(),
            Some(text) => Some(self.parse_policy(name, text)?),
            None => None,
        };
        sysdoc::write(&self.store, &doc_key(name), &doc)
            .await
            .map_err(s3_error)?;
        self.buckets
            .write()
            .expect("access table")
            .insert(name.to_string(), Arc::new(BucketAccess::new(doc, policy)));
        Ok(())
    }

    /// Parses a policy for `bucket` as PutBucketPolicy must.
    pub fn parse_policy(&self, bucket: &str, text: &str) -> S3Result<Policy> {
        Policy::parse(text, bucket, &self.user_exists())
            .map_err(|e| S3Error::with_message(S3ErrorCode::MalformedPolicy, e.to_string()))
    }

    /// The ACL a write asks for (`x-amz-acl` or `x-amz-grant-*`), if any.
    pub fn requested_acl(
        &self,
        headers: &http::HeaderMap,
        owner: &str,
        bucket_owner: &str,
    ) -> S3Result<Option<Acl>> {
        let canned = headers
            .get("x-amz-acl")
            .map(|v| v.to_str().unwrap_or("").to_string());
        let granted = Acl::from_grant_headers(owner, headers, &self.user_exists())?;
        match (canned, granted) {
            (Some(_), Some(_)) => Err(S3Error::with_message(
                S3ErrorCode::InvalidRequest,
                "Specifying both Canned ACLs and Header Grants is not allowed",
            )),
            (Some(c), None) => Ok(Some(Acl::canned(&c, owner, bucket_owner)?)),
            (None, Some(a)) => Ok(Some(a)),
            (None, None) => Ok(None),
        }
    }

    /// The stored ACL header of an object written by `writer` into
    /// `bucket` with `headers` (None: the bucket owner's, private).
    pub fn object_acl_for_write(
        &self,
        b: &BucketAccess,
        writer: Option<&str>,
        headers: &http::HeaderMap,
    ) -> S3Result<Option<String>> {
        let bucket_owner = b.doc.owner.as_str();
        // Anonymous writers (a public-read-write bucket) leave their
        // objects to the bucket owner.
        let writer = writer.unwrap_or(bucket_owner);
        let owner = match b.doc.ownership {
            Some(Ownership::BucketOwnerEnforced) => bucket_owner,
            Some(Ownership::BucketOwnerPreferred)
                if headers
                    .get("x-amz-acl")
                    .is_some_and(|v| v.as_bytes() == b"bucket-owner-full-control") =>
            {
                bucket_owner
            }
            _ => writer,
        };
        let acl = self
            .requested_acl(headers, owner, bucket_owner)?
            .unwrap_or_else(|| Acl::private(owner));
        if acl.is_public() && b.pab().block_public_acls {
            return Err(denied());
        }
        if b.enforced() {
            return if acl.owner_only(bucket_owner) {
                Ok(None)
            } else {
                Err(acl_not_supported())
            };
        }
        if owner == bucket_owner && acl.owner_only(bucket_owner) {
            return Ok(None);
        }
        Ok(Some(acl.encode()))
    }

    /// Judges `action` on `bucket` or on its object `key`.
    fn judge(
        &self,
        b: &BucketAccess,
        cx: &Ctx<'_>,
        action: &str,
        bucket: &str,
        key: Option<&str>,
    ) -> Decision {
        let who = cx.user;
        let owner = who == Some(b.doc.owner.as_str());
        let verdict = b.policy.as_ref().map_or(Verdict::NotApplicable, |p| {
            let resource = match key {
                Some(k) => Cow::Owned(format!("{bucket}/{k}")),
                None => Cow::Borrowed(bucket),
            };
            p.evaluate(cx, action, &resource)
        });
        let pab = b.pab();
        match verdict {
            Verdict::Deny if !(owner && owner_always(action)) => return Decision::Deny,
            Verdict::Allow { public } if !(public && pab.restrict_public_buckets && !owner) => {
                return Decision::Allow
            }
            _ => {}
        }
        let object_permission = object_acl_permission(action);
        if owner && (b.enforced() || object_permission.is_none()) {
            return Decision::Allow;
        }
        if b.enforced() {
            return Decision::Deny;
        }
        if let Some(p) = bucket_acl_permission(action) {
            if b.acl.allows(who, p, pab.ignore_public_acls) {
                return Decision::Allow;
            }
        }
        match object_permission {
            Some(permission) => Decision::ObjectAcl(ObjectCheck {
                permission,
                bucket_owner: b.doc.owner.clone(),
                ignore_public: pab.ignore_public_acls,
            }),
            None => Decision::Deny,
        }
    }

    /// The caller's user name from the request's credentials.
    fn caller(&self, access_key: Option<&str>) -> S3Result<Option<Arc<str>>> {
        let Some(key) = access_key else {
            return Ok(None);
        };
        match self.iam.user_of(key) {
            Ok(Some(user)) => Ok(Some(user)),
            // The key was revoked after the signature was checked.
            Ok(None) => Err(S3Error::with_message(
                S3ErrorCode::InvalidAccessKeyId,
                "The AWS Access Key Id you provided does not exist in our records.",
            )),
            Err(e) => Err(S3Error::with_message(
                S3ErrorCode::ServiceUnavailable,
                e.to_string(),
            )),
        }
    }

    fn source_check(&self, cx: &Ctx<'_>) -> S3Result<Option<ObjectCheck>> {
        let Some(raw) = cx.header("x-amz-copy-source") else {
            return Ok(None);
        };
        let source = CopySource::parse(&raw).map_err(|_| {
            S3Error::with_message(S3ErrorCode::InvalidArgument, "Invalid x-amz-copy-source")
        })?;
        let CopySource::Bucket {
            bucket,
            key,
            version_id,
        } = source
        else {
            return Err(S3Error::with_message(
                S3ErrorCode::NotImplemented,
                "access point copy sources are not supported",
            ));
        };
        let b = self
            .bucket(&bucket)
            .ok_or_else(|| s3_error(StoreError::NoSuchBucket(bucket.to_string())))?;
        let action = if version_id.is_some() {
            "s3:GetObjectVersion"
        } else {
            "s3:GetObject"
        };
        match self.judge(&b, cx, action, &bucket, Some(&key)) {
            Decision::Allow => Ok(None),
            Decision::Deny => Err(denied()),
            Decision::ObjectAcl(c) => Ok(Some(c)),
        }
    }
}

pub(crate) fn acl_not_supported() -> S3Error {
    S3Error::with_message(
        S3ErrorCode::AccessControlListNotSupported,
        "The bucket does not allow ACLs (object ownership BucketOwnerEnforced).",
    )
}

/// Checks a pending object-ACL decision for `who` against the object read
/// (in bucket `b`).
fn object_allowed(
    check: Option<&ObjectCheck>,
    who: Option<&str>,
    b: Option<&BucketAccess>,
    info: &ObjectInfo,
) -> S3Result<()> {
    let Some(c) = check else {
        return Ok(());
    };
    let acl = match b {
        Some(b) => b.object_acl(info),
        None => Acl::private(&c.bucket_owner),
    };
    if who == Some(acl.owner.as_str()) || acl.allows(who, c.permission, c.ignore_public) {
        Ok(())
    } else {
        Err(denied())
    }
}

/// What a permission check reads of a request.
pub struct AccessRequest<'a> {
    /// The access key the request was signed with (None: anonymous).
    pub access_key: Option<&'a str>,
    /// The S3 operation's name (`GetObject`, ...).
    pub op: &'a str,
    pub path: &'a S3Path,
    pub headers: &'a http::HeaderMap,
    pub query: Option<&'a str>,
    pub peer: Option<IpAddr>,
    /// The TLS version when the request came over TLS
    /// (`aws:SecureTransport`, `s3:TlsVersion`).
    pub tls: Option<&'static str>,
    /// The named object's tags, for `s3:ExistingObjectTag/KEY` conditions
    /// (`Access::existing_tags`); None when no policy asks or there is none.
    pub existing_tags: Option<Vec<(String, String)>>,
}

impl Access {
    /// Judges one request: its permit, or the error to answer.
    pub fn authorize(&self, r: &AccessRequest<'_>) -> S3Result<Permit> {
        let user = self.caller(r.access_key)?;
        let op = r.op;
        if user.as_deref() == Some(ROOT_USER) {
            return Ok(Permit::root(user, r.headers));
        }
        if !self.is_loaded() {
            return Err(S3Error::with_message(
                S3ErrorCode::ServiceUnavailable,
                "The permissions are not loaded yet.",
            ));
        }
        let (bucket, key) = match r.path {
            S3Path::Root => (None, None),
            S3Path::Bucket { bucket } => (Some(&**bucket), None),
            S3Path::Object { bucket, key } => (Some(&**bucket), Some(&**key)),
        };
        let ctx = Ctx {
            user: user.as_deref(),
            headers: r.headers,
            query: r.query,
            peer: r.peer,
            tls: r.tls,
            existing_tags: r.existing_tags.as_deref(),
        };
        // ListBuckets (each user sees the buckets it owns) and CreateBucket
        // need a signed caller and nothing more.
        let Some(bucket) = bucket.filter(|_| op != "CreateBucket") else {
            if user.is_none() {
                return Err(denied());
            }
            return Ok(Permit {
                caller: user,
                ..Permit::default()
            });
        };
        let Some(b) = self.bucket(bucket) else {
            // A signed caller hears that the bucket does not exist (tools
            // create it then); an anonymous one learns nothing.
            return Err(match user {
                Some(_) => s3_error(StoreError::NoSuchBucket(bucket.to_string())),
                None => denied(),
            });
        };
        let source = if matches!(op, "CopyObject" | "UploadPartCopy") {
            self.source_check(&ctx)?
        } else {
            None
        };
        let decision = if op == "DeleteObjects" {
            // Judged key by key once the body is read (`delete_objects`).
            Decision::Allow
        } else {
            let versioned = r.query.is_some() && ctx.query_param("versionId").is_some();
            let also = match op {
                // AWS asks for both: the attributes and the object.
                "GetObjectAttributes" => {
                    action_of("GetObject", versioned).map(|a| self.judge(&b, &ctx, a, bucket, key))
                }
                _ => None,
            };
            match action_of(op, versioned) {
                Some(action) if also.is_some() => {
                    match (self.judge(&b, &ctx, action, bucket, key), also) {
                        (Decision::Deny, _) | (_, Some(Decision::Deny)) => Decision::Deny,
                        (Decision::ObjectAcl(c), _) | (_, Some(Decision::ObjectAcl(c))) => {
                            Decision::ObjectAcl(c)
                        }
                        _ => Decision::Allow,
                    }
                }
                Some(action) => self.judge(&b, &ctx, action, bucket, key),
                // An operation Tarn does not serve: the owner hears
                // NotImplemented from it, others are refused here.
                None if user.as_deref() == Some(b.doc.owner.as_str()) => Decision::Allow,
                None => Decision::Deny,
            }
        };
        let object = match decision {
            Decision::Allow => None,
            Decision::Deny => return Err(denied()),
            Decision::ObjectAcl(c) => Some(c),
        };
        let allows =
            |action: &str| matches!(self.judge(&b, &ctx, action, bucket, key), Decision::Allow);
        // A write that locks its version needs the lock's permissions too.
        if !lock_actions(op, r.headers).into_iter().all(allows) {
            return Err(denied());
        }
        // (DeleteObjects: judged key by key, `BypassAllowed`.)
        let bypass_governance = matches!(op, "DeleteObject" | "PutObjectRetention")
            && asks_bypass(r.headers)
            && allows("s3:BypassGovernanceRetention");
        let sees_lock = match op {
            "GetObject" | "HeadObject" => (
                allows("s3:GetObjectRetention"),
                allows("s3:GetObjectLegalHold"),
            ),
            _ => (false, false),
        };
        let hide_missing = matches!(op, "GetObject" | "HeadObject" | "GetObjectAttributes")
            && !matches!(
                self.judge(&b, &ctx, "s3:ListBucket", bucket, None),
                Decision::Allow
            );
        Ok(Permit {
            caller: user,
            bucket: Some(b),
            object,
            source,
            hide_missing,
            bypass_governance,
            sees_lock,
        })
    }
}

impl Access {
    /// The tags of the object a request names, when its bucket's policy has
    /// an `s3:ExistingObjectTag/KEY` condition (one metadata read then;
    /// none otherwise). A missing object has none.
    pub async fn existing_tags(
        &self,
        path: &S3Path,
        query: Option<&str>,
    ) -> Option<Vec<(String, String)>> {
        let S3Path::Object { bucket, key } = path else {
            return None;
        };
        let b = self.bucket(bucket)?;
        if !b
            .policy
            .as_ref()
            .is_some_and(|p| p.mentions_key(crate::policy::EXISTING_TAG_PREFIX))
        {
            return None;
        }
        let version = query.and_then(|q| query_param(q, "versionId"));
        self.store
            .head_object(bucket, key, version.as_deref())
            .await
            .ok()
            .map(|info| info.tags)
    }

    /// `x-amz-expected-bucket-owner` (and, for copies,
    /// `x-amz-source-expected-bucket-owner`): the request is refused (403)
    /// unless the bucket's owner is the one named, whoever asks (root too).
    fn check_expected_owners(&self, path: &S3Path, headers: &http::HeaderMap) -> S3Result<()> {
        let owner_of = |bucket: &str| self.bucket(bucket).map(|b| b.doc.owner.clone());
        if let Some(want) = headers.get("x-amz-expected-bucket-owner") {
            if let S3Path::Bucket { bucket } | S3Path::Object { bucket, .. } = path {
                if let Some(owner) = owner_of(bucket) {
                    if want.as_bytes() != owner.as_bytes() {
                        return Err(denied());
                    }
                }
            }
        }
        if let Some(want) = headers.get("x-amz-source-expected-bucket-owner") {
            let source = headers
                .get("x-amz-copy-source")
                .and_then(|v| v.to_str().ok())
                .and_then(|s| CopySource::parse(s).ok());
            if let Some(CopySource::Bucket { bucket, .. }) = source {
                if let Some(owner) = owner_of(&bucket) {
                    if want.as_bytes() != owner.as_bytes() {
                        return Err(denied());
                    }
                }
            }
        }
        Ok(())
    }
}

/// An access checker bound to `Access` (the S3 service keeps it).
pub struct Checker(pub Arc<Access>);

#[async_trait::async_trait]
impl S3Access for Checker {
    async fn check(&self, cx: &mut S3AccessContext<'_>) -> S3Result<()> {
        let peer = cx.extensions_mut().get::<ClientAddr>().map(|c| c.0);
        let tls = cx.extensions_mut().get::<SecureTransport>().map(|t| t.0);
        // In a cluster a bucket made through another node a moment ago may
        // not have reached this node's view yet: the catalog is asked.
        if let S3Path::Bucket { bucket } | S3Path::Object { bucket, .. } = cx.s3_path() {
            if self.0.store.catalog().is_some() && self.0.store.bucket_created_ns(bucket).is_none()
            {
                let bucket = bucket.to_string();
                self.0.refresh_bucket(&bucket).await;
            }
        }
        self.0.check_expected_owners(cx.s3_path(), cx.headers())?;
        // A form upload names its key in the form, read after this check:
        // it is judged as the PutObject it is in `post_object`.
        if cx.s3_op().name() == "PostObject" {
            return Ok(());
        }
        let existing_tags = self.0.existing_tags(cx.s3_path(), cx.uri().query()).await;
        let permit = self.0.authorize(&AccessRequest {
            access_key: cx.credentials().map(|c| c.access_key.as_str()),
            op: cx.s3_op().name(),
            path: cx.s3_path(),
            headers: cx.headers(),
            query: cx.uri().query(),
            peer,
            tls,
            existing_tags,
        })?;
        cx.extensions_mut().insert(permit);
        Ok(())
    }

    /// A form upload: the key with the file's name in place of
    /// `${filename}`, the form's ACL, encryption and lock fields made the
    /// headers they are in a PUT (so that they are honoured or refused, never
    /// ignored), then judged as a PutObject of that key.
    async fn post_object(&self, req: &mut S3Request<PostObjectInput>) -> S3Result<()> {
        let form = req
            .extensions
            .get::<crate::post::FileName>()
            .and_then(|f| f.0.get().cloned())
            .unwrap_or_default();
        req.extensions.insert(crate::post::FormUpload);
        // Fields S3 reads that s3s does not.
        if let Some(acl) = form.field("acl") {
            let v = http::HeaderValue::from_str(acl).map_err(|_| {
                S3Error::with_message(S3ErrorCode::InvalidArgument, "The acl field is not valid.")
            })?;
            req.headers.insert("x-amz-acl", v);
        }
        if form.field("tagging").is_some() {
            return Err(S3Error::with_message(
                S3ErrorCode::NotImplemented,
                "The tagging field of a form upload is not supported; tag the object with PutObjectTagging. Nothing was stored.",
            ));
        }
        if req.input.key.contains("${filename}") {
            let file = form.file_name.clone();
            if file.is_empty() {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    "The key names ${filename} but the form's file has no name.",
                ));
            };
            req.input.key = crate::post::form_key(&req.input.key, Some(&file));
            req.extensions.insert(crate::post::Substituted(file));
        }
        if req.input.key.is_empty() {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidArgument,
                "The form's key is empty.",
            ));
        }
        crate::post::fields_as_headers(&req.input, &mut req.headers)?;
        crate::post::encryption_fields(&form, &mut req.headers)?;
        let path = S3Path::Object {
            bucket: req.input.bucket.clone().into(),
            key: req.input.key.clone().into(),
        };
        let permit = self.0.authorize(&AccessRequest {
            access_key: req.credentials.as_ref().map(|c| c.access_key.as_str()),
            op: "PutObject",
            path: &path,
            headers: &req.headers,
            query: None,
            peer: req.extensions.get::<ClientAddr>().map(|c| c.0),
            tls: req.extensions.get::<SecureTransport>().map(|t| t.0),
            existing_tags: None,
        })?;
        req.extensions.insert(permit);
        Ok(())
    }

    async fn delete_objects(&self, req: &mut S3Request<DeleteObjectsInput>) -> S3Result<()> {
        let a = &self.0;
        let Some(permit) = permit_of(&req.extensions) else {
            return Err(denied());
        };
        if permit.caller() == Some(ROOT_USER) {
            return Ok(());
        }
        let Some(b) = permit.bucket.clone() else {
            return Err(denied());
        };
        let ctx = Ctx {
            user: permit.caller(),
            headers: &req.headers,
            query: req.uri.query(),
            peer: req.extensions.get::<ClientAddr>().map(|c| c.0),
            tls: req.extensions.get::<SecureTransport>().map(|t| t.0),
            existing_tags: None,
        };
        let mut refused = DeniedDeletes::default();
        let mut bypass = BypassAllowed::default();
        let asks = asks_bypass(&req.headers);
        for o in &req.input.delete.objects {
            let action = if o.version_id.is_some() {
                "s3:DeleteObjectVersion"
            } else {
                "s3:DeleteObject"
            };
            let judged = a.judge(&b, &ctx, action, &req.input.bucket, Some(&o.key));
            if !matches!(judged, Decision::Allow) {
                refused.0.insert((o.key.clone(), o.version_id.clone()));
            }
            if asks
                && matches!(
                    a.judge(
                        &b,
                        &ctx,
                        "s3:BypassGovernanceRetention",
                        &req.input.bucket,
                        Some(&o.key)
                    ),
                    Decision::Allow
                )
            {
                bypass.0.insert(o.key.clone());
            }
        }
        req.extensions.insert(refused);
        req.extensions.insert(bypass);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_of_operations() {
        assert_eq!(action_of("GetObject", false), Some("s3:GetObject"));
        assert_eq!(action_of("HeadObject", true), Some("s3:GetObjectVersion"));
        assert_eq!(action_of("UploadPartCopy", false), Some("s3:PutObject"));
        assert_eq!(action_of("ListObjectsV2", false), Some("s3:ListBucket"));
        assert_eq!(action_of("GetBucketWebsite", false), None);
        assert_eq!(
            bucket_acl_permission("s3:DeleteObject"),
            Some(Permission::Write)
        );
        assert_eq!(
            object_acl_permission("s3:GetObjectVersion"),
            Some(Permission::Read)
        );
    }
}
