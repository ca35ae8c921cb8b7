//! Lifecycle: a bucket's rules that expire current versions, noncurrent
//! versions, delete markers left alone and incomplete multipart uploads,
//! and the background scanner that applies them (docs/lifecycle.md).
//!
//! The rules live in the bucket's settings document. Every node runs the
//! scanner; one node at a time scans a bucket, under a lease kept in the
//! system bucket (`lifecycle/BUCKET`), which also records when the last
//! pass ended so that a bucket is scanned once per interval, whichever node
//! does it and across restarts. Each expiry is checked again under the
//! key's lock (`Store::expire_if_unchanged`): a key written since the scan
//! read it is left alone.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::StreamExt;
use s3s::dto;
use s3s::{S3Error, S3ErrorCode, S3Result};
use serde::{Deserialize, Serialize};
use tarn_store::{
    ObjectBody, ObjectInfo, PutOptions, Store, StoreError, Unchanged, VersionListParams,
    SYSTEM_BUCKET,
};

use crate::access::{Access, BucketAccess};

/// Most rules one configuration may hold (AWS's limit).
pub const RULES_MAX: usize = 1000;

/// A bucket's lifecycle configuration as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lifecycle {
    pub rules: Vec<Rule>,
}

/// One rule: which objects (prefix, tags, size bounds) and what happens
/// to them. Days count from the version's creation (current versions),
/// from when it became noncurrent (noncurrent versions) or from the
/// upload's start; expiry falls at the start of the next day (UTC
/// midnight) after that many days, as S3 rounds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    pub id: String,
    pub enabled: bool,
    #[serde(default)]
    pub prefix: String,
    /// The prefix came as the old top-level `<Prefix>` (answered back so).
    #[serde(default)]
    pub legacy_prefix: bool,
    /// The filter came as `<And>` (answered back so).
    #[serde(default)]
    pub and: bool,
    #[serde(default)]
    pub tags: Vec<(String, String)>,
    pub size_gt: Option<i64>,
    pub size_lt: Option<i64>,
    pub days: Option<u32>,
    /// Seconds since the epoch (a UTC midnight).
    pub date_s: Option<i64>,
    #[serde(default)]
    pub expired_delete_marker: bool,
    pub noncurrent_days: Option<u32>,
    pub newer_noncurrent: Option<u32>,
    pub abort_days: Option<u32>,
}

fn invalid(code: S3ErrorCode, msg: impl Into<String>) -> S3Error {
    S3Error::with_message(code, msg.into())
}

fn malformed(msg: &str) -> S3Error {
    invalid(S3ErrorCode::MalformedXML, msg)
}

fn positive(v: i32, what: &str) -> S3Result<u32> {
    if v > 0 {
        Ok(v as u32)
    } else {
        Err(invalid(
            S3ErrorCode::InvalidArgument,
            format!("'{what}' must be a positive integer"),
        ))
    }
}

impl Lifecycle {
    /// A configuration from a PutBucketLifecycleConfiguration body, checked
    /// as S3 checks it. Transitions are refused: Tarn has one storage class.
    pub fn from_dto(c: &dto::BucketLifecycleConfiguration) -> S3Result<Lifecycle> {
        if c.rules.is_empty() || c.rules.len() > RULES_MAX {
            return Err(malformed("A lifecycle configuration holds 1 to 1000 rules"));
        }
        let mut rules: Vec<Rule> = Vec::with_capacity(c.rules.len());
        for r in &c.rules {
            let rule = Rule::from_dto(r)?;
            if rules.iter().any(|o| o.id == rule.id) {
                return Err(invalid(
                    S3ErrorCode::InvalidArgument,
                    "Rule ID must be unique. Found same ID for more than one rule",
                ));
            }
            rules.push(rule);
        }
        Ok(Lifecycle { rules })
    }

    pub fn to_dto(&self) -> Vec<dto::LifecycleRule> {
        self.rules.iter().map(Rule::to_dto).collect()
    }

