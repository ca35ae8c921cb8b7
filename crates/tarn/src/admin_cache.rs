//! The admin API of cache buckets (`/admin/cache/...`, docs/cache.md):
//! add, list, remove and status. `tarn admin cache` calls these.

use std::sync::Arc;

use http_body_util::BodyExt;
use hyper::body::Incoming;
use tarn_cluster::node::Node;
use tarn_s3::cache::{CacheError, CacheSpec, Caches};

use crate::admin::{json, text};

/// Largest request body of the cache API (settings as JSON).
const BODY_MAX_BYTES: usize = 64 << 10;

fn error(e: CacheError) -> http::Response<s3s::Body> {
    let status = match &e {
        CacheError::Invalid(_) => 400,
        CacheError::NoSuchCache(_) => 404,
        CacheError::Exists(_) => 409,
        CacheError::Store(tarn_store::StoreError::InvalidBucketName(_)) => 400,
        CacheError::Store(_) | CacheError::Upstream(_) => 503,
        _ => 500,
    };
    json(status, serde_json::json!({ "error": e.to_string() }))
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
        ("POST", ["buckets", name]) => {
            let name = name.to_string();
            let body = match http_body_util::Limited::new(req.into_body(), BODY_MAX_BYTES)
                .collect()
                .await
            {
                Ok(b) => b.to_bytes(),
                Err(e) => {
                    return json(
                        400,
                        serde_json::json!({ "error": format!("request body: {e}") }),
                    )
                }
            };
            match serde_json::from_slice::<CacheSpec>(&body) {
                Err(e) => json(
                    400,
                    serde_json::json!({ "error": format!("cache settings: {e}") }),
                ),
                Ok(spec) => match caches.add(&name, spec).await {
                    Ok(v) => json(200, v),
                    Err(e) => error(e),
                },
            }
        }
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
