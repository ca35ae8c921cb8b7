//! The web console on the admin port (`/console`): one page and its script
//! and style, compiled into the binary (no build step, nothing fetched from
//! elsewhere), over the same APIs a script uses.
//!
//! - Login with an access key and its secret (root's, or a user's): a
//!   session whose id is a cookie (`HttpOnly`, `SameSite=Strict`, path
//!   `/console`, 15 minutes idle and 1 hour at most). Failed logins are
//!   throttled per client address.
//! - `/console/api/admin/…` is the admin API (`/admin/…`, `/metrics`,
//!   `/health/…`) for root's sessions only; `/console/api/s3/…` is the S3
//!   API, forwarded to this node's S3 endpoint signed (SigV4) as the
//!   session's access key, so a user's console sees and does what the
//!   user's policies allow, and nothing else. The secret is looked up for
//!   each request: a revoked key ends its sessions.
//! - Every request that changes something carries the session's CSRF token
//!   in `X-Tarn-CSRF`, and an `Origin` (when the browser sends one) that is
//!   this console's; the cookie is `SameSite=Strict` besides.
//! - `/console/api/series`: requests, errors, bytes and latency of the last
//!   15 minutes, sampled every 5 s, for the charts.

use std::collections::{HashMap, VecDeque};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use http_body_util::BodyExt;
use hyper::body::Incoming;
use tarn_s3::iam::Iam;

use crate::admin::{constant_time_eq, json, text};
use crate::metrics::{Metrics, Totals, LATENCY_BOUNDS_S};

pub const COOKIE: &str = "tarn_console";
pub const CSRF_HEADER: &str = "x-tarn-csrf";
const IDLE: Duration = Duration::from_secs(15 * 60);
const LIFETIME: Duration = Duration::from_secs(3600);
const MAX_SESSIONS: usize = 4096;
/// Failed logins a client address may make per minute.
const LOGIN_FAILURES_PER_MINUTE: u32 = 5;
const SAMPLE_EVERY: Duration = Duration::from_secs(5);
const SAMPLES: usize = 180;

const INDEX_HTML: &str = include_str!("console/index.html");
const APP_JS: &str = include_str!("console/app.js");
const APP_CSS: &str = include_str!("console/app.css");

#[derive(Clone)]
pub struct Session {
    pub access_key: String,
    pub user: String,
    pub root: bool,
    pub csrf: String,
    created: Instant,
    last: Instant,
}

impl Session {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({ "user": self.user, "access_key": self.access_key, "root": self.root, "csrf": self.csrf })
    }
}

/// One sample of the S3 front's counters.
struct Sample {
    unix_ms: u64,
    totals: Totals,
}

#[derive(Default)]
pub struct Console {
    sessions: Mutex<HashMap<String, Session>>,
    failures: Mutex<HashMap<IpAddr, (Instant, u32)>>,
    samples: Mutex<VecDeque<Sample>>,
}

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    getrandom::fill(&mut b).expect("the OS random number source");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The session id in a request's cookies.
fn cookie_id(h: &http::HeaderMap) -> Option<String> {
    h.get_all(http::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|c| c.trim().split_once('='))
        .find(|(k, _)| *k == COOKIE)
        .map(|(_, v)| v.to_string())
}