    /// Whether any enabled rule aborts incomplete uploads.
    fn aborts_uploads(&self) -> bool {
        self.rules
            .iter()
            .any(|r| r.enabled && r.abort_days.is_some())
    }
}

impl Rule {
    fn from_dto(r: &dto::LifecycleRule) -> S3Result<Rule> {
        let id = match r.id.as_deref() {
            Some(id) if id.chars().count() > 255 => {
                return Err(invalid(
                    S3ErrorCode::InvalidArgument,
                    "ID length should not exceed allowed limit of 255",
                ))
            }
            Some(id) if !id.is_empty() => id.to_string(),
            // S3 names a rule given without an ID.
            _ => {
                let mut raw = [0u8; 12];
                getrandom::fill(&mut raw).expect("operating system random source");
                raw.iter().map(|b| format!("{b:02x}")).collect()
            }
        };
        let enabled = match r.status.as_str() {
            "Enabled" => true,
            "Disabled" => false,
            _ => return Err(malformed("Status must be Enabled or Disabled")),
        };
        if r.transitions.as_ref().is_some_and(|t| !t.is_empty())
            || r.noncurrent_version_transitions
                .as_ref()
                .is_some_and(|t| !t.is_empty())
        {
            return Err(invalid(
                S3ErrorCode::NotImplemented,
                "Transitions are not supported: Tarn has one storage class. Nothing was changed.",
            ));
        }
        let mut rule = Rule {
            id,
            enabled,
            ..Default::default()
        };
        match (&r.prefix, &r.filter) {
            (Some(_), Some(_)) => {
                return Err(malformed(
                    "A rule has either a Prefix or a Filter, not both",
                ))
            }
            (None, None) => return Err(malformed("A rule needs a Filter (or a Prefix)")),
            (Some(p), None) => {
                rule.prefix = p.clone();
                rule.legacy_prefix = true;
            }
            (None, Some(f)) => {
                let given = [
                    f.prefix.is_some(),
                    f.tag.is_some(),
                    f.object_size_greater_than.is_some(),
                    f.object_size_less_than.is_some(),
                    f.and.is_some(),
                ]
                .iter()
                .filter(|x| **x)
                .count();
                if given > 1 {
                    return Err(malformed(
                        "A Filter has one of Prefix, Tag, ObjectSizeGreaterThan, ObjectSizeLessThan or And",
                    ));
                }
                rule.prefix = f.prefix.clone().unwrap_or_default();
                if let Some(t) = &f.tag {
                    rule.tags.push((
                        t.key.clone().unwrap_or_default(),
                        t.value.clone().unwrap_or_default(),
                    ));
                }
                rule.size_gt = f.object_size_greater_than;
                rule.size_lt = f.object_size_less_than;
                if let Some(a) = &f.and {
                    rule.and = true;
                    rule.prefix = a.prefix.clone().unwrap_or_default();
                    for t in a.tags.iter().flatten() {
                        rule.tags.push((
                            t.key.clone().unwrap_or_default(),
                            t.value.clone().unwrap_or_default(),
                        ));
                    }
                    rule.size_gt = a.object_size_greater_than;
                    rule.size_lt = a.object_size_less_than;
                }
            }
        }
        crate::util::check_tag_items(&rule.tags)?;
        if rule.size_gt.is_some_and(|n| n < 0) || rule.size_lt.is_some_and(|n| n <= 0) {
            return Err(invalid(
                S3ErrorCode::InvalidArgument,
                "Object size bounds must be positive",
            ));
        }
        if let (Some(gt), Some(lt)) = (rule.size_gt, rule.size_lt) {
            if gt >= lt {
                return Err(invalid(
                    S3ErrorCode::InvalidRequest,
                    "ObjectSizeGreaterThan must be less than ObjectSizeLessThan",
                ));
            }
        }
        let filtered_by_object =
            !rule.tags.is_empty() || rule.size_gt.is_some() || rule.size_lt.is_some();
        if let Some(e) = &r.expiration {
            let given = [
                e.days.is_some(),
                e.date.is_some(),
                e.expired_object_delete_marker.is_some(),
            ]
            .iter()
            .filter(|x| **x)
            .count();
            if given != 1 {
                return Err(malformed(
                    "Expiration has one of Days, Date or ExpiredObjectDeleteMarker",
                ));
            }
            if let Some(d) = e.days {
                rule.days = Some(positive(d, "Days' for Expiration action")?);
            }
            if let Some(date) = &e.date {
                let t = time::OffsetDateTime::from(date.clone());
                if t.time() != time::Time::MIDNIGHT || t.offset() != time::UtcOffset::UTC {
                    return Err(invalid(
                        S3ErrorCode::InvalidArgument,
                        "'Date' must be at midnight GMT",
                    ));
                }
                rule.date_s = Some(t.unix_timestamp());
            }
            if e.expired_object_delete_marker == Some(true) {
                if filtered_by_object {
                    return Err(invalid(
                        S3ErrorCode::InvalidRequest,
                        "ExpiredObjectDeleteMarker cannot be specified with tag or size filters",
                    ));
                }
                rule.expired_delete_marker = true;
            }
        }
        if let Some(n) = &r.noncurrent_version_expiration {
            let days = n
                .noncurrent_days
                .ok_or_else(|| malformed("NoncurrentVersionExpiration needs NoncurrentDays"))?;
            rule.noncurrent_days = Some(positive(days, "NoncurrentDays")?);
            if let Some(k) = n.newer_noncurrent_versions {
                if !(1..=100).contains(&k) {
                    return Err(invalid(
                        S3ErrorCode::InvalidArgument,
                        "NewerNoncurrentVersions must be between 1 and 100",
                    ));
                }
                rule.newer_noncurrent = Some(k as u32);
            }
        }
        if let Some(a) = &r.abort_incomplete_multipart_upload {
            let days = a.days_after_initiation.ok_or_else(|| {
                malformed("AbortIncompleteMultipartUpload needs DaysAfterInitiation")
            })?;
            if filtered_by_object {
                return Err(invalid(
                    S3ErrorCode::InvalidRequest,
                    "Tag-based or size-based filters cannot be used with the AbortIncompleteMultipartUpload action",
                ));
            }
            rule.abort_days = Some(positive(days, "DaysAfterInitiation")?);
        }
        if rule.days.is_none()
            && rule.date_s.is_none()
            && !rule.expired_delete_marker
            && rule.noncurrent_days.is_none()
            && rule.abort_days.is_none()
        {
            return Err(invalid(
                S3ErrorCode::InvalidRequest,
                "At least one action needs to be specified in a rule",
            ));
        }
        Ok(rule)
    }

