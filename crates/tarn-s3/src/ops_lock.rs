//! Object lock (write once, read many): a bucket made with object lock
//! keeps its versioning on for good, and each version may carry a retention
//! (GOVERNANCE or COMPLIANCE, until a date) and a legal hold. The engine
//! refuses every removal of a locked version (`StoreError::ObjectLocked`),
//! whoever asks, root included; this module reads what requests ask for,
//! the bucket's default retention, and serves
//! Get/PutObjectLockConfiguration, Get/PutObjectRetention and
//! Get/PutObjectLegalHold.

use std::time::{SystemTime, UNIX_EPOCH};

use s3s::dto::*;
use s3s::{S3Error, S3ErrorCode, S3Request, S3Response, S3Result};
use serde::{Deserialize, Serialize};
use tarn_store::format::{LockMode, ObjectLock, Retention};
use tarn_store::ObjectInfo;

use crate::access::{permit_of, Permit};
use crate::error::s3_error;
use crate::ops::TarnS3;
use crate::util::timestamp;

const DAY_NS: u64 = 86_400 * 1_000_000_000;
/// A year of default retention: 365 days.
const YEAR_DAYS: u64 = 365;
/// The longest default retention a bucket may have (AWS's bound).
const YEARS_MAX: i32 = 100;

/// A bucket's default retention (PutObjectLockConfiguration's rule): new
/// versions that ask for no retention are kept this long from their
/// creation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DefaultRetention {
    /// GOVERNANCE or COMPLIANCE.
    pub mode: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub days: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub years: Option<u32>,
}

impl DefaultRetention {
    fn retention(&self, now_ns: u64) -> Option<Retention> {
        let days = match (self.days, self.years) {
            (Some(d), None) => u64::from(d),
            (None, Some(y)) => u64::from(y) * YEAR_DAYS,
            _ => return None,
        };
        Some(Retention {
            mode: LockMode::parse(&self.mode)?,
            until_ns: now_ns.saturating_add(days.saturating_mul(DAY_NS)),
        })
    }
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn invalid(code: S3ErrorCode, msg: &str) -> S3Error {
    S3Error::with_message(code, msg.to_string())
}

fn header<'a>(headers: &'a http::HeaderMap, name: &str) -> S3Result<Option<&'a str>> {
    headers
        .get(name)
        .map(|v| {
            v.to_str()
                .map_err(|_| invalid(S3ErrorCode::InvalidArgument, "a header is not ASCII"))
        })
        .transpose()
}

fn mode_of(s: &str) -> S3Result<LockMode> {
    LockMode::parse(s).ok_or_else(|| {
        invalid(
            S3ErrorCode::InvalidArgument,
            "Unknown wormMode directive: the object lock mode is GOVERNANCE or COMPLIANCE.",
        )
    })
}

/// A retain-until date, which must lie ahead.
fn until_of(t: time::OffsetDateTime, now_ns: u64) -> S3Result<u64> {
    let ns = t.unix_timestamp_nanos();
    if ns <= i128::from(now_ns) {
        return Err(invalid(
            S3ErrorCode::InvalidArgument,
            "The retain until date must be in the future!",
        ));
    }
    u64::try_from(ns).map_err(|_| {
        invalid(
            S3ErrorCode::InvalidArgument,
            "The retain until date is out of range (the latest is in 2554).",
        )
    })
}

/// The object lock a write asks for in its headers
/// (`x-amz-object-lock-mode`, `-retain-until-date`, `-legal-hold`).
pub(crate) fn requested_lock(headers: &http::HeaderMap) -> S3Result<Option<ObjectLock>> {
    let mode = header(headers, "x-amz-object-lock-mode")?;
    let until = header(headers, "x-amz-object-lock-retain-until-date")?;
    let hold = header(headers, "x-amz-object-lock-legal-hold")?;
    let retention = match (mode, until) {
        (None, None) => None,
        (Some(m), Some(u)) => {
            let t = time::OffsetDateTime::parse(u, &time::format_description::well_known::Rfc3339)
                .map_err(|_| {
                    invalid(
                        S3ErrorCode::InvalidArgument,
                        "The retain until date must be an ISO 8601 date and time.",
                    )
                })?;
            Some(Retention {
                mode: mode_of(m)?,
                until_ns: until_of(t, now_ns())?,
            })
        }
        _ => return Err(invalid(
            S3ErrorCode::InvalidArgument,
            "x-amz-object-lock-retain-until-date and x-amz-object-lock-mode must both be supplied",
        )),
    };
    let legal_hold = match hold {
        None => None,
        Some("ON") => Some(true),
        Some("OFF") => Some(false),
        Some(_) => {
            return Err(invalid(
                S3ErrorCode::InvalidArgument,
                "Legal Hold must be either of 'ON' or 'OFF'",
            ))
        }
    };
    if retention.is_none() && legal_hold.is_none() {
        return Ok(None);
    }
    Ok(Some(ObjectLock {
        retention,
        legal_hold: legal_hold.unwrap_or(false),
    }))
}