impl Console {
    /// Samples the S3 front's counters every 5 s (the charts' data).
    pub fn spawn_sampler(self: &Arc<Self>, metrics: Arc<Metrics>) {
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                {
                    let Some(c) = me.upgrade() else { return };
                    let mut s = c.samples.lock().expect("samples");
                    s.push_back(Sample {
                        unix_ms: now_ms(),
                        totals: metrics.totals(),
                    });
                    while s.len() > SAMPLES + 1 {
                        s.pop_front();
                    }
                }
                tokio::time::sleep(SAMPLE_EVERY).await;
            }
        });
    }

    fn login(
        &self,
        iam: &Iam,
        client: IpAddr,
        access_key: &str,
        secret_key: &str,
    ) -> Result<(String, Session), (u16, String)> {
        {
            let mut f = self.failures.lock().expect("login failures");
            f.retain(|_, (since, _)| since.elapsed() < Duration::from_secs(60));
            if f.get(&client)
                .is_some_and(|(_, n)| *n >= LOGIN_FAILURES_PER_MINUTE)
            {
                return Err((
                    429,
                    "too many failed logins from this address: wait a minute".into(),
                ));
            }
        }
        let found = match (iam.secret_of(access_key), iam.user_of(access_key)) {
            (Ok(Some(secret)), Ok(Some(user))) => Some((secret, user)),
            (Err(e), _) | (_, Err(e)) => return Err((503, e.to_string())),
            _ => None,
        };
        // A key nobody has is compared too (with a secret that never
        // matches), so that the answer's time does not say which keys exist.
        let matches = match &found {
            Some((secret, _)) => {
                constant_time_eq(secret.expose().as_bytes(), secret_key.as_bytes())
            }
            None => !constant_time_eq(secret_key.as_bytes(), secret_key.as_bytes()),
        };
        let Some((secret, user)) = found.filter(|_| matches) else {
            let mut f = self.failures.lock().expect("login failures");
            if f.len() >= MAX_SESSIONS * 16 {
                // Guessing from a great many addresses: the table is bounded.
                f.clear();
            }
            let e = f.entry(client).or_insert((Instant::now(), 0));
            e.1 += 1;
            tracing::warn!(%client, access_key, "console login refused: wrong access key or secret");
            return Err((401, "wrong access key or secret".into()));
        };
        drop(secret);
        let now = Instant::now();
        let session = Session {
            access_key: access_key.to_string(),
            root: &*user == "root",
            user: user.to_string(),
            csrf: random_hex(32),
            created: now,
            last: now,
        };
        let id = random_hex(32);
        let mut s = self.sessions.lock().expect("sessions");
        s.retain(|_, v| v.last.elapsed() < IDLE && v.created.elapsed() < LIFETIME);
        if s.len() >= MAX_SESSIONS {
            // The oldest goes: a flood of logins cannot grow this forever.
            if let Some(oldest) = s
                .iter()
                .min_by_key(|(_, v)| v.created)
                .map(|(k, _)| k.clone())
            {
                s.remove(&oldest);
            }
        }
        s.insert(id.clone(), session.clone());
        tracing::info!(%client, user = %session.user, "console login");
        Ok((id, session))
    }

    /// The live session a request's cookie names (its idle time restarts),
    /// if its access key still works.
    fn session(&self, h: &http::HeaderMap, iam: &Iam) -> Option<(String, Session)> {
        let id = cookie_id(h)?;
        let mut s = self.sessions.lock().expect("sessions");
        let live = s
            .get(&id)
            .is_some_and(|v| v.last.elapsed() < IDLE && v.created.elapsed() < LIFETIME);
        let key_works = live
            && s.get(&id)
                .is_some_and(|v| matches!(iam.user_of(&v.access_key), Ok(Some(_))));
        if !key_works {
            s.remove(&id);
            return None;
        }
        let v = s.get_mut(&id)?;
        v.last = Instant::now();
        Some((id, v.clone()))
    }

    fn series(&self) -> serde_json::Value {
        let s = self.samples.lock().expect("samples");
        let points: Vec<serde_json::Value> = s
            .iter()
            .zip(s.iter().skip(1))
            .map(|(a, b)| {
                let secs = (b.unix_ms.saturating_sub(a.unix_ms)) as f64 / 1000.0;
                let per_s = |x: u64, y: u64| {
                    if secs > 0.0 {
                        y.saturating_sub(x) as f64 / secs
                    } else {
                        0.0
                    }
                };
                let n = b.totals.requests.saturating_sub(a.totals.requests);
                // The bound under which 50% and 99% of the interval's
                // requests finished (None: no request).
                let quantile = |q: f64| -> Option<f64> {
                    if n == 0 {
                        return None;
                    }
                    let want = (q * n as f64).ceil() as u64;
                    LATENCY_BOUNDS_S
                        .iter()
                        .enumerate()
                        .find(|(i, _)| {
                            b.totals.latency_le[*i].saturating_sub(a.totals.latency_le[*i]) >= want
                        })
                        .map(|(_, bound)| *bound)
                        .or(Some(f64::INFINITY))
                        .map(|v| if v.is_finite() { v } else { 10.0 })
                };
                serde_json::json!({
                    "unix_ms": b.unix_ms,
                    "requests_per_s": per_s(a.totals.requests, b.totals.requests),
                    "errors_per_s": per_s(a.totals.errors, b.totals.errors),
                    "bytes_in_per_s": per_s(a.totals.bytes_in, b.totals.bytes_in),
                    "bytes_out_per_s": per_s(a.totals.bytes_out, b.totals.bytes_out),
                    "latency_p50_s": quantile(0.5),
                    "latency_p99_s": quantile(0.99),
                })
            })
            .collect();
        serde_json::json!({ "every_s": SAMPLE_EVERY.as_secs(), "points": points })
    }
}