    fn to_dto(&self) -> dto::LifecycleRule {
        let tag = |(k, v): &(String, String)| dto::Tag {
            key: Some(k.clone()),
            value: Some(v.clone()),
        };
        let filter = if self.legacy_prefix {
            None
        } else if self.and {
            Some(dto::LifecycleRuleFilter {
                and: Some(dto::LifecycleRuleAndOperator {
                    prefix: (!self.prefix.is_empty()).then(|| self.prefix.clone()),
                    tags: (!self.tags.is_empty()).then(|| self.tags.iter().map(tag).collect()),
                    object_size_greater_than: self.size_gt,
                    object_size_less_than: self.size_lt,
                }),
                ..Default::default()
            })
        } else {
            Some(dto::LifecycleRuleFilter {
                prefix: (self.tags.is_empty() && self.size_gt.is_none() && self.size_lt.is_none())
                    .then(|| self.prefix.clone()),
                tag: self.tags.first().map(tag),
                object_size_greater_than: self.size_gt,
                object_size_less_than: self.size_lt,
                ..Default::default()
            })
        };
        let expiration = (self.days.is_some()
            || self.date_s.is_some()
            || self.expired_delete_marker)
            .then(|| dto::LifecycleExpiration {
                days: self.days.map(|d| d as i32),
                date: self.date_s.map(|s| {
                    dto::Timestamp::from(UNIX_EPOCH + Duration::from_secs(s.max(0) as u64))
                }),
                expired_object_delete_marker: self.expired_delete_marker.then_some(true),
            });
        dto::LifecycleRule {
            id: Some(self.id.clone()),
            status: dto::ExpirationStatus::from(
                if self.enabled { "Enabled" } else { "Disabled" }.to_string(),
            ),
            prefix: self.legacy_prefix.then(|| self.prefix.clone()),
            filter,
            expiration,
            noncurrent_version_expiration: self.noncurrent_days.map(|d| {
                dto::NoncurrentVersionExpiration {
                    noncurrent_days: Some(d as i32),
                    newer_noncurrent_versions: self.newer_noncurrent.map(|n| n as i32),
                }
            }),
            abort_incomplete_multipart_upload: self.abort_days.map(|d| {
                dto::AbortIncompleteMultipartUpload {
                    days_after_initiation: Some(d as i32),
                }
            }),
            noncurrent_version_transitions: None,
            transitions: None,
        }
    }