/// A PUT that locks its version must prove its body's integrity
/// (Content-MD5 or a checksum), as AWS requires.
fn check_integrity(headers: &http::HeaderMap) -> S3Result<()> {
    let has = |n: &str| headers.contains_key(n);
    let signed_hash = headers
        .get("x-amz-content-sha256")
        .is_some_and(|v| v.len() == 64 && v.as_bytes().iter().all(u8::is_ascii_hexdigit));
    let checksum = headers
        .keys()
        .any(|k| k.as_str().starts_with("x-amz-checksum-"));
    if has("content-md5")
        || has("x-amz-sdk-checksum-algorithm")
        || has("x-amz-trailer")
        || checksum
        || signed_hash
    {
        return Ok(());
    }
    Err(invalid(
        S3ErrorCode::InvalidRequest,
        "Content-MD5 OR x-amz-checksum- HTTP header is required for Put Object requests with Object Lock parameters",
    ))
}

impl TarnS3 {
    /// The lock of a new version of `bucket`: what the request asks, else
    /// the bucket's default retention from now. A request for a lock in a
    /// bucket without object lock is refused. `put`: a PutObject (its body
    /// must then carry a checksum).
    pub(crate) fn lock_for_write(
        &self,
        ext: &http::Extensions,
        headers: &http::HeaderMap,
        bucket: &str,
        put: bool,
    ) -> S3Result<Option<ObjectLock>> {
        let asked = requested_lock(headers)?;
        let enabled = self
            .store
            .head_bucket(bucket)
            .map_err(s3_error)?
            .object_lock;
        if !enabled {
            if asked.is_some() {
                return Err(invalid(
                    S3ErrorCode::InvalidRequest,
                    "Bucket is missing Object Lock Configuration",
                ));
            }
            return Ok(None);
        }
        let mut lock = asked.unwrap_or_default();
        if lock.retention.is_none() {
            let b = self.bucket_access(ext, bucket)?;
            lock.retention = b
                .doc
                .lock_default
                .as_ref()
                .and_then(|d| d.retention(now_ns()));
        }
        if lock.is_empty() {
            return Ok(None);
        }
        if put {
            check_integrity(headers)?;
        }
        Ok(Some(lock))
    }

    pub(crate) async fn op_get_object_lock_configuration(
        &self,
        req: S3Request<GetObjectLockConfigurationInput>,
    ) -> S3Result<S3Response<GetObjectLockConfigurationOutput>> {
        let bucket = &req.input.bucket;
        if !self
            .store
            .head_bucket(bucket)
            .map_err(s3_error)?
            .object_lock
        {
            return Err(invalid(
                S3ErrorCode::ObjectLockConfigurationNotFoundError,
                "Object Lock configuration does not exist for this bucket",
            ));
        }
        let b = self.bucket_access(&req.extensions, bucket)?;
        let rule = b.doc.lock_default.as_ref().map(|d| ObjectLockRule {
            default_retention: Some(s3s::dto::DefaultRetention {
                mode: Some(ObjectLockRetentionMode::from(d.mode.clone())),
                days: d.days.map(|v| v as i32),
                years: d.years.map(|v| v as i32),
            }),
        });
        Ok(S3Response::new(GetObjectLockConfigurationOutput {
            object_lock_configuration: Some(ObjectLockConfiguration {
                object_lock_enabled: Some(ObjectLockEnabled::from_static(
                    ObjectLockEnabled::ENABLED,
                )),
                rule,
            }),
        }))
    }

    /// Enables object lock on a bucket (its versioning must be on; it
    /// cannot be turned off again) and sets or clears its default retention.
    pub(crate) async fn op_put_object_lock_configuration(
        &self,
        req: S3Request<PutObjectLockConfigurationInput>,
    ) -> S3Result<S3Response<PutObjectLockConfigurationOutput>> {
        let i = req.input;
        let Some(c) = i.object_lock_configuration else {
            return Err(invalid(
                S3ErrorCode::MalformedXML,
                "The request needs an ObjectLockConfiguration.",
            ));
        };
        if c.object_lock_enabled.as_ref().map(|e| e.as_str()) != Some(ObjectLockEnabled::ENABLED) {
            return Err(invalid(
                S3ErrorCode::MalformedXML,
                "ObjectLockEnabled must be Enabled: object lock cannot be disabled.",
            ));
        }
        let default = match c.rule {
            None => None,
            Some(rule) => Some(default_of(rule.default_retention)?),
        };
        self.store
            .enable_object_lock(&i.bucket)
            .await
            .map_err(s3_error)?;
        self.access
            .update(&i.bucket, |d| {
                d.lock_default = default;
                Ok(())
            })
            .await?;
        Ok(S3Response::new(PutObjectLockConfigurationOutput::default()))
    }