/// Headers every console answer carries.
fn harden(r: &mut http::Response<s3s::Body>) {
    let h = r.headers_mut();
    for (k, v) in [
        ("cache-control", "no-store"),
        ("x-content-type-options", "nosniff"),
        ("x-frame-options", "DENY"),
        ("referrer-policy", "no-referrer"),
        (
            "content-security-policy",
            "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
        ),
    ] {
        h.insert(k, http::HeaderValue::from_static(v));
    }
}

fn set_cookie(r: &mut http::Response<s3s::Body>, value: &str, max_age: u64, secure: bool) {
    let secure = if secure { "; Secure" } else { "" };
    if let Ok(v) = http::HeaderValue::from_str(&format!(
        "{COOKIE}={value}; Path=/console; HttpOnly; SameSite=Strict; Max-Age={max_age}{secure}"
    )) {
        r.headers_mut().insert(http::header::SET_COOKIE, v);
    }
}

/// Whether a request that changes something may: the session's CSRF token
/// in its header, and its Origin (if any) this console's own.
fn csrf_ok(req: &http::Request<Incoming>, session: &Session, secure: bool) -> bool {
    let h = req.headers();
    let token = h
        .get(CSRF_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !constant_time_eq(token.as_bytes(), session.csrf.as_bytes()) {
        return false;
    }
    match h.get(http::header::ORIGIN).and_then(|v| v.to_str().ok()) {
        None => true,
        Some(origin) => {
            let host = h
                .get(http::header::HOST)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            let scheme = if secure { "https" } else { "http" };
            origin == format!("{scheme}://{host}")
        }
    }
}

fn reads_only(m: &http::Method) -> bool {
    matches!(*m, http::Method::GET | http::Method::HEAD)
}

/// What the console needs of the admin port.
pub struct Ctx<'a> {
    pub console: &'a Arc<Console>,
    pub iam: &'a Arc<Iam>,
    pub client: IpAddr,
    pub s3: SocketAddr,
    pub region: &'a str,
    /// TLS to the S3 listener, when it is TLS.
    pub s3_tls: Option<&'a tarn_io::tls::tokio_rustls::TlsConnector>,
    /// Whether this connection is TLS: the cookie is then `Secure`, and
    /// only an `https://` Origin is this console's.
    pub secure: bool,
}

pub enum Routed {
    /// Answered here.
    Done(http::Response<s3s::Body>),
    /// The admin API, for a root session: the request rewritten to its
    /// `/admin/…` (or `/metrics`, `/health/…`) path, to be answered as if
    /// it carried the admin token.
    Admin(http::Request<Incoming>),
}