    /// Whether the rule's filter takes this version (delete markers have
    /// no tags and no size: a tag or size filter never takes them).
    fn takes(&self, v: &ObjectInfo) -> bool {
        if !self.enabled || !v.key.starts_with(&self.prefix) {
            return false;
        }
        if v.delete_marker {
            return self.tags.is_empty() && self.size_gt.is_none() && self.size_lt.is_none();
        }
        let size = v.size as i64;
        self.size_gt.is_none_or(|n| size > n)
            && self.size_lt.is_none_or(|n| size < n)
            && self.tags.iter().all(|t| v.tags.contains(t))
    }
}

/// How the scanner runs.
#[derive(Debug, Clone, Copy)]
pub struct ScanSettings {
    /// Each bucket is scanned at most once per interval.
    pub interval: Duration,
    /// A lifecycle "day" (one day; tests make it seconds).
    pub day: Duration,
    /// Versions (and uploads) visited per second at most (0: no bound).
    pub rate: u64,
}

impl Default for ScanSettings {
    fn default() -> Self {
        ScanSettings {
            interval: Duration::from_secs(3600),
            day: Duration::from_secs(86_400),
            rate: 20_000,
        }
    }
}

/// What the scanners of this process did (`/metrics`).
#[derive(Debug, Default)]
pub struct Counters {
    pub passes: AtomicU64,
    pub scanned: AtomicU64,
    pub expired: AtomicU64,
    pub noncurrent_expired: AtomicU64,
    pub delete_markers_removed: AtomicU64,
    pub uploads_aborted: AtomicU64,
    /// Expiries skipped: object lock keeps the version.
    pub locked_kept: AtomicU64,
    pub errors: AtomicU64,
}

pub static COUNTERS: Counters = Counters {
    passes: AtomicU64::new(0),
    scanned: AtomicU64::new(0),
    expired: AtomicU64::new(0),
    noncurrent_expired: AtomicU64::new(0),
    delete_markers_removed: AtomicU64::new(0),
    uploads_aborted: AtomicU64::new(0),
    locked_kept: AtomicU64::new(0),
    errors: AtomicU64::new(0),
};

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// When something `days` days after `start_ns` is due: rounded up to the
/// start of the next day (UTC midnight for real days).
fn due_ns(start_ns: u64, days: u32, day: Duration) -> u64 {
    let day = day.as_nanos().max(1) as u64;
    let at = start_ns.saturating_add((days as u64).saturating_mul(day));
    at.div_ceil(day).saturating_mul(day)
}

/// What one pass decided for one key.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    ExpireCurrent { version: String, mod_time_ns: u64 },
    ExpireNoncurrent { version: String },
    RemoveMarker { version: String },
}

fn version_name(v: &ObjectInfo) -> String {
    v.version_id.clone().unwrap_or_else(|| "null".into())
}

