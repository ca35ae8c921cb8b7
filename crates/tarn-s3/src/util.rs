//! Small conversions between S3 wire values and engine values.

use std::time::{Duration, UNIX_EPOCH};

use s3s::dto::{ETag, Timestamp};
use s3s::{S3Error, S3ErrorCode, S3Result};

pub fn timestamp(ns: u64) -> Timestamp {
    Timestamp::from(UNIX_EPOCH + Duration::from_nanos(ns))
}

/// Seconds precision, as HTTP dates compare.
pub fn timestamp_secs(t: &Timestamp) -> i64 {
    time::OffsetDateTime::from(t.clone()).unix_timestamp()
}

pub fn etag(s: &str) -> ETag {
    ETag::Strong(s.to_string())
}

/// Limits S3 puts on tags.
pub const TAGS_MAX: usize = 10;
pub const TAG_KEY_MAX_CHARS: usize = 128;
pub const TAG_VALUE_MAX_CHARS: usize = 256;

/// Most tags a bucket may have.
pub const BUCKET_TAGS_MAX: usize = 50;

pub fn check_tags(tags: &[(String, String)]) -> S3Result<()> {
    if tags.len() > TAGS_MAX {
        return Err(S3Error::with_message(
            S3ErrorCode::InvalidTag,
            "Object tags cannot be greater than 10",
        ));
    }
    check_tag_items(tags)
}

pub fn check_bucket_tags(tags: &[(String, String)]) -> S3Result<()> {
    if tags.len() > BUCKET_TAGS_MAX {
        return Err(S3Error::with_message(
            S3ErrorCode::InvalidTag,
            "Bucket tags cannot be greater than 50",
        ));
    }
    if tags.iter().any(|(k, _)| k.starts_with("aws:")) {
        return Err(S3Error::with_message(
            S3ErrorCode::InvalidTag,
            "System tags (aws:*) cannot be set",
        ));
    }
    check_tag_items(tags)
}

/// The (key, value) pairs of a TagSet (a missing key or value is empty,
/// which the checks refuse or keep as S3 does).
pub fn tag_pairs(set: Vec<s3s::dto::Tag>) -> Vec<(String, String)> {
    set.into_iter()
        .map(|t| (t.key.unwrap_or_default(), t.value.unwrap_or_default()))
        .collect()
}

/// Each key non-empty and unique, keys and values within S3's lengths.
pub fn check_tag_items(tags: &[(String, String)]) -> S3Result<()> {
    for (i, (k, v)) in tags.iter().enumerate() {
        if k.is_empty()
            || k.chars().count() > TAG_KEY_MAX_CHARS
            || v.chars().count() > TAG_VALUE_MAX_CHARS
        {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidTag,
                "The tag key or value is not valid",
            ));
        }
        if tags[..i].iter().any(|(k2, _)| k2 == k) {
            return Err(S3Error::with_message(
                S3ErrorCode::InvalidTag,
                "Cannot provide multiple Tags with the same key",
            ));
        }
    }
    Ok(())
}

/// Parses the x-amz-tagging header: URL-encoded `k=v&k2=v2`.
pub fn parse_tagging_header(h: Option<&String>) -> S3Result<Vec<(String, String)>> {
    let Some(h) = h else { return Ok(Vec::new()) };
    let bad =
        || S3Error::with_message(S3ErrorCode::InvalidArgument, "invalid x-amz-tagging header");
    let mut out = Vec::new();
    for pair in h.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let k = urlencoding::decode(&k.replace('+', " "))
            .map_err(|_| bad())?
            .into_owned();
        let v = urlencoding::decode(&v.replace('+', " "))
            .map_err(|_| bad())?
            .into_owned();
        out.push((k, v));
    }
    check_tags(&out)?;
    Ok(out)
}

/// Continuation tokens are the hex of the resume key: opaque to clients, and a
/// token that is not valid hex of UTF-8 is rejected instead of misread.
pub fn encode_token(key: &str) -> String {
    key.bytes().map(|b| format!("{b:02x}")).collect()
}

pub fn decode_token(t: &str) -> S3Result<String> {
    let bad = || {
        S3Error::with_message(
            S3ErrorCode::InvalidArgument,
            "The continuation token provided is incorrect",
        )
    };
    if !t.len().is_multiple_of(2) {
        return Err(bad());
    }
    let bytes: Result<Vec<u8>, _> = (0..t.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(t.get(i..i + 2).unwrap_or("x"), 16))
        .collect();
    String::from_utf8(bytes.map_err(|_| bad())?).map_err(|_| bad())
}

pub fn max_keys(v: Option<i32>) -> S3Result<usize> {
    match v {
        None => Ok(1000),
        Some(n) if n < 0 => Err(S3Error::with_message(
            S3ErrorCode::InvalidArgument,
            "max-keys must be non-negative",
        )),
        Some(n) => Ok((n as usize).min(1000)),
    }
}

/// System headers the engine keeps verbatim and returns on GET/HEAD.
pub const STORED_HEADERS: [&str; 5] = [
    "cache-control",
    "content-disposition",
    "content-encoding",
    "content-language",
    "expires",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_roundtrip_and_reject_garbage() {
        assert_eq!(decode_token(&encode_token("a/b ü")).unwrap(), "a/b ü");
        assert!(decode_token("zz").is_err());
        assert!(decode_token("abc").is_err());
        assert!(decode_token("ff").is_err(), "not UTF-8");
    }

    #[test]
    fn tagging_header() {
        let t = parse_tagging_header(Some(&"a=1&b=x%20y&c=".to_string())).unwrap();
        assert_eq!(
            t,
            vec![
                ("a".into(), "1".into()),
                ("b".into(), "x y".into()),
                ("c".into(), "".into())
            ]
        );
        assert!(parse_tagging_header(Some(&"a=1&a=2".to_string())).is_err());
        let many = (0..11)
            .map(|i| format!("k{i}=v"))
            .collect::<Vec<_>>()
            .join("&");
        assert!(parse_tagging_header(Some(&many)).is_err());
    }
}