pub async fn handle(req: http::Request<Incoming>, ctx: Ctx<'_>) -> Routed {
    let path = req.uri().path().to_string();
    let mut r = match (req.method().as_str(), path.as_str()) {
        ("GET", "/console" | "/console/") => {
            text(200, "text/html; charset=utf-8", INDEX_HTML.into())
        }
        ("GET", "/console/app.js") => text(200, "text/javascript; charset=utf-8", APP_JS.into()),
        ("GET", "/console/app.css") => text(200, "text/css; charset=utf-8", APP_CSS.into()),
        ("POST", "/console/login") => login(req, &ctx).await,
        ("GET", "/console/session") => match ctx.console.session(req.headers(), ctx.iam) {
            Some((_, s)) => json(200, s.json()),
            None => json(401, serde_json::json!({ "error": "not logged in" })),
        },
        ("POST", "/console/logout") => match ctx.console.session(req.headers(), ctx.iam) {
            Some((id, s)) if csrf_ok(&req, &s, ctx.secure) => {
                ctx.console.sessions.lock().expect("sessions").remove(&id);
                let mut r = json(200, serde_json::json!({ "logged_out": true }));
                set_cookie(&mut r, "", 0, ctx.secure);
                r
            }
            Some(_) => json(
                403,
                serde_json::json!({ "error": "missing or wrong CSRF token" }),
            ),
            None => json(401, serde_json::json!({ "error": "not logged in" })),
        },
        _ if path.starts_with("/console/api/") => {
            let Some((_, session)) = ctx.console.session(req.headers(), ctx.iam) else {
                let mut r = json(
                    401,
                    serde_json::json!({ "error": "not logged in (or the session ended)" }),
                );
                harden(&mut r);
                return Routed::Done(r);
            };
            if !reads_only(req.method()) && !csrf_ok(&req, &session, ctx.secure) {
                json(
                    403,
                    serde_json::json!({ "error": "missing or wrong CSRF token" }),
                )
            } else if path == "/console/api/series" {
                if session.root {
                    json(200, ctx.console.series())
                } else {
                    json(
                        403,
                        serde_json::json!({ "error": "the node's activity is root's" }),
                    )
                }
            } else if let Some(rest) = path.strip_prefix("/console/api/s3") {
                let rest = if rest.is_empty() { "/" } else { rest };
                s3_forward(req, rest.to_string(), &session, &ctx).await
            } else if let Some(rest) = path.strip_prefix("/console/api/admin") {
                if !session.root {
                    json(
                        403,
                        serde_json::json!({ "error": "the admin API is root's: log in with root's access key" }),
                    )
                } else {
                    let target = match rest {
                        "/metrics" | "/health/live" | "/health/ready" => rest.to_string(),
                        _ => format!("/admin{rest}"),
                    };
                    let (mut parts, body) = req.into_parts();
                    let pq = match parts.uri.query() {
                        Some(q) => format!("{target}?{q}"),
                        None => target,
                    };
                    match pq.parse() {
                        Ok(uri) => {
                            parts.uri = uri;
                            return Routed::Admin(http::Request::from_parts(parts, body));
                        }
                        Err(_) => json(400, serde_json::json!({ "error": "a malformed path" })),
                    }
                }
            } else {
                json(404, serde_json::json!({ "error": "not found" }))
            }
        }
        _ => text(404, "text/plain", "not found\n".into()),
    };
    harden(&mut r);
    Routed::Done(r)
}

async fn login(req: http::Request<Incoming>, ctx: &Ctx<'_>) -> http::Response<s3s::Body> {
    let body = match http_body_util::Limited::new(req.into_body(), 4096)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return json(
                413,
                serde_json::json!({ "error": "a login is a small JSON document" }),
            )
        }
    };
    #[derive(serde::Deserialize)]
    struct Login {
        access_key: String,
        secret_key: String,
    }
    let Ok(l) = serde_json::from_slice::<Login>(&body) else {
        return json(
            400,
            serde_json::json!({ "error": "expected {\"access_key\": …, \"secret_key\": …}" }),
        );
    };
    match ctx
        .console
        .login(ctx.iam, ctx.client, &l.access_key, &l.secret_key)
    {
        Ok((id, s)) => {
            let mut r = json(200, s.json());
            set_cookie(&mut r, &id, LIFETIME.as_secs(), ctx.secure);
            r
        }
        Err((status, msg)) => json(status, serde_json::json!({ "error": msg })),
    }
}

/// Request headers passed on to S3 (the rest are the browser's own).
const S3_REQUEST_HEADERS: &[&str] = &[
    "content-type",
    "content-length",
    "content-md5",
    "content-disposition",
    "range",
    "if-match",
    "if-none-match",
];

/// Answer headers passed back.
const S3_ANSWER_HEADERS: &[&str] = &[
    "content-type",
    "content-length",
    "content-range",
    "etag",
    "last-modified",
    "accept-ranges",
];