/// The actions the rules ask for on one key's versions (newest first) at
/// `now_ns`.
fn judge(rules: &[Rule], versions: &[ObjectInfo], now_ns: u64, day: Duration) -> Vec<Action> {
    let mut out = Vec::new();
    let Some(current) = versions.first() else {
        return out;
    };
    if current.delete_marker {
        if versions.len() == 1
            && rules
                .iter()
                .any(|r| r.expired_delete_marker && r.takes(current))
        {
            out.push(Action::RemoveMarker {
                version: version_name(current),
            });
            return out;
        }
    } else {
        let due = rules.iter().filter(|r| r.takes(current)).any(|r| {
            r.days
                .is_some_and(|d| due_ns(current.last_modified_ns, d, day) <= now_ns)
                || r.date_s
                    .is_some_and(|s| (s.max(0) as u64).saturating_mul(1_000_000_000) <= now_ns)
        });
        if due {
            out.push(Action::ExpireCurrent {
                version: version_name(current),
                mod_time_ns: current.last_modified_ns,
            });
        }
    }
    for (i, v) in versions.iter().enumerate().skip(1) {
        // Noncurrent since its successor was written; `i - 1` newer
        // noncurrent versions.
        let since = versions[i - 1].last_modified_ns;
        let due = rules.iter().filter(|r| r.takes(v)).any(|r| {
            r.noncurrent_days.is_some_and(|d| {
                (i - 1) as u32 >= r.newer_noncurrent.unwrap_or(0) && due_ns(since, d, day) <= now_ns
            })
        });
        if due {
            out.push(Action::ExpireNoncurrent {
                version: version_name(v),
            });
        }
    }
    out
}

/// The lease record of one bucket's scans.
#[derive(Debug, Serialize, Deserialize)]
struct Lease {
    /// The bucket it is for (a bucket of the same name made later starts
    /// afresh).
    created_ns: u64,
    running: bool,
    /// When the last pass ended.
    done_ns: u64,
}

/// A lease not renewed for this long was its holder's last: taken over.
const LEASE_TTL: Duration = Duration::from_secs(60);
const LEASE_RENEW: Duration = Duration::from_secs(15);

pub(crate) fn lease_key(bucket: &str) -> String {
    format!("lifecycle/{bucket}")
}

/// The background scanner of one node.
pub struct Scanner {
    access: Arc<Access>,
    store: Arc<Store>,
    settings: ScanSettings,
}

impl Scanner {
    pub fn new(access: Arc<Access>, store: Arc<Store>, settings: ScanSettings) -> Self {
        Scanner {
            access,
            store,
            settings,
        }
    }

    /// Runs for as long as the server does.
    pub async fn run(self) {
        while !self.access.is_loaded() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        let tick =
            (self.settings.interval / 4).clamp(Duration::from_millis(200), Duration::from_secs(60));
        loop {
            for b in self.access.buckets() {
                let Some(lc) = b.doc.lifecycle.clone() else {
                    continue;
                };
                if !lc.rules.iter().any(|r| r.enabled) {
                    continue;
                }
                if let Err(error) = self.pass(&b, &lc).await {
                    COUNTERS.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(bucket = %b.doc.bucket(), %error, "lifecycle pass failed; tried again next interval");
                }
            }
            tokio::time::sleep(tick).await;
        }
    }