    pub(crate) async fn op_get_object_retention(
        &self,
        req: S3Request<GetObjectRetentionInput>,
    ) -> S3Result<S3Response<GetObjectRetentionOutput>> {
        let i = &req.input;
        let lock = self
            .version_lock(&i.bucket, &i.key, i.version_id.as_deref())
            .await?;
        let Some(r) = lock.and_then(|l| l.retention) else {
            return Err(no_lock());
        };
        Ok(S3Response::new(GetObjectRetentionOutput {
            retention: Some(ObjectLockRetention {
                mode: Some(ObjectLockRetentionMode::from(r.mode.as_str().to_string())),
                retain_until_date: Some(timestamp(r.until_ns)),
            }),
        }))
    }

    pub(crate) async fn op_put_object_retention(
        &self,
        req: S3Request<PutObjectRetentionInput>,
    ) -> S3Result<S3Response<PutObjectRetentionOutput>> {
        let bypass = permit_of(&req.extensions).is_some_and(|p| p.bypass_governance);
        let i = req.input;
        let retention =
            match i.retention {
                None
                | Some(ObjectLockRetention {
                    mode: None,
                    retain_until_date: None,
                }) => None,
                Some(ObjectLockRetention {
                    mode: Some(m),
                    retain_until_date: Some(t),
                }) => Some(Retention {
                    mode: mode_of(m.as_str()).map_err(|_| {
                        invalid(
                            S3ErrorCode::MalformedXML,
                            "The retention mode is GOVERNANCE or COMPLIANCE.",
                        )
                    })?,
                    until_ns: until_of(time::OffsetDateTime::from(t), now_ns())?,
                }),
                Some(_) => return Err(invalid(
                    S3ErrorCode::MalformedXML,
                    "A retention needs both Mode and RetainUntilDate (or neither, to remove it).",
                )),
            };
        self.store
            .set_object_retention(
                &i.bucket,
                &i.key,
                i.version_id.as_deref(),
                retention,
                bypass,
            )
            .await
            .map_err(s3_error)?;
        Ok(S3Response::new(PutObjectRetentionOutput::default()))
    }

    pub(crate) async fn op_get_object_legal_hold(
        &self,
        req: S3Request<GetObjectLegalHoldInput>,
    ) -> S3Result<S3Response<GetObjectLegalHoldOutput>> {
        let i = &req.input;
        let lock = self
            .version_lock(&i.bucket, &i.key, i.version_id.as_deref())
            .await?
            .ok_or_else(no_lock)?;
        Ok(S3Response::new(GetObjectLegalHoldOutput {
            legal_hold: Some(ObjectLockLegalHold {
                status: Some(hold_status(lock.legal_hold)),
            }),
        }))
    }

    pub(crate) async fn op_put_object_legal_hold(
        &self,
        req: S3Request<PutObjectLegalHoldInput>,
    ) -> S3Result<S3Response<PutObjectLegalHoldOutput>> {
        let i = req.input;
        let on = match i
            .legal_hold
            .and_then(|h| h.status)
            .as_ref()
            .map(|s| s.as_str())
        {
            Some(ObjectLockLegalHoldStatus::ON) => true,
            Some(ObjectLockLegalHoldStatus::OFF) => false,
            _ => {
                return Err(invalid(
                    S3ErrorCode::MalformedXML,
                    "The legal hold's Status is ON or OFF.",
                ))
            }
        };
        self.store
            .set_object_legal_hold(&i.bucket, &i.key, i.version_id.as_deref(), on)
            .await
            .map_err(s3_error)?;
        Ok(S3Response::new(PutObjectLegalHoldOutput::default()))
    }

    /// The lock of one version; refused in a bucket without object lock.
    async fn version_lock(
        &self,
        bucket: &str,
        key: &str,
        version: Option<&str>,
    ) -> S3Result<Option<ObjectLock>> {
        if !self
            .store
            .head_bucket(bucket)
            .map_err(s3_error)?
            .object_lock
        {
            return Err(invalid(
                S3ErrorCode::InvalidRequest,
                "Bucket is missing Object Lock Configuration",
            ));
        }
        let info = self
            .store
            .head_object(bucket, key, version)
            .await
            .map_err(s3_error)?;
        Ok(info.lock)
    }
}

/// The lock headers of a GET or HEAD answer, as far as the caller may see
/// them (s3:GetObjectRetention, s3:GetObjectLegalHold).
pub(crate) fn lock_fields(
    permit: Option<&Permit>,
    info: &ObjectInfo,
) -> (
    Option<ObjectLockMode>,
    Option<Timestamp>,
    Option<ObjectLockLegalHoldStatus>,
) {
    let (retention, hold) = permit.map_or((false, false), |p| p.sees_lock);
    let Some(lock) = info.lock else {
        return (None, None, None);
    };
    let r = lock.retention.filter(|_| retention);
    (
        r.map(|r| ObjectLockMode::from(r.mode.as_str().to_string())),
        r.map(|r| timestamp(r.until_ns)),
        hold.then(|| hold_status(lock.legal_hold)),
    )
}

