//! Checks on a request's SigV4 credential scope that s3s does not make: the
//! region a request was signed for must be this server's (AWS answers a wrong
//! one with the right region, so clients that guessed, such as s3cmd with its
//! legacy "US", retry correctly), and a presigned URL may not live longer
//! than a week, SigV2's (whose `Expires` is an instant) included. Made on
//! the request head, before the body is read.

/// The longest a presigned URL may be valid, as in AWS.
pub const PRESIGNED_EXPIRES_MAX_SECS: u64 = 604_800;
/// How far ahead of this server's clock a client's may run: a SigV2 URL
/// presigned for a week by such a client is still taken.
pub const CLOCK_SKEW_MAX_SECS: u64 = 900;

/// A refusal in AWS's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeError {
    pub code: &'static str,
    pub message: String,
    /// The region to use instead, for a `<Region>` element and the
    /// `x-amz-bucket-region` header.
    pub region: Option<String>,
}

/// Checks the credential scope of a SigV4 request (header or presigned) and
/// the expiry of a presigned one, SigV2's included (`now`: seconds since
/// the epoch). Anonymous requests pass: s3s decides about them.
pub fn check(
    headers: &http::HeaderMap,
    query: Option<&str>,
    region: &str,
    now: u64,
) -> Result<(), ScopeError> {
    // A SigV2 presigned URL (SigV4's signature is X-Amz-Signature) names
    // the instant it expires: at most a week ahead, as SigV4's may live.
    // s3s takes a URL with `Signature` for SigV2 even beside a SigV4 header.
    if let Some(q) = query {
        let mut v2 = false;
        let mut expires = None;
        for pair in q.split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            match k {
                "Signature" => v2 = true,
                "Expires" => expires = Some(v),
                _ => {}
            }
        }
        if v2 {
            let Some(at) = expires.and_then(|e| e.parse::<u64>().ok()) else {
                return Err(ScopeError {
                    code: "AuthorizationQueryParametersError",
                    message: "Query-string authentication requires the Signature, Expires and AWSAccessKeyId parameters".into(),
                    region: None,
                });
            };
            if at > now + PRESIGNED_EXPIRES_MAX_SECS + CLOCK_SKEW_MAX_SECS {
                return Err(ScopeError {
                    code: "AuthorizationQueryParametersError",
                    message: format!(
                        "Expires must be at most a week ({PRESIGNED_EXPIRES_MAX_SECS} seconds) ahead"
                    ),
                    region: None,
                });
            }
        }
    }
    if let Some(auth) = headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    {
        if let Some(rest) = auth.strip_prefix("AWS4-HMAC-SHA256") {
            if let Some(scope_region) = credential_region(rest) {
                check_region(
                    "AuthorizationHeaderMalformed",
                    "The authorization header is malformed",
                    scope_region,
                    region,
                )?;
            }
        }
        return Ok(());
    }
    let Some(query) = query else { return Ok(()) };
    let mut credential = None;
    let mut expires = None;
    for pair in query.split('&') {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        match k {
            "X-Amz-Credential" => credential = Some(percent_decode(v)),
            "X-Amz-Expires" => expires = Some(v),
            _ => {}
        }
    }
    let Some(credential) = credential else {
        return Ok(());
    };
    if let Some(scope_region) = credential.split('/').nth(2) {
        check_region(
            "AuthorizationQueryParametersError",
            "Error parsing the X-Amz-Credential parameter",
            scope_region,
            region,
        )?;
    }
    if let Some(secs) = expires.and_then(|e| e.parse::<u64>().ok()) {
        if secs > PRESIGNED_EXPIRES_MAX_SECS {
            return Err(ScopeError {
                code: "AuthorizationQueryParametersError",
                message: format!(
                    "X-Amz-Expires must be less than a week (in seconds) that is {PRESIGNED_EXPIRES_MAX_SECS}"
                ),
                region: None,
            });
        }
    }
    Ok(())
}