/// Forwards a request to this node's S3 endpoint, signed as the session's
/// access key; the answer (status, body, the headers a browser needs and
/// S3's own `x-amz-*`) comes back as it is.
async fn s3_forward(
    req: http::Request<Incoming>,
    path: String,
    session: &Session,
    ctx: &Ctx<'_>,
) -> http::Response<s3s::Body> {
    let secret = match ctx.iam.secret_of(&session.access_key) {
        Ok(Some(s)) => s.expose().to_string(),
        _ => {
            return json(
                401,
                serde_json::json!({ "error": "the session's access key no longer works" }),
            )
        }
    };
    let signer = tarn_client::sigv4::Signer {
        access_key: session.access_key.clone(),
        secret_key: secret,
        region: ctx.region.to_string(),
        session_token: None,
    };
    let host = ctx.s3.to_string();
    let query: Vec<(String, String)> = req
        .uri()
        .query()
        .map(|q| {
            q.split('&')
                .filter(|kv| !kv.is_empty())
                .map(|kv| {
                    let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                    let d = |s: &str| {
                        tarn_s3::post::percent_decode(&s.replace('+', "%20")).unwrap_or_default()
                    };
                    (d(k), d(v))
                })
                .collect()
        })
        .unwrap_or_default();
    let Some(decoded_path) = tarn_s3::post::percent_decode(&path) else {
        return json(400, serde_json::json!({ "error": "a malformed path" }));
    };
    let pairs: Vec<(&str, &str)> = query
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let signed = signer.sign(
        req.method().as_str(),
        &host,
        &decoded_path,
        &pairs,
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    );
    let uri = match req.uri().query() {
        Some(q) => format!("http://{host}{path}?{q}"),
        None => format!("http://{host}{path}"),
    };
    let (parts, body) = req.into_parts();
    let mut out = http::Request::builder()
        .method(parts.method.clone())
        .uri(&uri);
    for name in S3_REQUEST_HEADERS {
        if let Some(v) = parts.headers.get(*name) {
            out = out.header(*name, v);
        }
    }
    out = out.header(http::header::HOST, &host);
    for (k, v) in signed {
        out = out.header(k, v);
    }
    let Ok(out) = out.body(body) else {
        return json(
            400,
            serde_json::json!({ "error": "a request that cannot be forwarded" }),
        );
    };
    let stream = match tokio::net::TcpStream::connect(ctx.s3).await {
        Ok(s) => s,
        Err(e) => {
            return json(
                502,
                serde_json::json!({ "error": format!("the S3 endpoint: {e}") }),
            )
        }
    };
    let stream: Box<dyn S3Stream> = match ctx.s3_tls {
        None => Box::new(stream),
        Some(tls) => {
            let name = rustls_name(ctx.s3);
            match tls.connect(name, stream).await {
                Ok(s) => Box::new(s),
                Err(e) => {
                    return json(
                        502,
                        serde_json::json!({ "error": format!("the S3 endpoint (TLS): {e}") }),
                    )
                }
            }
        }
    };
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await {
            Ok(x) => x,
            Err(e) => {
                return json(
                    502,
                    serde_json::json!({ "error": format!("the S3 endpoint: {e}") }),
                )
            }
        };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let answer = match sender.send_request(out).await {
        Ok(a) => a,
        Err(e) => {
            return json(
                502,
                serde_json::json!({ "error": format!("the S3 endpoint: {e}") }),
            )
        }
    };
    let (aparts, abody) = answer.into_parts();
    let mut r = http::Response::new(s3s::Body::http_body_unsync(abody));
    *r.status_mut() = aparts.status;
    for (k, v) in aparts.headers.iter() {
        let name = k.as_str();
        if S3_ANSWER_HEADERS.contains(&name) || name.starts_with("x-amz-") {
            r.headers_mut().append(k.clone(), v.clone());
        }
    }
    r
}

/// The S3 connection of a console call, plain or TLS.
trait S3Stream: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> S3Stream for T {}

/// The name sent in the console's TLS hello to its own S3 listener (its
/// certificate is checked to be this node's own, whatever names it has).
fn rustls_name(addr: SocketAddr) -> tarn_io::tls::rustls::pki_types::ServerName<'static> {
    tarn_io::tls::rustls::pki_types::ServerName::IpAddress(addr.ip().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_session_cookie_is_found_among_others() {
        let mut h = http::HeaderMap::new();
        h.insert(
            http::header::COOKIE,
            http::HeaderValue::from_static("a=1; tarn_console=abc; b=2"),
        );
        assert_eq!(cookie_id(&h).as_deref(), Some("abc"));
        h.insert(
            http::header::COOKIE,
            http::HeaderValue::from_static("tarn_consoleX=1"),
        );
        assert_eq!(cookie_id(&h), None);
    }
}
