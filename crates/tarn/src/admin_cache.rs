//! The admin API of cache buckets (`/admin/cache/...`, docs/cache.md):
//! add, list, remove and status. `tarn admin cache` calls these.

use std::sync::Arc;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use tarn_cluster::node::Node;
use tarn_s3::cache::{CacheError, CacheSpec, Caches, PrefetchSpec};

use crate::admin::{json, text};

/// Largest request body of the cache API (settings as JSON).
const BODY_MAX_BYTES: usize = 64 << 10;

fn error(e: CacheError) -> http::Response<s3s::Body> {
    let status = match &e {
        CacheError::Invalid(_) => 400,
        CacheError::NoSuchCache(_) => 404,
        CacheError::Exists(_) => 409,
        CacheError::Store(tarn_store::StoreError::InvalidBucketName(_)) => 400,
        CacheError::Store(_) | CacheError::Upstream(_) | CacheError::Busy(_) => 503,
        _ => 500,
    };
    json(status, serde_json::json!({ "error": e.to_string() }))
}

#[derive(serde::Deserialize)]
struct PrefixArg {
    #[serde(default)]
    prefix: Option<String>,
    #[serde(default)]
    ttl: Option<u64>,
}

/// A request's body (at most BODY_MAX_BYTES), or the answer that refuses it.
pub(crate) async fn body_bytes(
    req: http::Request<Incoming>,
) -> Result<bytes::Bytes, http::Response<s3s::Body>> {
    Ok(
        http_body_util::Limited::new(req.into_body(), BODY_MAX_BYTES)
            .collect()
            .await
            .map_err(|e| {
                json(
                    400,
                    serde_json::json!({ "error": format!("request body: {e}") }),
                )
            })?
            .to_bytes(),
    )
}

/// A request's JSON body, or the answer that refuses it.
async fn body_of<T: serde::de::DeserializeOwned>(
    req: http::Request<Incoming>,
) -> Result<T, http::Response<s3s::Body>> {
    let body = body_bytes(req).await?;
    serde_json::from_slice(&body)
        .map_err(|e| json(400, serde_json::json!({ "error": format!("request: {e}") })))
}

pub async fn handle(
    req: http::Request<Incoming>,
    caches: &Caches,
    node: Option<&Arc<Node>>,
) -> http::Response<s3s::Body> {
    let method = req.method().as_str().to_string();
    let path = req.uri().path().to_string();
    let rest: Vec<&str> = path
        .trim_start_matches("/admin/cache")
        .trim_matches('/')
        .split('/')
        .filter(|s| !s.is_empty())
        .collect();
    let mut r = match (method.as_str(), rest.as_slice()) {
        ("GET", []) | ("GET", ["buckets"]) => json(
            200,
            serde_json::Value::Array(caches.all().iter().map(|b| b.summary()).collect()),
        ),
        ("GET", ["status"]) => json(
            200,
            serde_json::Value::Array(caches.all().iter().map(|b| b.status()).collect()),
        ),
        ("POST", ["buckets", name]) => match body_of::<CacheSpec>(req).await {
            Err(r) => r,
            Ok(spec) => match caches.add(name, spec).await {
                Ok(v) => json(200, v),
                Err(e) => error(e),
            },
        },
        ("POST", ["buckets", name, action @ ("pin" | "unpin" | "drop")]) => {
            let arg = match body_of::<PrefixArg>(req).await {
                Err(r) => return r,
                Ok(a) => a,
            };
            let prefix = arg.prefix.unwrap_or_default();
            let r = match *action {
                "pin" => caches
                    .pin(name, &prefix, arg.ttl)
                    .await
                    .map(|pins| serde_json::json!({ "bucket": name, "pins": pins })),
                "unpin" => caches
                    .unpin(name, &prefix)
                    .await
                    .map(|pins| serde_json::json!({ "bucket": name, "pins": pins })),
                _ => match caches.get(name) {
                    None => Err(CacheError::NoSuchCache(name.to_string())),
                    Some(b) => b.drop_prefix(&prefix).await.map(|(objects, bytes)| {
                        serde_json::json!({ "bucket": name, "prefix": prefix, "objects_dropped": objects, "bytes_dropped": bytes })
                    }),
                },
            };
            match r {
                Ok(v) => json(200, v),
                Err(e) => error(e),
            }
        }
        ("POST", ["buckets", name, "prefetch"]) => match body_of::<PrefetchSpec>(req).await {
            Err(r) => r,
            Ok(spec) => match caches.prefetch(name, spec) {
                Ok(job) => json(200, job.json()),
                Err(e) => error(e),
            },
        },
        ("GET", ["jobs"]) => json(
            200,
            serde_json::Value::Array(caches.jobs().iter().map(|j| j.json()).collect()),
        ),
        ("GET", ["jobs", id]) => match caches.job(id) {
            Some(j) => json(200, j.json()),
            None => json(
                404,
                serde_json::json!({ "error": format!("no cache job {id}") }),
            ),
        },
        ("DELETE", ["buckets", name]) => match caches.remove(name).await {
            Ok(v) => json(200, v),
            Err(e) => error(e),
        },
        _ => text(404, "text/plain", "not found\n".into()),
    };
    if method != "GET" {
        crate::admin::confirm_everywhere(&mut r, node, "a cache bucket change").await;
    }
    r
}