fn hold_status(on: bool) -> ObjectLockLegalHoldStatus {
    ObjectLockLegalHoldStatus::from_static(if on {
        ObjectLockLegalHoldStatus::ON
    } else {
        ObjectLockLegalHoldStatus::OFF
    })
}

fn no_lock() -> S3Error {
    invalid(
        S3ErrorCode::NoSuchObjectLockConfiguration,
        "The specified object does not have a ObjectLock configuration",
    )
}

/// A bucket's default retention as PutObjectLockConfiguration sends it:
/// a mode and exactly one of Days or Years, positive.
fn default_of(d: Option<s3s::dto::DefaultRetention>) -> S3Result<DefaultRetention> {
    let malformed = |m: &str| invalid(S3ErrorCode::MalformedXML, m);
    let Some(d) = d else {
        return Err(malformed("The rule needs a DefaultRetention."));
    };
    let mode = d
        .mode
        .ok_or_else(|| malformed("DefaultRetention needs a Mode."))?;
    mode_of(mode.as_str()).map_err(|_| malformed("The Mode is GOVERNANCE or COMPLIANCE."))?;
    let positive = |v: i32, max: i32| {
        if v <= 0 || v > max {
            Err(invalid(
                S3ErrorCode::InvalidArgument,
                "Default retention period must be a positive integer value (at most 100 years).",
            ))
        } else {
            Ok(v as u32)
        }
    };
    let (days, years) = match (d.days, d.years) {
        (Some(days), None) => (Some(positive(days, YEARS_MAX * YEAR_DAYS as i32)?), None),
        (None, Some(years)) => (None, Some(positive(years, YEARS_MAX)?)),
        _ => {
            return Err(malformed(
                "DefaultRetention needs exactly one of Days or Years.",
            ))
        }
    };
    Ok(DefaultRetention {
        mode: mode.as_str().to_string(),
        days,
        years,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requested_lock_reads_the_headers() {
        let mut h = http::HeaderMap::new();
        assert_eq!(requested_lock(&h).unwrap(), None);
        h.insert("x-amz-object-lock-legal-hold", "ON".parse().unwrap());
        assert_eq!(
            requested_lock(&h).unwrap(),
            Some(ObjectLock {
                retention: None,
                legal_hold: true
            })
        );
        h.insert("x-amz-object-lock-mode", "COMPLIANCE".parse().unwrap());
        assert!(requested_lock(&h).is_err(), "a mode without a date");
        h.insert(
            "x-amz-object-lock-retain-until-date",
            "2999-01-01T00:00:00Z".parse().unwrap(),
        );
        assert!(requested_lock(&h).is_err(), "a date past 2554");
        h.insert(
            "x-amz-object-lock-retain-until-date",
            "2500-01-01T00:00:00Z".parse().unwrap(),
        );
        let l = requested_lock(&h).unwrap().unwrap();
        assert_eq!(l.retention.unwrap().mode, LockMode::Compliance);
        h.insert(
            "x-amz-object-lock-retain-until-date",
            "2001-01-01T00:00:00Z".parse().unwrap(),
        );
        assert!(requested_lock(&h).is_err(), "a date past");
        h.insert(
            "x-amz-object-lock-retain-until-date",
            "2500-01-01T00:00:00Z".parse().unwrap(),
        );
        h.insert("x-amz-object-lock-mode", "FOREVER".parse().unwrap());
        assert!(requested_lock(&h).is_err(), "an unknown mode");
    }

    #[test]
    fn default_retention_counts_days_or_years() {
        let d = DefaultRetention {
            mode: "GOVERNANCE".into(),
            days: Some(2),
            years: None,
        };
        assert_eq!(d.retention(5).unwrap().until_ns, 5 + 2 * DAY_NS);
        let y = DefaultRetention {
            mode: "COMPLIANCE".into(),
            days: None,
            years: Some(1),
        };
        assert_eq!(y.retention(0).unwrap().until_ns, 365 * DAY_NS);
        let rule = |days, years| {
            default_of(Some(s3s::dto::DefaultRetention {
                mode: Some(ObjectLockRetentionMode::from_static("GOVERNANCE")),
                days,
                years,
            }))
        };
        assert!(rule(Some(1), None).is_ok());
        assert!(rule(Some(1), Some(1)).is_err());
        assert!(rule(None, None).is_err());
        assert!(rule(Some(0), None).is_err());
        assert!(rule(None, Some(101)).is_err());
    }
}
