//! CORS: a bucket's rules for browser requests from other origins
//! (Get/Put/DeleteBucketCors), the OPTIONS preflight the server front
//! answers without credentials, and the `Access-Control-*` headers on the
//! responses to requests from an allowed origin (docs/s3.md "CORS").

use s3s::dto;
use s3s::{S3Error, S3ErrorCode, S3Result};
use serde::{Deserialize, Serialize};

/// Most rules one configuration may hold (AWS's limit).
pub const RULES_MAX: usize = 100;
const METHODS: [&str; 5] = ["GET", "PUT", "POST", "DELETE", "HEAD"];

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cors {
    pub rules: Vec<CorsRule>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorsRule {
    pub id: Option<String>,
    pub origins: Vec<String>,
    pub methods: Vec<String>,
    #[serde(default)]
    pub headers: Vec<String>,
    #[serde(default)]
    pub expose: Vec<String>,
    pub max_age: Option<i32>,
}

fn bad(msg: impl Into<String>) -> S3Error {
    S3Error::with_message(S3ErrorCode::InvalidRequest, msg.into())
}

/// `pattern` with at most one `*`, matching any run of characters.
fn wildcard(pattern: &str, s: &str, fold_case: bool) -> bool {
    let (p, s) = if fold_case {
        (pattern.to_ascii_lowercase(), s.to_ascii_lowercase())
    } else {
        (pattern.to_string(), s.to_string())
    };
    match p.split_once('*') {
        None => p == s,
        Some((head, tail)) => {
            s.len() >= head.len() + tail.len() && s.starts_with(head) && s.ends_with(tail)
        }
    }
}

impl Cors {
    pub fn from_dto(c: &dto::CORSConfiguration) -> S3Result<Cors> {
        if c.cors_rules.is_empty() || c.cors_rules.len() > RULES_MAX {
            return Err(S3Error::with_message(
                S3ErrorCode::MalformedXML,
                "A CORS configuration holds 1 to 100 rules",
            ));
        }
        let mut rules = Vec::with_capacity(c.cors_rules.len());
        for r in &c.cors_rules {
            if r.allowed_origins.is_empty() || r.allowed_methods.is_empty() {
                return Err(S3Error::with_message(
                    S3ErrorCode::MalformedXML,
                    "Each CORSRule needs an AllowedOrigin and an AllowedMethod",
                ));
            }
            for m in &r.allowed_methods {
                if !METHODS.contains(&m.as_str()) {
                    return Err(bad(format!(
                        "Found unsupported HTTP method in CORS config. Unsupported method is {m}"
                    )));
                }
            }
            for o in &r.allowed_origins {
                if o.matches('*').count() > 1 {
                    return Err(bad(format!(
                        "AllowedOrigin \"{o}\" can not have more than one wildcard."
                    )));
                }
            }
            let headers = r.allowed_headers.clone().unwrap_or_default();
            for h in &headers {
                if h.matches('*').count() > 1 {
                    return Err(bad(format!(
                        "AllowedHeader \"{h}\" can not have more than one wildcard."
                    )));
                }
            }
            if r.id.as_ref().is_some_and(|id| id.chars().count() > 255) {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    "ID length should not exceed allowed limit of 255",
                ));
            }
            rules.push(CorsRule {
                id: r.id.clone(),
                origins: r.allowed_origins.clone(),
                methods: r.allowed_methods.clone(),
                headers,
                expose: r.expose_headers.clone().unwrap_or_default(),
                max_age: r.max_age_seconds,
            });
        }
        Ok(Cors { rules })
    }

    pub fn to_dto(&self) -> Vec<dto::CORSRule> {
        self.rules
            .iter()
            .map(|r| dto::CORSRule {
                id: r.id.clone(),
                allowed_origins: r.origins.clone(),
                allowed_methods: r.methods.clone(),
                allowed_headers: (!r.headers.is_empty()).then(|| r.headers.clone()),
                expose_headers: (!r.expose.is_empty()).then(|| r.expose.clone()),
                max_age_seconds: r.max_age,
            })
            .collect()
    }

    /// The first rule that allows `origin` to send `method` with these
    /// request headers (as S3 picks it).
    pub fn matching(&self, origin: &str, method: &str, headers: &[&str]) -> Option<&CorsRule> {
        self.rules.iter().find(|r| {
            r.origins.iter().any(|o| wildcard(o, origin, false))
                && r.methods.iter().any(|m| m == method)
                && headers
                    .iter()
                    .all(|h| r.headers.iter().any(|p| wildcard(p, h, true)))
        })
    }
}

impl CorsRule {
    /// The `Access-Control-*` headers for a request from `origin` this rule
    /// allows (`request_headers`: a preflight's, echoed back).
    pub fn headers_for(
        &self,
        origin: &str,
        request_headers: Option<&str>,
    ) -> Vec<(&'static str, String)> {
        let any = self.origins.iter().any(|o| o == "*");
        let mut out = vec![
            (
                "access-control-allow-origin",
                if any {
                    "*".to_string()
                } else {
                    origin.to_string()
                },
            ),
            ("access-control-allow-methods", self.methods.join(", ")),
        ];
        if !any {
            out.push(("access-control-allow-credentials", "true".into()));
        }
        if let Some(h) = request_headers.filter(|h| !h.trim().is_empty()) {
            out.push(("access-control-allow-headers", h.to_string()));
        }
        if !self.expose.is_empty() {
            out.push(("access-control-expose-headers", self.expose.join(", ")));
        }
        if let Some(a) = self.max_age {
            out.push(("access-control-max-age", a.to_string()));
        }
        out.push((
            "vary",
            "Origin, Access-Control-Request-Headers, Access-Control-Request-Method".into(),
        ));
        out
    }
}

/// A preflight's request headers, split (`Access-Control-Request-Headers`).
pub fn requested_headers(v: Option<&str>) -> Vec<&str> {
    v.map(|v| {
        v.split(',')
            .map(str::trim)
            .filter(|h| !h.is_empty())
            .collect()
    })
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cors() -> Cors {
        Cors {
            rules: vec![
                CorsRule {
                    id: None,
                    origins: vec!["https://*.example.com".into()],
                    methods: vec!["GET".into(), "PUT".into()],
                    headers: vec!["x-amz-*".into(), "Content-Type".into()],
                    expose: vec!["ETag".into()],
                    max_age: Some(600),
                },
                CorsRule {
                    id: None,
                    origins: vec!["*".into()],
                    methods: vec!["GET".into()],
                    headers: vec![],
                    expose: vec![],
                    max_age: None,
                },
            ],
        }
    }

    #[test]
    fn rules_match_origin_method_and_headers() {
        let c = cors();
        let r = c
            .matching(
                "https://app.example.com",
                "PUT",
                &["content-type", "X-Amz-Date"],
            )
            .unwrap();
        assert_eq!(r.max_age, Some(600));
        assert!(c
            .matching("https://app.example.com", "PUT", &["authorization"])
            .is_none());
        assert!(c.matching("https://evil.com", "PUT", &[]).is_none());
        // Anyone may GET without extra headers (the second rule).
        let r = c.matching("https://evil.com", "GET", &[]).unwrap();
        assert_eq!(r.headers_for("https://evil.com", None)[0].1, "*");
        assert!(c.matching("https://evil.com", "DELETE", &[]).is_none());
    }
}
