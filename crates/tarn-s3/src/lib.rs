//! `tarn-s3` is the S3 front: it turns each HTTP request (parsed and
//! authenticated by `s3s`: SigV4 headers, presigned URLs, aws-chunked bodies with
//! trailing checksums) into one typed S3 operation and calls the object engine.
//!
//! It must never touch drives or formats itself: everything durable goes through
//! `tarn-store`. One function (`error::s3_error`) maps engine errors to S3 codes.
//! It may call `tarn-store` and `tarn-io`.

pub mod access;
pub mod acl;
pub mod body;
pub mod cache;
pub mod cors;
pub mod error;
pub mod iam;
pub mod lifecycle;
pub mod ops;
mod ops_access;
mod ops_attributes;
mod ops_bucket;
mod ops_cache;
pub mod ops_lock;
mod ops_sse;
pub mod policy;
pub mod post;
pub mod scope;
pub mod sse;
pub mod sysdoc;
pub mod util;

use std::sync::Arc;

use s3s::auth::{S3Auth, SecretKey};
use s3s::host::{S3Host, VirtualHost};
use s3s::service::{S3Service, S3ServiceBuilder};
use s3s::S3Result;
use tarn_store::Store;

pub use ops::TarnS3;

/// Settings of the S3 front.
#[derive(Debug, Clone)]
pub struct S3Settings {
    pub region: String,
    /// Base domains for virtual-host-style requests (`bucket.<domain>`).
    pub domains: Vec<String>,
    /// Server-side encryption's master and KMS keys.
    pub keys: Arc<sse::KeyRing>,
}

/// Access keys: the bootstrap credentials and every user's (`iam`).
struct Keys {
    iam: Arc<iam::Iam>,
}

#[async_trait::async_trait]
impl S3Auth for Keys {
    async fn get_secret_key(&self, access_key: &str) -> S3Result<SecretKey> {
        match self.iam.secret_of(access_key) {
            Ok(Some(secret)) => Ok(secret),
            Ok(None) => Err(s3s::S3Error::with_message(
                s3s::S3ErrorCode::InvalidAccessKeyId,
                "The AWS Access Key Id you provided does not exist in our records.",
            )),
            Err(e) => Err(s3s::S3Error::with_message(
                s3s::S3ErrorCode::ServiceUnavailable,
                e.to_string(),
            )),
        }
    }
}

/// Virtual-host and path-style addressing: a Host of `bucket.<domain>` names the
/// bucket; any other Host (an IP, the bare domain) means path style.
struct Hosts {
    domains: Vec<String>,
}

impl S3Host for Hosts {
    fn parse_host_header<'a>(&'a self, host: &'a str) -> S3Result<VirtualHost<'a>> {
        let name = host
            .rsplit_once(':')
            .filter(|(_, p)| p.chars().all(|c| c.is_ascii_digit()))
            .map_or(host, |(h, _)| h);
        for d in &self.domains {
            if let Some(bucket) = name
                .strip_suffix(d.as_str())
                .and_then(|b| b.strip_suffix('.'))
            {
                if !bucket.is_empty() {
                    return Ok(VirtualHost::new(d.as_str()).with_bucket(bucket));
                }
            }
        }
        Ok(VirtualHost::new(name))
    }
}

/// The largest file a form upload (POST Object) may carry.
pub const POST_OBJECT_MAX_BYTES: u64 = 128 << 20;

pub fn build_service(
    store: Arc<Store>,
    access: Arc<access::Access>,
    settings: &S3Settings,
) -> S3Service {
    let iam = access.iam.clone();
    let mut b = S3ServiceBuilder::new(
        TarnS3::new(store, access.clone(), settings.region.clone())
            .with_keys(settings.keys.clone()),
    );
    b.set_auth(Keys { iam });
    b.set_access(access::Checker(access));
    b.set_host(Hosts {
        domains: settings.domains.clone(),
    });
    // s3s reads a form upload's file whole into memory before it is
    // stored: bounded well below its 5 GB default (larger browser uploads
    // go in parts, with presigned UploadPart URLs).
    let mut config = s3s::config::S3Config::default();
    config.post_object_max_file_size = POST_OBJECT_MAX_BYTES;
    b.set_config(Arc::new(s3s::config::StaticConfigProvider::new(Arc::new(
        config,
    ))));
    b.build()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_parsing() {
        let h = Hosts {
            domains: vec!["localhost".into(), "s3.example.com".into()],
        };
        assert_eq!(
            h.parse_host_header("b1.localhost:9000").unwrap().bucket(),
            Some("b1")
        );
        assert_eq!(
            h.parse_host_header("localhost:9000").unwrap().bucket(),
            None
        );
        assert_eq!(
            h.parse_host_header("127.0.0.1:9000").unwrap().bucket(),
            None
        );
        assert_eq!(
            h.parse_host_header("my.bucket.s3.example.com")
                .unwrap()
                .bucket(),
            Some("my.bucket")
        );
    }
}