    async fn read_lease(&self, key: &str) -> Result<Option<(Lease, String, u64)>, StoreError> {
        let got = match self
            .store
            .get_object_if(SYSTEM_BUCKET, key, None, None, None, &Default::default())
            .await
        {
            Ok(g) => g,
            Err(StoreError::NoSuchKey { .. } | StoreError::DeleteMarker { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let (etag, modified) = (got.info.etag.clone(), got.info.last_modified_ns);
        let mut bytes = Vec::new();
        let mut stream = got.stream;
        while let Some(chunk) = stream.next().await {
            bytes.extend_from_slice(&chunk?);
        }
        let lease = serde_json::from_slice(&bytes).unwrap_or(Lease {
            created_ns: 0,
            running: false,
            done_ns: 0,
        });
        Ok(Some((lease, etag, modified)))
    }

    /// Writes the lease if it is still `etag` (None: absent); its new ETag,
    /// or None when another node changed it first.
    async fn write_lease(
        &self,
        key: &str,
        etag: Option<&str>,
        lease: &Lease,
    ) -> Result<Option<String>, StoreError> {
        let opts = PutOptions {
            content_type: Some("application/json".into()),
            if_match: etag.map(|e| format!("\"{e}\"")),
            if_none_match: etag.is_none().then(|| "*".to_string()),
            ..Default::default()
        };
        let body = serde_json::to_vec(lease).expect("a lease serializes");
        match self
            .store
            .put_object(SYSTEM_BUCKET, key, ObjectBody::from_bytes(body), opts)
            .await
        {
            Ok(info) => Ok(Some(info.etag)),
            Err(StoreError::PreconditionFailed(_) | StoreError::NoSuchKey { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The lease of a pass over `bucket` if one is due and no other node
    /// runs it: its ETag.
    async fn take_lease(
        &self,
        bucket: &str,
        created_ns: u64,
    ) -> Result<Option<String>, StoreError> {
        let key = lease_key(bucket);
        let now = now_ns();
        let held = self.read_lease(&key).await?;
        if let Some((l, _, modified)) = &held {
            if l.created_ns == created_ns {
                if l.running && now.saturating_sub(*modified) < LEASE_TTL.as_nanos() as u64 {
                    return Ok(None);
                }
                if !l.running
                    && now.saturating_sub(l.done_ns) < self.settings.interval.as_nanos() as u64
                {
                    return Ok(None);
                }
            }
        }
        let lease = Lease {
            created_ns,
            running: true,
            done_ns: held.as_ref().map_or(0, |(l, _, _)| l.done_ns),
        };
        self.write_lease(&key, held.as_ref().map(|(_, e, _)| e.as_str()), &lease)
            .await
    }

    /// One pass over a bucket, if due and not another node's.
    async fn pass(&self, b: &BucketAccess, lc: &Lifecycle) -> Result<(), StoreError> {
        let bucket = b.doc.bucket().to_string();
        let Some(created_ns) = self.store.bucket_created_ns(&bucket) else {
            return Ok(());
        };
        let Some(mut etag) = self.take_lease(&bucket, created_ns).await? else {
            return Ok(());
        };
        let key = lease_key(&bucket);
        let mut renewed = Instant::now();
        let mut paced = Pacer::new(self.settings.rate);
        let rules: Vec<Rule> = lc.rules.iter().filter(|r| r.enabled).cloned().collect();
        let renew = async |etag: &mut String, renewed: &mut Instant| -> Result<bool, StoreError> {
            if renewed.elapsed() < LEASE_RENEW {
                return Ok(true);
            }
            let lease = Lease {
                created_ns,
                running: true,
                done_ns: 0,
            };
            match self.write_lease(&key, Some(etag), &lease).await? {
                Some(e) => {
                    *etag = e;
                    *renewed = Instant::now();
                    Ok(true)
                }
                None => Ok(false),
            }
        };
        // Versions, a page at a time; a key's versions may span pages.
        let mut key_marker: Option<String> = None;
        let mut version_marker: Option<String> = None;
        let mut group: Vec<ObjectInfo> = Vec::new();
        loop {
            let page = self
                .store
                .list_object_versions(
                    &bucket,
                    VersionListParams {
                        prefix: String::new(),
                        delimiter: None,
                        key_marker: key_marker.clone(),
                        version_id_marker: version_marker.clone(),
                        max_keys: 1000,
                    },
                )
                .await?;
            let n = page.versions.len() as u64;
            COUNTERS.scanned.fetch_add(n, Ordering::Relaxed);
            for v in page.versions {
                if group.first().is_some_and(|g| g.key != v.key) {
                    let done = std::mem::take(&mut group);
                    self.apply(&bucket, &rules, &done).await?;
                }
                group.push(v);
            }
            if !page.is_truncated {
                break;
            }
            key_marker = page.next_key_marker;
            version_marker = page.next_version_id_marker;
            paced.wait(n).await;
            if !renew(&mut etag, &mut renewed).await? {
                return Ok(());
            }
        }
        self.apply(&bucket, &rules, &group).await?;
        if lc.aborts_uploads() {
            let (mut km, mut um): (Option<String>, Option<String>) = (None, None);
            loop {
                let (uploads, _, truncated) = self
                    .store
                    .list_multipart_uploads(&bucket, "", None, km.as_deref(), um.as_deref(), 1000)
                    .await?;
                let now = now_ns();
                for u in &uploads {
                    let due = rules.iter().any(|r| {
                        u.key.starts_with(&r.prefix)
                            && r.abort_days.is_some_and(|d| {
                                due_ns(u.initiated_ns, d, self.settings.day) <= now
                            })
                    });
                    if due {
                        match self
                            .store
                            .abort_multipart_upload(&bucket, &u.key, &u.upload_id)
                            .await
                        {
                            Ok(()) => {
                                COUNTERS.uploads_aborted.fetch_add(1, Ordering::Relaxed);
                            }
                            // Completed or aborted meanwhile.
                            Err(StoreError::NoSuchUpload(_)) => {}
                            Err(e) => return Err(e),
                        }
                    }
                }
                paced.wait(uploads.len() as u64).await;
                if !truncated || uploads.is_empty() {
                    break;
                }
                km = uploads.last().map(|u| u.key.clone());
                um = uploads.last().map(|u| u.upload_id.clone());
                if !renew(&mut etag, &mut renewed).await? {
                    return Ok(());
                }
            }
        }
        COUNTERS.passes.fetch_add(1, Ordering::Relaxed);
        let done = Lease {
            created_ns,
            running: false,
            done_ns: now_ns(),
        };
        self.write_lease(&key, Some(&etag), &done).await?;
        Ok(())
    }

    /// Applies what the rules ask of one key's versions.
    async fn apply(
        &self,
        bucket: &str,
        rules: &[Rule],
        versions: &[ObjectInfo],
    ) -> Result<(), StoreError> {
        let Some(first) = versions.first() else {
            return Ok(());
        };
        for action in judge(rules, versions, now_ns(), self.settings.day) {
            let (expect, counter) = match action {
                Action::ExpireCurrent {
                    version,
                    mod_time_ns,
                } => (
                    Unchanged::Current {
                        version,
                        mod_time_ns,
                    },
                    &COUNTERS.expired,
                ),
                Action::ExpireNoncurrent { version } => {
                    (Unchanged::Version { version }, &COUNTERS.noncurrent_expired)
                }
                Action::RemoveMarker { version } => (
                    Unchanged::SoleDeleteMarker { version },
                    &COUNTERS.delete_markers_removed,
                ),
            };
            match self
                .store
                .expire_if_unchanged(bucket, &first.key, expect)
                .await
            {
                Ok(Some(_)) => {
                    counter.fetch_add(1, Ordering::Relaxed);
                }
                Ok(None) => {}
                // Object lock keeps the version (a retention not ended, a
                // legal hold): left for a later pass.
                Err(StoreError::ObjectLocked(_)) => {
                    COUNTERS.locked_kept.fetch_add(1, Ordering::Relaxed);
                }
                // Deleted with its bucket meanwhile.
                Err(StoreError::NoSuchBucket(_)) => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }
}

/// Keeps a pass under its rate.
struct Pacer {
    rate: u64,
    start: Instant,
    done: u64,
}

impl Pacer {
    fn new(rate: u64) -> Self {
        Pacer {
            rate,
            start: Instant::now(),
            done: 0,
        }
    }

    async fn wait(&mut self, n: u64) {
        self.done += n;
        if self.rate == 0 {
            return;
        }
        let due = Duration::from_secs_f64(self.done as f64 / self.rate as f64);
        if let Some(rest) = due.checked_sub(self.start.elapsed()) {
            tokio::time::sleep(rest).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version(key: &str, id: &str, modified_s: u64, marker: bool) -> ObjectInfo {
        ObjectInfo {
            bucket: "b".into(),
            key: key.into(),
            version_id: Some(id.into()),
            is_latest: false,
            delete_marker: marker,
            size: if marker { 0 } else { 10 },
            etag: String::new(),
            last_modified_ns: modified_s * 1_000_000_000,
            content_type: String::new(),
            headers: Vec::new(),
            user_metadata: Vec::new(),
            tags: Vec::new(),
            checksum: None,
            parts: Vec::new(),
            lock: None,
        }
    }

    const DAY: Duration = Duration::from_secs(10);

    #[test]
    fn expiry_is_due_at_the_next_day_boundary() {
        assert_eq!(due_ns(0, 1, DAY), 10_000_000_000);
        assert_eq!(due_ns(1_000_000_000, 1, DAY), 20_000_000_000);
        assert_eq!(due_ns(10_000_000_000, 2, DAY), 30_000_000_000);
    }

    #[test]
    fn noncurrent_versions_keep_the_newest_and_count_from_their_successor() {
        let rule = Rule {
            id: "r".into(),
            enabled: true,
            noncurrent_days: Some(1),
            newer_noncurrent: Some(1),
            ..Default::default()
        };
        // Current at 100 s, noncurrent since 100, 50, 40.
        let vs = [
            version("k", "v4", 100, false),
            version("k", "v3", 50, false),
            version("k", "v2", 40, false),
            version("k", "v1", 1, false),
        ];
        let s = 1_000_000_000;
        // At 100 s: v2 has been noncurrent since 50 s (due at 60 s); v3 is
        // kept as the one newer noncurrent version; v1 since 40 s.
        assert_eq!(
            judge(std::slice::from_ref(&rule), &vs, 100 * s, DAY),
            vec![
                Action::ExpireNoncurrent {
                    version: "v2".into()
                },
                Action::ExpireNoncurrent {
                    version: "v1".into()
                },
            ]
        );
        // At 55 s nothing is due yet for v2 (due at 60 s); v1 (since 40 s,
        // due at 50 s) is.
        assert_eq!(
            judge(std::slice::from_ref(&rule), &vs, 55 * s, DAY),
            vec![Action::ExpireNoncurrent {
                version: "v1".into()
            }]
        );
    }

    #[test]
    fn filters_take_what_they_name() {
        let mut rule = Rule {
            id: "r".into(),
            enabled: true,
            prefix: "ckpt/".into(),
            tags: vec![("keep".into(), "no".into())],
            size_gt: Some(5),
            days: Some(1),
            ..Default::default()
        };
        let mut v = version("ckpt/a", "v", 0, false);
        assert!(!rule.takes(&v));
        v.tags.push(("keep".into(), "no".into()));
        assert!(rule.takes(&v));
        v.size = 5;
        assert!(!rule.takes(&v));
        v.size = 6;
        v.key = "other/a".into();
        assert!(!rule.takes(&v));
        rule.enabled = false;
        v.key = "ckpt/a".into();
        assert!(!rule.takes(&v));
        // Delete markers: never by tag or size.
        rule.enabled = true;
        assert!(!rule.takes(&version("ckpt/a", "m", 0, true)));
    }

    #[test]
    fn a_lone_delete_marker_goes_only_when_asked() {
        let rule = Rule {
            id: "r".into(),
            enabled: true,
            expired_delete_marker: true,
            ..Default::default()
        };
        let alone = [version("k", "m", 0, true)];
        assert_eq!(
            judge(std::slice::from_ref(&rule), &alone, 1, DAY),
            vec![Action::RemoveMarker {
                version: "m".into()
            }]
        );
        let with_older = [version("k", "m", 5, true), version("k", "v", 0, false)];
        assert!(judge(std::slice::from_ref(&rule), &with_older, 1, DAY).is_empty());
    }
}