/// A scope signed for another region, refused in AWS's words with the right
/// one named.
fn check_region(
    code: &'static str,
    what: &str,
    scope_region: &str,
    region: &str,
) -> Result<(), ScopeError> {
    if scope_region == region {
        return Ok(());
    }
    Err(ScopeError {
        code,
        message: format!("{what}; the region '{scope_region}' is wrong; expecting '{region}'"),
        region: Some(region.to_string()),
    })
}

/// The region of `Credential=AK/DATE/REGION/SERVICE/aws4_request` in the
/// parameters of an Authorization header.
fn credential_region(params: &str) -> Option<&str> {
    let start = params.find("Credential=")? + "Credential=".len();
    let value = params[start..].split([',', ' ']).next()?;
    value.split('/').nth(2)
}

fn percent_decode(s: &str) -> String {
    urlencoding::decode(s)
        .map(|c| c.into_owned())
        .unwrap_or_else(|_| s.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_795_000_000;

    fn auth(region: &str) -> http::HeaderMap {
        let mut h = http::HeaderMap::new();
        let v = format!("AWS4-HMAC-SHA256 Credential=AK/20261123/{region}/s3/aws4_request, SignedHeaders=host, Signature=00");
        h.insert(http::header::AUTHORIZATION, v.parse().unwrap());
        h
    }

    #[test]
    fn header_scope_region() {
        assert!(check(&auth("us-east-1"), None, "us-east-1", NOW).is_ok());
        let e = check(&auth("US"), None, "us-east-1", NOW).unwrap_err();
        assert_eq!(e.code, "AuthorizationHeaderMalformed");
        assert!(e.message.contains("'US' is wrong; expecting 'us-east-1'"));
        assert_eq!(e.region.as_deref(), Some("us-east-1"));
        // SigV2 headers and anonymous requests are not ours to judge here.
        let mut h = http::HeaderMap::new();
        h.insert(http::header::AUTHORIZATION, "AWS AK:sig".parse().unwrap());
        assert!(check(&h, None, "us-east-1", NOW).is_ok());
        assert!(check(
            &http::HeaderMap::new(),
            Some("list-type=2"),
            "us-east-1",
            NOW
        )
        .is_ok());
    }

    #[test]
    fn sigv2_presigned_urls_live_at_most_a_week() {
        let q = |at: u64| format!("AWSAccessKeyId=AK&Expires={at}&Signature=abc");
        let h = http::HeaderMap::new();
        let week = NOW + PRESIGNED_EXPIRES_MAX_SECS;
        assert!(check(&h, Some(&q(week)), "us-east-1", NOW).is_ok());
        assert!(check(&h, Some(&q(week + CLOCK_SKEW_MAX_SECS)), "us-east-1", NOW).is_ok());
        for bad in [
            q(week + CLOCK_SKEW_MAX_SECS + 1),
            q(7_258_118_400), // 2200-01-01
            "AWSAccessKeyId=AK&Signature=abc".to_string(),
            "AWSAccessKeyId=AK&Expires=soon&Signature=abc".to_string(),
        ] {
            let e = check(&h, Some(&bad), "us-east-1", NOW).unwrap_err();
            assert_eq!(e.code, "AuthorizationQueryParametersError", "{bad}");
        }
    }

    #[test]
    fn presigned_scope_and_expiry() {
        let q = |region: &str, expires: u64| {
            format!("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AK%2F20261123%2F{region}%2Fs3%2Faws4_request&X-Amz-Expires={expires}&X-Amz-Signature=00")
        };
        let h = http::HeaderMap::new();
        assert!(check(&h, Some(&q("us-east-1", 604_800)), "us-east-1", NOW).is_ok());
        let e = check(&h, Some(&q("us-east-1", 604_801)), "us-east-1", NOW).unwrap_err();
        assert_eq!(e.code, "AuthorizationQueryParametersError");
        assert!(e.message.contains("604800"));
        let e = check(&h, Some(&q("eu-west-1", 60)), "us-east-1", NOW).unwrap_err();
        assert_eq!(e.code, "AuthorizationQueryParametersError");
        assert_eq!(e.region.as_deref(), Some("us-east-1"));
    }
}
