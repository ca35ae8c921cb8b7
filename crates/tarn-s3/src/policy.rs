//! Bucket policies: the JSON policy language of S3 (Version, Statement with
//! Sid, Effect, Principal/NotPrincipal, Action/NotAction,
//! Resource/NotResource, Condition), parsed and checked once when a policy
//! is put and evaluated from the parsed form on every request.
//!
//! What is refused rather than guessed: a principal that is not `*` or a
//! Tarn user, a resource outside the policy's bucket, a condition operator
//! or key Tarn does not know (it could never be evaluated as written). An
//! action Tarn does not serve is accepted and matches no request.

use std::borrow::Cow;
use std::net::IpAddr;

use serde_json::{Map, Value};

/// Largest policy document (AWS's limit for bucket policies).
pub const POLICY_MAX_BYTES: usize = 20 * 1024;
/// ARN prefix of S3 resources.
pub const S3_ARN: &str = "arn:aws:s3:::";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError(pub String);

impl std::fmt::Display for PolicyError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad<T>(msg: impl Into<String>) -> Result<T, PolicyError> {
    Err(PolicyError(msg.into()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Effect {
    Allow,
    Deny,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Principals {
    /// `*`: everyone, anonymous requests included.
    Anyone,
    /// Tarn users by name.
    Users(Vec<String>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    StringEquals,
    StringNotEquals,
    StringEqualsIgnoreCase,
    StringNotEqualsIgnoreCase,
    StringLike,
    StringNotLike,
    NumericEquals,
    NumericNotEquals,
    NumericLessThan,
    NumericLessThanEquals,
    NumericGreaterThan,
    NumericGreaterThanEquals,
    DateEquals,
    DateNotEquals,
    DateLessThan,
    DateLessThanEquals,
    DateGreaterThan,
    DateGreaterThanEquals,
    Bool,
    IpAddress,
    NotIpAddress,
    Null,
}

impl Op {
    fn parse(name: &str) -> Option<Op> {
        use Op::*;
        Some(match name {
            "StringEquals" | "ArnEquals" => StringEquals,
            "StringNotEquals" | "ArnNotEquals" => StringNotEquals,
            "StringEqualsIgnoreCase" => StringEqualsIgnoreCase,
            "StringNotEqualsIgnoreCase" => StringNotEqualsIgnoreCase,
            "StringLike" | "ArnLike" => StringLike,
            "StringNotLike" | "ArnNotLike" => StringNotLike,
            "NumericEquals" => NumericEquals,
            "NumericNotEquals" => NumericNotEquals,
            "NumericLessThan" => NumericLessThan,
            "NumericLessThanEquals" => NumericLessThanEquals,
            "NumericGreaterThan" => NumericGreaterThan,
            "NumericGreaterThanEquals" => NumericGreaterThanEquals,
            "DateEquals" => DateEquals,
            "DateNotEquals" => DateNotEquals,
            "DateLessThan" => DateLessThan,
            "DateLessThanEquals" => DateLessThanEquals,
            "DateGreaterThan" => DateGreaterThan,
            "DateGreaterThanEquals" => DateGreaterThanEquals,
            "Bool" => Bool,
            "IpAddress" => IpAddress,
            "NotIpAddress" => NotIpAddress,
            "Null" => Null,
            _ => return None,
        })
    }

    /// Negated operators hold when no value matches.
    fn negated(self) -> bool {
        matches!(
            self,
            Op::StringNotEquals
                | Op::StringNotEqualsIgnoreCase
                | Op::StringNotLike
                | Op::NumericNotEquals
                | Op::DateNotEquals
                | Op::NotIpAddress
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SetOp {
    Single,
    ForAnyValue,
    ForAllValues,
}

/// The condition keys Tarn evaluates (lower case; keys are case-insensitive).
pub const CONDITION_KEYS: &[&str] = &[
    "aws:sourceip",
    "aws:securetransport",
    "aws:currenttime",
    "aws:epochtime",
    "aws:useragent",
    "aws:referer",
    "aws:username",
    "aws:userid",
    "aws:principaltype",
    "s3:prefix",
    "s3:delimiter",
    "s3:max-keys",
    "s3:versionid",
    "s3:authtype",
    "s3:signatureversion",
    "s3:x-amz-acl",
    "s3:x-amz-content-sha256",
    "s3:x-amz-copy-source",
    "s3:x-amz-metadata-directive",
    "s3:x-amz-server-side-encryption",
    "s3:x-amz-storage-class",
    "s3:x-amz-grant-read",
    "s3:x-amz-grant-write",
    "s3:x-amz-grant-read-acp",
    "s3:x-amz-grant-write-acp",
    "s3:x-amz-grant-full-control",
    "s3:x-amz-server-side-encryption-aws-kms-key-id",
    "s3:x-amz-server-side-encryption-customer-algorithm",
    "s3:x-amz-website-redirect-location",
    "s3:if-match",
    "s3:if-none-match",
    "s3:object-lock-mode",
    "s3:object-lock-retain-until-date",
    "s3:object-lock-legal-hold",
    "s3:object-lock-remaining-retention-days",
    "s3:signatureage",
    "s3:tlsversion",
    "aws:requestedregion",
    "s3:requestobjecttagkeys",
    "aws:principalarn",
    // Never in a request to Tarn (no VPCs, organizations, MFA or AWS
    // services): present in a condition, they hold as AWS's do for a
    // request without them (positive operators fail, negated ones hold).
    "aws:sourcevpc",
    "aws:sourcevpce",
    "aws:vpcsourceip",
    "aws:principalorgid",
    "aws:principalorgpaths",
    "aws:multifactorauthpresent",
    "aws:multifactorauthage",
    "aws:viaawsservice",
    "aws:calledvia",
    "aws:calledviafirst",
    "aws:calledvialast",
    "aws:sourcearn",
    "aws:sourceaccount",
    "aws:sourceorgid",
    "aws:sourceorgpaths",
    "aws:principalisawsservice",
    "aws:principalservicename",
    "aws:tokenissuetime",
    "aws:federatedprovider",
];

/// Condition keys with a name after a slash (`s3:RequestObjectTag/KEY`).
pub const CONDITION_KEY_PREFIXES: &[&str] = &["s3:requestobjecttag/", EXISTING_TAG_PREFIX];

/// `s3:ExistingObjectTag/KEY`: a tag the object already has (the check
/// reads the object's tags only for a bucket whose policy names one).
pub const EXISTING_TAG_PREFIX: &str = "s3:existingobjecttag/";

/// Whether Tarn evaluates a condition key (lower case).
pub fn known_condition_key(key: &str) -> bool {
    CONDITION_KEYS.contains(&key)
        || CONDITION_KEY_PREFIXES
            .iter()
            .any(|p| key.strip_prefix(p).is_some_and(|rest| !rest.is_empty()))
}

/// Keys that, compared for equality, pin a statement to particular callers
/// (a statement granting `*` with one of them is not public).
const NARROWING_KEYS: &[&str] = &["aws:sourceip", "aws:username", "aws:userid"];

#[derive(Debug, Clone, PartialEq)]
struct Condition {
    op: Op,
    set: SetOp,
    if_exists: bool,
    key: String,
    values: Vec<String>,
    /// The values of an IpAddress / NotIpAddress condition, parsed.
    nets: Vec<(IpAddr, u8)>,
}

#[derive(Debug, Clone, PartialEq)]
struct Statement {
    effect: Effect,
    principals: Principals,
    not_principal: bool,
    /// Lower case patterns.
    actions: Vec<String>,
    not_action: bool,
    /// Patterns on "bucket" or "bucket/key", the ARN prefix removed.
    resources: Vec<String>,
    not_resource: bool,
    conditions: Vec<Condition>,
}

/// A parsed bucket policy.
#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    statements: Vec<Statement>,
    /// Policy variables (`${aws:username}`) are substituted only in
    /// version 2012-10-17, as in AWS.
    variables: bool,
}

/// What a request brings to a policy: who, what, on which resource, and the
/// values of condition keys (asked for only when a statement has conditions).
pub trait RequestContext {
    /// The requesting user; None for an anonymous request.
    fn principal(&self) -> Option<&str>;
    /// The value of a condition key (lower case); None when the request has none.
    fn value(&self, key: &str) -> Option<String>;
    /// The values of a multivalued key (`s3:RequestObjectTagKeys`), which
    /// ForAnyValue / ForAllValues compare as a set; a single-valued key's
    /// one value.
    fn values(&self, key: &str) -> Option<Vec<String>> {
        self.value(key).map(|v| vec![v])
    }
    /// The value of `aws:SourceIp` as an address (what IpAddress conditions
    /// on it compare, without a round trip through text).
    fn source_ip(&self) -> Option<IpAddr> {
        self.value("aws:sourceip")?.parse().ok()
    }
}

/// The outcome of evaluating a policy for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No statement applies.
    NotApplicable,
    /// An Allow applies; `public` when every applying Allow grants everyone.
    Allow { public: bool },
    /// An explicit Deny applies.
    Deny,
}

fn strings(v: &Value, what: &str) -> Result<Vec<String>, PolicyError> {
    match v {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(a) if !a.is_empty() => a
            .iter()
            .map(|x| match x {
                Value::String(s) => Ok(s.clone()),
                _ => bad(format!("{what} must be a string or a list of strings")),
            })
            .collect(),
        _ => bad(format!("{what} must be a string or a list of strings")),
    }
}

/// A user name from a principal: the name itself, or an IAM user ARN.
fn principal_user(p: &str) -> Result<String, PolicyError> {
    let name = match p.strip_prefix("arn:aws:iam::") {
        Some(rest) => match rest
            .split_once(':')
            .and_then(|(_, r)| r.strip_prefix("user/"))
        {
            Some(n) => n,
            None => return bad(format!("Invalid principal in policy: {p}")),
        },
        None => p,
    };
    if name.is_empty()
        || !name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"+=,.@_-".contains(&c))
    {
        return bad(format!("Invalid principal in policy: {p}"));
    }
    Ok(name.to_string())
}

fn parse_principal(v: &Value) -> Result<Principals, PolicyError> {
    match v {
        Value::String(s) if s == "*" => Ok(Principals::Anyone),
        Value::Object(m) => {
            let mut users = Vec::new();
            for (kind, who) in m {
                if kind != "AWS" && kind != "CanonicalUser" {
                    return bad(format!(
                        "Invalid principal in policy: {kind} principals are not supported"
                    ));
                }
                for p in strings(who, "Principal")? {
                    if p == "*" {
                        return Ok(Principals::Anyone);
                    }
                    users.push(principal_user(&p)?);
                }
            }
            if users.is_empty() {
                return bad("Invalid principal in policy: empty");
            }
            Ok(Principals::Users(users))
        }
        _ => bad("Invalid principal in policy"),
    }
}

/// An action pattern, lower case (action names, the service prefix
/// included, compare without case as in AWS).
fn parse_action(a: &str) -> Result<String, PolicyError> {
    let a = a.to_ascii_lowercase();
    let ok = a == "*"
        || a.strip_prefix("s3:").is_some_and(|n| {
            !n.is_empty()
                && n.bytes()
                    .all(|c| c.is_ascii_alphanumeric() || c == b'*' || c == b'?')
        });
    if !ok {
        return bad(format!("Policy has invalid action: {a}"));
    }
    Ok(a)
}

fn parse_resource(r: &str, bucket: &str) -> Result<String, PolicyError> {
    let Some(path) = r.strip_prefix(S3_ARN) else {
        return bad(format!("Policy has invalid resource: {r}"));
    };
    let bucket_part = path.split('/').next().unwrap_or("");
    // A resource must lie in the policy's own bucket.
    if bucket_part.contains("${") || !glob(bucket_part.as_bytes(), bucket.as_bytes()) {
        return bad(format!("Policy has invalid resource: {r}"));
    }
    Ok(path.to_string())
}

fn value_string(v: &Value) -> Result<String, PolicyError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Bool(b) => Ok(b.to_string()),
        Value::Number(n) => Ok(n.to_string()),
        _ => bad("Condition values must be strings, numbers or booleans"),
    }
}

fn parse_conditions(v: &Value) -> Result<Vec<Condition>, PolicyError> {
    let Value::Object(ops) = v else {
        return bad("Condition must be an object");
    };
    let mut out = Vec::new();
    for (name, block) in ops {
        let (set, rest) = if let Some(r) = name.strip_prefix("ForAnyValue:") {
            (SetOp::ForAnyValue, r)
        } else if let Some(r) = name.strip_prefix("ForAllValues:") {
            (SetOp::ForAllValues, r)
        } else {
            (SetOp::Single, name.as_str())
        };
        let (if_exists, base) = match rest.strip_suffix("IfExists") {
            Some(b) => (true, b),
            None => (false, rest),
        };
        let Some(op) = Op::parse(base) else {
            return bad(format!("Invalid Condition type: {name}"));
        };
        if op == Op::Null && if_exists {
            return bad(format!("Invalid Condition type: {name}"));
        }
        let Value::Object(keys) = block else {
            return bad(format!("Condition {name} must be an object of keys"));
        };
        for (key, values) in keys {
            let key = key.to_ascii_lowercase();
            if !known_condition_key(&key) {
                return bad(format!("Policy has an invalid condition key: {key}"));
            }
            let values: Vec<String> = match values {
                Value::Array(a) if !a.is_empty() => {
                    a.iter().map(value_string).collect::<Result<_, _>>()?
                }
                Value::Array(_) => return bad(format!("Condition {name} {key} has no value")),
                v => vec![value_string(v)?],
            };
            for value in &values {
                check_value(op, value).map_err(|e| PolicyError(format!("{name} {key}: {e}")))?;
            }
            let nets = match op {
                Op::IpAddress | Op::NotIpAddress => {
                    values.iter().filter_map(|v| parse_cidr(v)).collect()
                }
                _ => Vec::new(),
            };
            out.push(Condition {
                op,
                set,
                if_exists,
                key,
                values,
                nets,
            });
        }
    }
    Ok(out)
}

/// Whether a condition value can be compared with its operator at all.
fn check_value(op: Op, v: &str) -> Result<(), String> {
    use Op::*;
    let ok = match op {
        NumericEquals
        | NumericNotEquals
        | NumericLessThan
        | NumericLessThanEquals
        | NumericGreaterThan
        | NumericGreaterThanEquals => v.parse::<f64>().is_ok(),
        DateEquals
        | DateNotEquals
        | DateLessThan
        | DateLessThanEquals
        | DateGreaterThan
        | DateGreaterThanEquals => parse_date(v).is_some(),
        Bool | Null => v.eq_ignore_ascii_case("true") || v.eq_ignore_ascii_case("false"),
        IpAddress | NotIpAddress => parse_cidr(v).is_some(),
        _ => true,
    };
    if ok {
        Ok(())
    } else {
        Err(format!("invalid value {v:?}"))
    }
}

/// Seconds since the epoch of an ISO 8601 date (RFC 3339, or a bare date)
/// or of an epoch number.
fn parse_date(v: &str) -> Option<f64> {
    use time::format_description::well_known::Rfc3339;
    if let Ok(n) = v.parse::<f64>() {
        return Some(n);
    }
    if let Ok(t) = time::OffsetDateTime::parse(v, &Rfc3339) {
        return Some(t.unix_timestamp() as f64);
    }
    let d = time::Date::parse(v, time::macros::format_description!("[year]-[month]-[day]")).ok()?;
    Some(d.midnight().assume_utc().unix_timestamp() as f64)
}

fn parse_cidr(v: &str) -> Option<(IpAddr, u8)> {
    let (addr, bits) = match v.split_once('/') {
        Some((a, b)) => (a.parse::<IpAddr>().ok()?, b.parse::<u8>().ok()?),
        None => {
            let a = v.parse::<IpAddr>().ok()?;
            (a, if a.is_ipv4() { 32 } else { 128 })
        }
    };
    let max = if addr.is_ipv4() { 32 } else { 128 };
    (bits <= max).then_some((addr, bits))
}

fn cidr_contains(cidr: &str, ip: &str) -> bool {
    match (parse_cidr(cidr), ip.parse::<IpAddr>()) {
        (Some((net, bits)), Ok(ip)) => net_contains(net, bits, ip),
        _ => false,
    }
}

/// Whether `ip` is in the network `net`/`bits` (an IPv4-mapped IPv6
/// address counts as its IPv4 address).
fn net_contains(net: IpAddr, bits: u8, ip: IpAddr) -> bool {
    let ip = match (net, ip) {
        (IpAddr::V4(_), IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => return false,
        },
        _ => ip,
    };
    let (a, b, width): (u128, u128, u32) = match (net, ip) {
        (IpAddr::V4(n), IpAddr::V4(i)) => (u32::from(n) as u128, u32::from(i) as u128, 32),
        (IpAddr::V6(n), IpAddr::V6(i)) => (u128::from(n), u128::from(i), 128),
        _ => return false,
    };
    if bits == 0 {
        return true;
    }
    let shift = width - u32::from(bits);
    (a >> shift) == (b >> shift)
}

/// `*` matches any run of characters, `?` any one.
pub fn glob(pattern: &[u8], s: &[u8]) -> bool {
    glob_folding(pattern, s, false)
}

/// `glob` of a lower-case pattern on `s` read in lower case (`fold`) or
/// as it is.
fn glob_folding(pattern: &[u8], s: &[u8], fold: bool) -> bool {
    let (mut p, mut i) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while i < s.len() {
        let c = if fold {
            s[i].to_ascii_lowercase()
        } else {
            s[i]
        };
        if p < pattern.len() && (pattern[p] == b'?' || pattern[p] == c) {
            p += 1;
            i += 1;
        } else if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, i));
            p += 1;
        } else if let Some((sp, si)) = star {
            p = sp + 1;
            i = si + 1;
            star = Some((sp, si + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

impl Policy {
    /// Parses and checks a policy for `bucket`. `user_exists` tells whether
    /// a named principal is a user (a policy naming an unknown one is
    /// refused, as AWS refuses an invalid principal).
    pub fn parse(
        text: &str,
        bucket: &str,
        user_exists: &dyn Fn(&str) -> bool,
    ) -> Result<Policy, PolicyError> {
        if text.len() > POLICY_MAX_BYTES {
            return bad(format!(
                "Policy exceeds the maximum allowed document size of {POLICY_MAX_BYTES} bytes"
            ));
        }
        let doc: Value = serde_json::from_str(text)
            .map_err(|e| PolicyError(format!("This policy contains invalid Json: {e}")))?;
        let Value::Object(doc) = doc else {
            return bad("The policy must be a JSON object");
        };
        let mut variables = false;
        let mut statements = Vec::new();
        let mut saw_statement = false;
        for (k, v) in &doc {
            match k.as_str() {
                "Version" => match v.as_str() {
                    Some("2012-10-17") => variables = true,
                    Some("2008-10-17") => variables = false,
                    _ => return bad("The policy Version must be 2012-10-17 or 2008-10-17"),
                },
                "Id" => {
                    if !v.is_string() {
                        return bad("Id must be a string");
                    }
                }
                "Statement" => {
                    saw_statement = true;
                    let list: Vec<&Map<String, Value>> = match v {
                        Value::Object(m) => vec![m],
                        Value::Array(a) if !a.is_empty() => a
                            .iter()
                            .map(|s| s.as_object().ok_or(()))
                            .collect::<Result<_, _>>()
                            .map_err(|_| PolicyError("Each Statement must be an object".into()))?,
                        _ => return bad("Statement must be an object or a non-empty list"),
                    };
                    for s in list {
                        statements.push(Self::parse_statement(s, bucket, user_exists)?);
                    }
                }
                other => return bad(format!("Policy has an unknown field: {other}")),
            }
        }
        if !saw_statement {
            return bad("Missing required field Statement");
        }
        Ok(Policy {
            statements,
            variables,
        })
    }

    fn parse_statement(
        s: &Map<String, Value>,
        bucket: &str,
        user_exists: &dyn Fn(&str) -> bool,
    ) -> Result<Statement, PolicyError> {
        let mut effect = None;
        let mut principal = None;
        let mut action = None;
        let mut resource = None;
        let mut conditions = Vec::new();
        for (k, v) in s {
            match k.as_str() {
                "Sid" => {
                    if !v.is_string() {
                        return bad("Sid must be a string");
                    }
                }
                "Effect" => {
                    effect = Some(match v.as_str() {
                        Some("Allow") => Effect::Allow,
                        Some("Deny") => Effect::Deny,
                        _ => return bad("Effect must be Allow or Deny"),
                    })
                }
                "Principal" | "NotPrincipal" => {
                    if principal.is_some() {
                        return bad("A statement has either Principal or NotPrincipal");
                    }
                    principal = Some((parse_principal(v)?, k == "NotPrincipal"));
                }
                "Action" | "NotAction" => {
                    if action.is_some() {
                        return bad("A statement has either Action or NotAction");
                    }
                    let list = strings(v, k)?
                        .iter()
                        .map(|a| parse_action(a))
                        .collect::<Result<Vec<_>, _>>()?;
                    action = Some((list, k == "NotAction"));
                }
                "Resource" | "NotResource" => {
                    if resource.is_some() {
                        return bad("A statement has either Resource or NotResource");
                    }
                    let list = strings(v, k)?
                        .iter()
                        .map(|r| parse_resource(r, bucket))
                        .collect::<Result<Vec<_>, _>>()?;
                    resource = Some((list, k == "NotResource"));
                }
                "Condition" => conditions = parse_conditions(v)?,
                other => return bad(format!("Statement has an unknown field: {other}")),
            }
        }
        let Some(effect) = effect else {
            return bad("Missing required field Effect");
        };
        let Some((principals, not_principal)) = principal else {
            return bad("Missing required field Principal");
        };
        if let Principals::Users(users) = &principals {
            if let Some(u) = users.iter().find(|u| !user_exists(u)) {
                return bad(format!("Invalid principal in policy: no user {u}"));
            }
        }
        let Some((actions, not_action)) = action else {
            return bad("Missing required field Action");
        };
        let Some((resources, not_resource)) = resource else {
            return bad("Missing required field Resource");
        };
        Ok(Statement {
            effect,
            principals,
            not_principal,
            actions,
            not_action,
            resources,
            not_resource,
            conditions,
        })
    }

    /// Evaluates the policy for `action` (e.g. `s3:GetObject`) on `resource`
    /// ("bucket" or "bucket/key").
    pub fn evaluate(&self, cx: &dyn RequestContext, action: &str, resource: &str) -> Verdict {
        let mut verdict = Verdict::NotApplicable;
        for s in &self.statements {
            if !self.applies(s, cx, action, resource) {
                continue;
            }
            match s.effect {
                Effect::Deny => return Verdict::Deny,
                Effect::Allow => {
                    let public = statement_public(s);
                    verdict = match verdict {
                        Verdict::Allow { public: p } => Verdict::Allow {
                            public: p && public,
                        },
                        _ => Verdict::Allow { public },
                    };
                }
            }
        }
        verdict
    }

    /// Whether a condition names a key starting with `prefix`.
    pub fn mentions_key(&self, prefix: &str) -> bool {
        self.statements
            .iter()
            .flat_map(|s| &s.conditions)
            .any(|c| c.key.starts_with(prefix))
    }

    /// Whether any Allow statement grants everyone without narrowing
    /// conditions (GetBucketPolicyStatus, the public access block).
    pub fn is_public(&self) -> bool {
        self.statements
            .iter()
            .any(|s| s.effect == Effect::Allow && statement_public(s))
    }

    fn applies(
        &self,
        s: &Statement,
        cx: &dyn RequestContext,
        action: &str,
        resource: &str,
    ) -> bool {
        let principal_match = match (&s.principals, cx.principal()) {
            (Principals::Anyone, _) => true,
            (Principals::Users(users), Some(p)) => users.iter().any(|u| u == p),
            (Principals::Users(_), None) => false,
        };
        if principal_match == s.not_principal {
            return false;
        }
        let action_match = s
            .actions
            .iter()
            .any(|a| glob_folding(a.as_bytes(), action.as_bytes(), true));
        if action_match == s.not_action {
            return false;
        }
        let resource_match = s.resources.iter().any(|r| match self.substitute(r, cx) {
            Some(r) => glob(r.as_bytes(), resource.as_bytes()),
            None => false,
        });
        if resource_match == s.not_resource {
            return false;
        }
        s.conditions.iter().all(|c| self.condition_holds(c, cx))
    }

    /// Replaces policy variables; None when one names a key the request
    /// lacks (the pattern then matches nothing).
    fn substitute<'a>(&self, pattern: &'a str, cx: &dyn RequestContext) -> Option<Cow<'a, str>> {
        if !self.variables || !pattern.contains("${") {
            return Some(Cow::Borrowed(pattern));
        }
        let mut out = String::with_capacity(pattern.len());
        let mut rest = pattern;
        while let Some(start) = rest.find("${") {
            out.push_str(&rest[..start]);
            let Some(end) = rest[start..].find('}') else {
                out.push_str(&rest[start..]);
                return Some(Cow::Owned(out));
            };
            let name = &rest[start + 2..start + end];
            match name {
                "*" | "?" | "$" => out.push_str(name),
                _ => out.push_str(&cx.value(&name.to_ascii_lowercase())?),
            }
            rest = &rest[start + end + 1..];
        }
        out.push_str(rest);
        Some(Cow::Owned(out))
    }

    fn condition_holds(&self, c: &Condition, cx: &dyn RequestContext) -> bool {
        let ip_match = matches!(c.op, Op::IpAddress | Op::NotIpAddress) && c.key == "aws:sourceip";
        let any = if ip_match {
            let Some(ip) = cx.source_ip() else {
                return absent_holds(c);
            };
            c.nets
                .iter()
                .any(|&(net, bits)| net_contains(net, bits, ip))
        } else {
            let actual = cx.values(&c.key).filter(|v| !v.is_empty());
            if c.op == Op::Null {
                // Null: true means "the key is absent".
                let want_absent = c.values.iter().any(|v| v.eq_ignore_ascii_case("true"));
                return actual.is_none() == want_absent;
            }
            let Some(actual) = actual else {
                return absent_holds(c);
            };
            let matches = |a: &String| {
                c.values.iter().any(|v| match self.substitute(v, cx) {
                    Some(v) => compare(c.op, a, &v),
                    None => false,
                })
            };
            // What the negation below turns into the operator's meaning:
            // ForAllValues: every request value matches (negated: none
            // does); ForAnyValue: one matches (negated: one does not).
            let (all, any) = (|| actual.iter().all(matches), || actual.iter().any(matches));
            match (c.set, c.op.negated()) {
                (SetOp::ForAllValues, false) | (SetOp::ForAnyValue, true) => all(),
                _ => any(),
            }
        };
        if c.op.negated() {
            !any
        } else {
            any
        }
    }
}

/// Whether a condition holds on a request without its key: as in AWS, a
/// positive operator fails, a negated one (StringNotEquals, NotIpAddress,
/// ...) holds, and ...IfExists holds. (Negated ones failed here before: a
/// Deny with `StringNotEquals` on a key the request lacks did not apply.)
fn absent_holds(c: &Condition) -> bool {
    match c.set {
        SetOp::ForAllValues => true,
        SetOp::ForAnyValue => false,
        SetOp::Single => c.if_exists || c.op.negated(),
    }
}

/// Compares a request value with one condition value; for negated operators
/// this is the positive comparison (the caller negates).
fn compare(op: Op, actual: &str, want: &str) -> bool {
    use Op::*;
    let num = |s: &str| s.parse::<f64>().ok();
    match op {
        StringEquals | StringNotEquals => actual == want,
        StringEqualsIgnoreCase | StringNotEqualsIgnoreCase => actual.eq_ignore_ascii_case(want),
        StringLike | StringNotLike => glob(want.as_bytes(), actual.as_bytes()),
        NumericEquals
        | NumericNotEquals
        | NumericLessThan
        | NumericLessThanEquals
        | NumericGreaterThan
        | NumericGreaterThanEquals => match (num(actual), num(want)) {
            (Some(a), Some(w)) => ordered(op, a, w),
            _ => false,
        },
        DateEquals
        | DateNotEquals
        | DateLessThan
        | DateLessThanEquals
        | DateGreaterThan
        | DateGreaterThanEquals => match (parse_date(actual), parse_date(want)) {
            (Some(a), Some(w)) => ordered(op, a, w),
            _ => false,
        },
        Bool => actual.eq_ignore_ascii_case(want),
        IpAddress | NotIpAddress => cidr_contains(want, actual),
        Null => false,
    }
}

fn ordered(op: Op, a: f64, w: f64) -> bool {
    use Op::*;
    match op {
        NumericEquals | NumericNotEquals | DateEquals | DateNotEquals => a == w,
        NumericLessThan | DateLessThan => a < w,
        NumericLessThanEquals | DateLessThanEquals => a <= w,
        NumericGreaterThan | DateGreaterThan => a > w,
        _ => a >= w,
    }
}

/// A statement is public when it reaches everyone: Principal `*` (or a
/// NotPrincipal) with no condition that pins callers to fixed addresses or
/// users.
fn statement_public(s: &Statement) -> bool {
    let everyone = s.not_principal || s.principals == Principals::Anyone;
    everyone
        && !s.conditions.iter().any(|c| {
            NARROWING_KEYS.contains(&c.key.as_str())
                && match c.op {
                    Op::IpAddress => c
                        .values
                        .iter()
                        .all(|v| parse_cidr(v).is_some_and(|(_, bits)| bits > 0)),
                    Op::StringEquals | Op::StringEqualsIgnoreCase => c
                        .values
                        .iter()
                        .all(|v| !v.contains('*') && !v.contains('?')),
                    Op::StringLike => c.values.iter().all(|v| !v.contains('*')),
                    _ => false,
                }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Cx {
        who: Option<&'static str>,
        values: Vec<(&'static str, &'static str)>,
    }

    impl RequestContext for Cx {
        fn principal(&self) -> Option<&str> {
            self.who
        }
        fn value(&self, key: &str) -> Option<String> {
            match key {
                "aws:username" => self.who.map(str::to_string),
                _ => self
                    .values
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map(|(_, v)| v.to_string()),
            }
        }
        fn values(&self, key: &str) -> Option<Vec<String>> {
            let v: Vec<String> = self
                .values
                .iter()
                .filter(|(k, _)| *k == key)
                .map(|(_, v)| v.to_string())
                .collect();
            (!v.is_empty()).then_some(v)
        }
    }

    #[test]
    fn set_operators_compare_multivalued_keys() {
        let p = |cond: &str| {
            Policy::parse(
                &format!(
                    r#"{{"Statement":{{"Effect":"Allow","Principal":"*","Action":"s3:PutObject","Resource":"arn:aws:s3:::b/*","Condition":{cond}}}}}"#
                ),
                "b",
                &users,
            )
            .unwrap()
        };
        let tags = |keys: &[&'static str]| Cx {
            who: Some("alice"),
            values: keys
                .iter()
                .map(|k| ("s3:requestobjecttagkeys", *k))
                .collect(),
        };
        let allowed = |p: &Policy, cx: &Cx| {
            matches!(p.evaluate(cx, "s3:PutObject", "b/k"), Verdict::Allow { .. })
        };
        let all = p(r#"{"ForAllValues:StringEquals":{"s3:RequestObjectTagKeys":["team","cost"]}}"#);
        assert!(allowed(&all, &tags(&["team"])));
        assert!(allowed(&all, &tags(&["team", "cost"])));
        assert!(!allowed(&all, &tags(&["team", "secret"])));
        assert!(allowed(&all, &tags(&[])), "ForAllValues holds on no values");
        let any = p(r#"{"ForAnyValue:StringEquals":{"s3:RequestObjectTagKeys":"team"}}"#);
        assert!(allowed(&any, &tags(&["x", "team"])));
        assert!(!allowed(&any, &tags(&["x", "y"])));
        assert!(!allowed(&any, &tags(&[])));
        let none = p(r#"{"ForAllValues:StringNotEquals":{"s3:RequestObjectTagKeys":"secret"}}"#);
        assert!(allowed(&none, &tags(&["team", "cost"])));
        assert!(!allowed(&none, &tags(&["team", "secret"])));
        let some_other = p(r#"{"ForAnyValue:StringNotEquals":{"s3:RequestObjectTagKeys":"team"}}"#);
        assert!(allowed(&some_other, &tags(&["team", "x"])));
        assert!(!allowed(&some_other, &tags(&["team"])));
    }

    fn users(u: &str) -> bool {
        matches!(u, "alice" | "bob")
    }

    fn user(who: &'static str) -> Cx {
        Cx {
            who: Some(who),
            values: vec![],
        }
    }

    #[test]
    fn globbing() {
        assert!(glob(b"*", b""));
        assert!(glob(b"b/*", b"b/x/y"));
        assert!(glob(b"b/a?c", b"b/abc"));
        assert!(!glob(b"b/a?c", b"b/ac"));
        assert!(glob(b"s3:get*", b"s3:getobject"));
        assert!(!glob(b"b/*.txt", b"b/x.bin"));
        assert!(glob(b"*a*b*", b"xxaxxbxx"));
    }

    #[test]
    fn public_read_policy() {
        let p = Policy::parse(
            r#"{"Version":"2012-10-17","Statement":[{"Sid":"r","Effect":"Allow",
            "Principal":"*","Action":["s3:GetObject"],"Resource":"arn:aws:s3:::b/*"}]}"#,
            "b",
            &users,
        )
        .unwrap();
        let anon = Cx {
            who: None,
            values: vec![],
        };
        assert_eq!(
            p.evaluate(&anon, "s3:GetObject", "b/k"),
            Verdict::Allow { public: true }
        );
        assert_eq!(
            p.evaluate(&anon, "s3:PutObject", "b/k"),
            Verdict::NotApplicable
        );
        assert_eq!(
            p.evaluate(&anon, "s3:ListBucket", "b"),
            Verdict::NotApplicable
        );
        assert!(p.is_public());
    }

    #[test]
    fn users_deny_and_variables() {
        let p = Policy::parse(
            r#"{"Version":"2012-10-17","Statement":[
            {"Effect":"Allow","Principal":{"AWS":["arn:aws:iam::123:user/alice","bob"]},
             "Action":"s3:*","Resource":["arn:aws:s3:::b","arn:aws:s3:::b/home/${aws:username}/*"]},
            {"Effect":"Deny","Principal":{"AWS":"bob"},"Action":"s3:DeleteObject","Resource":"arn:aws:s3:::b/*"}]}"#,
            "b",
            &users,
        )
        .unwrap();
        assert!(!p.is_public());
        let allow = Verdict::Allow { public: false };
        assert_eq!(
            p.evaluate(&user("alice"), "s3:GetObject", "b/home/alice/x"),
            allow
        );
        assert_eq!(
            p.evaluate(&user("alice"), "s3:GetObject", "b/home/bob/x"),
            Verdict::NotApplicable
        );
        assert_eq!(
            p.evaluate(&user("bob"), "s3:DeleteObject", "b/home/bob/x"),
            Verdict::Deny
        );
        assert_eq!(
            p.evaluate(&user("carol"), "s3:ListBucket", "b"),
            Verdict::NotApplicable
        );
    }

    #[test]
    fn address_conditions_and_action_case() {
        let p = Policy::parse(
            r#"{"Version":"2012-10-17","Statement":[
            {"Effect":"Allow","Principal":"*","Action":"S3:GetObject","Resource":"arn:aws:s3:::b/*",
             "Condition":{"IpAddress":{"aws:SourceIp":["192.168.0.0/16","2001:db8::/32"]}}},
            {"Effect":"Deny","Principal":"*","Action":"s3:Get*","Resource":"arn:aws:s3:::b/*",
             "Condition":{"NotIpAddress":{"aws:SourceIp":["0.0.0.0/0","::/0"]}}}]}"#,
            "b",
            &users,
        )
        .unwrap();
        let from = |ip: &'static str| Cx {
            who: None,
            values: vec![("aws:sourceip", ip)],
        };
        let ok = Verdict::Allow { public: false };
        assert_eq!(p.evaluate(&from("192.168.7.1"), "s3:GetObject", "b/k"), ok);
        // An IPv4 client seen through an IPv6 socket is its IPv4 address.
        assert_eq!(
            p.evaluate(&from("::ffff:192.168.7.1"), "s3:GetObject", "b/k"),
            ok
        );
        assert_eq!(p.evaluate(&from("2001:db8::9"), "s3:GetObject", "b/k"), ok);
        assert_eq!(
            p.evaluate(&from("10.0.0.1"), "s3:GetObject", "b/k"),
            Verdict::NotApplicable
        );
        // Actions compare without case, whichever side has capitals.
        assert_eq!(p.evaluate(&from("192.168.7.1"), "s3:GETOBJECT", "b/k"), ok);
        // No address at all: IpAddress fails and NotIpAddress holds, as in
        // AWS (a negated operator holds on a key the request lacks): the
        // Deny applies.
        let nowhere = Cx {
            who: None,
            values: vec![],
        };
        assert_eq!(p.evaluate(&nowhere, "s3:GetObject", "b/k"), Verdict::Deny);
    }

    #[test]
    fn conditions() {
        let p = Policy::parse(
            r#"{"Version":"2012-10-17","Statement":{"Effect":"Allow","Principal":"*",
            "Action":"s3:ListBucket","Resource":"arn:aws:s3:::b",
            "Condition":{"IpAddress":{"aws:SourceIp":"10.0.0.0/8"},
                         "StringLike":{"s3:prefix":["pub/*",""]},
                         "NumericLessThanEquals":{"s3:max-keys":100}}}}"#,
            "b",
            &users,
        )
        .unwrap();
        assert!(!p.is_public(), "pinned to an address range");
        let cx = |ip: &'static str, prefix: &'static str, max: &'static str| Cx {
            who: None,
            values: vec![
                ("aws:sourceip", ip),
                ("s3:prefix", prefix),
                ("s3:max-keys", max),
            ],
        };
        let ok = Verdict::Allow { public: false };
        assert_eq!(
            p.evaluate(&cx("10.1.2.3", "pub/a", "50"), "s3:ListBucket", "b"),
            ok
        );
        assert_eq!(
            p.evaluate(&cx("11.1.2.3", "pub/a", "50"), "s3:ListBucket", "b"),
            Verdict::NotApplicable
        );
        assert_eq!(
            p.evaluate(&cx("10.1.2.3", "priv/", "50"), "s3:ListBucket", "b"),
            Verdict::NotApplicable
        );
        assert_eq!(
            p.evaluate(&cx("10.1.2.3", "pub/", "1000"), "s3:ListBucket", "b"),
            Verdict::NotApplicable
        );
        // A missing key fails a plain condition and passes an IfExists one.
        let q = Policy::parse(
            r#"{"Statement":{"Effect":"Deny","Principal":"*","Action":"s3:*","Resource":"arn:aws:s3:::b/*",
            "Condition":{"StringNotEqualsIfExists":{"s3:x-amz-acl":"private"},"Bool":{"aws:SecureTransport":false}}}}"#,
            "b",
            &users,
        )
        .unwrap();
        let plain = Cx {
            who: Some("alice"),
            values: vec![("aws:securetransport", "false")],
        };
        assert_eq!(q.evaluate(&plain, "s3:PutObject", "b/k"), Verdict::Deny);
        let private = Cx {
            who: Some("alice"),
            values: vec![
                ("aws:securetransport", "false"),
                ("s3:x-amz-acl", "private"),
            ],
        };
        assert_eq!(
            q.evaluate(&private, "s3:PutObject", "b/k"),
            Verdict::NotApplicable
        );
    }

    #[test]
    fn malformed_policies_are_refused() {
        let cases = [
            ("not json", "invalid Json"),
            (r#"{"Statement":[]}"#, "non-empty"),
            (r#"{"Version":"2012-10-17"}"#, "Statement"),
            (
                r#"{"Statement":{"Effect":"Allow","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*"}}"#,
                "Principal",
            ),
            (
                r#"{"Statement":{"Effect":"Permit","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*"}}"#,
                "Effect",
            ),
            (
                r#"{"Statement":{"Effect":"Allow","Principal":"*","Action":"ec2:Run","Resource":"arn:aws:s3:::b/*"}}"#,
                "invalid action",
            ),
            (
                r#"{"Statement":{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::other/*"}}"#,
                "invalid resource",
            ),
            (
                r#"{"Statement":{"Effect":"Allow","Principal":{"AWS":"mallory"},"Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*"}}"#,
                "no user mallory",
            ),
            (
                r#"{"Statement":{"Effect":"Allow","Principal":{"Service":"ec2.amazonaws.com"},"Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*"}}"#,
                "not supported",
            ),
            (
                r#"{"Statement":{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*","Condition":{"StringEquals":{"aws:ResourceTag/x":"o-1"}}}}"#,
                "invalid condition key",
            ),
            (
                r#"{"Statement":{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*","Condition":{"IpAddress":{"aws:SourceIp":"10.0.0.0/99"}}}}"#,
                "invalid value",
            ),
            (
                r#"{"Statement":{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*","Condition":{"StringSimilar":{"s3:prefix":"a"}}}}"#,
                "Condition type",
            ),
        ];
        for (text, want) in cases {
            let e = Policy::parse(text, "b", &users).unwrap_err();
            assert!(e.0.contains(want), "{text}: {e}");
        }
        let big = format!(
            r#"{{"Id":"{}","Statement":{{"Effect":"Allow","Principal":"*","Action":"s3:GetObject","Resource":"arn:aws:s3:::b/*"}}}}"#,
            "x".repeat(POLICY_MAX_BYTES)
        );
        assert!(Policy::parse(&big, "b", &users)
            .unwrap_err()
            .0
            .contains("size"));
    }

    #[test]
    fn cidrs() {
        assert!(cidr_contains("127.0.0.0/8", "127.0.0.5"));
        assert!(!cidr_contains("127.0.0.1/32", "127.0.0.2"));
        assert!(cidr_contains("0.0.0.0/0", "8.8.8.8"));
        assert!(cidr_contains("::1/128", "::1"));
        assert!(cidr_contains("10.0.0.0/8", "::ffff:10.1.1.1"));
        assert!(!cidr_contains("10.0.0.0/8", "::1"));
    }
}
