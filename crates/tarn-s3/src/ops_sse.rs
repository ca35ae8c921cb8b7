//! Server-side encryption in the operations: sealing writes, reading with the
//! right key, and the bucket's default encryption (Get/Put/DeleteBucketEncryption).

use std::sync::Mutex;

use s3s::dto::*;
use s3s::{S3Error, S3ErrorCode, S3Request, S3Response, S3Result};
use tarn_store::seal::{DataKey, SealSpec};
use tarn_store::{ByteRange, GetResult, ObjectInfo, ReadConditions, StoreError};

use crate::error::s3_error;
use crate::ops::TarnS3;
use crate::sse::{self, Asked, BucketEncryption, CustomerKey, Sealing, Target};

impl TarnS3 {
    /// How a write of bucket/key is encrypted: as the request asks, else
    /// as the bucket's default says; None for plaintext.
    pub(crate) fn sealing(
        &self,
        ext: &http::Extensions,
        headers: &http::HeaderMap,
        bucket: &str,
        key: &str,
    ) -> S3Result<Option<Sealing>> {
        let asked = sse::asked(headers)?;
        let b = self.bucket_access(ext, bucket)?;
        self.keys.seal_for(
            &asked,
            b.doc.encryption.as_ref(),
            &Target {
                bucket,
                key,
                bucket_created_ns: b.doc.created_ns(),
            },
        )
    }

    /// The data key of an object or upload with these stored headers, for a
    /// request that sent `customer`.
    pub(crate) fn data_key_of(
        &self,
        ext: &http::Extensions,
        stored: &[(String, String)],
        customer: Option<&CustomerKey>,
        bucket: &str,
        key: &str,
    ) -> S3Result<Option<DataKey>> {
        let created = self.bucket_access(ext, bucket)?.doc.created_ns();
        self.keys.data_key(stored, customer, bucket, key, created)
    }

    /// The engine's sealing of an UploadPart or UploadPartCopy: the upload's
    /// data key (the customer's key unwraps it for SSE-C), and the
    /// encryption headers of the answer. A part cannot choose its own
    /// encryption: `x-amz-server-side-encryption*` on it is refused, never
    /// ignored (the upload's applies).
    pub(crate) async fn part_sealing(
        &self,
        ext: &http::Extensions,
        headers: &http::HeaderMap,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> S3Result<(Option<SealSpec>, Vec<(&'static str, String)>)> {
        sse::refuse_on_part(headers)?;
        let customer = sse::customer_key(headers, false)?;
        let upload_headers = self
            .store
            .upload_headers(bucket, key, upload_id)
            .await
            .map_err(s3_error)?;
        let dk = self.data_key_of(ext, &upload_headers, customer.as_ref(), bucket, key)?;
        let seal = dk.map(|key| SealSpec {
            key,
            keyed_etag: upload_headers
                .iter()
                .any(|(k, v)| k == sse::MODE_HEADER && v != sse::AES256),
        });
        Ok((
            seal,
            sse::response_headers(&upload_headers, customer.as_ref()),
        ))
    }

    /// A GET of bucket/key that decrypts an encrypted version with its key
    /// (the customer's when the request sent one). A customer key sent for
    /// an object not encrypted with one is refused, as AWS does.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn get_decrypted(
        &self,
        ext: &http::Extensions,
        bucket: &str,
        key: &str,
        version: Option<&str>,
        range: Option<ByteRange>,
        part_number: Option<u32>,
        conditions: &ReadConditions,
        customer: Option<&CustomerKey>,
    ) -> Result<GetResult, Refused> {
        let created = self
            .bucket_access(ext, bucket)
            .map_err(Refused::S3)?
            .doc
            .created_ns();
        let refusal: Mutex<Option<S3Error>> = Mutex::new(None);
        let unseal = |info: &ObjectInfo| -> Result<DataKey, StoreError> {
            match self
                .keys
                .data_key(&info.headers, customer, bucket, key, created)
            {
                Ok(Some(k)) => Ok(k),
                Ok(None) => {
                    *refusal.lock().expect("lock") = Some(S3Error::with_message(
                        S3ErrorCode::InternalError,
                        "The object is encrypted but its metadata holds no wrapped key.",
                    ));
                    Err(StoreError::InvalidRequest("encryption".into()))
                }
                Err(e) => {
                    *refusal.lock().expect("lock") = Some(e);
                    Err(StoreError::InvalidRequest("encryption".into()))
                }
            }
        };
        let got = self
            .store
            .get_object_with(
                bucket,
                key,
                version,
                range,
                part_number,
                conditions,
                &unseal,
            )
            .await;
        let refused = refusal.lock().expect("lock").take();
        match got {
            Err(e) => Err(match refused {
                Some(s3) => Refused::S3(s3),
                None => Refused::Store(e),
            }),
            Ok(g) => {
                if customer.is_some() && !sse::is_customer(&g.info) {
                    return Err(Refused::S3(S3Error::with_message(
                        S3ErrorCode::InvalidRequest,
                        "The encryption parameters are not applicable to this object.",
                    )));
                }
                Ok(g)
            }
        }
    }

    /// HEAD (and GetObjectAttributes) of an SSE-C object need its key, as
    /// GET does; a customer key for another object is refused.
    pub(crate) fn check_customer_key(
        &self,
        ext: &http::Extensions,
        info: &ObjectInfo,
        customer: Option<&CustomerKey>,
    ) -> S3Result<()> {
        if customer.is_some() || sse::is_customer(info) {
            self.data_key_of(ext, &info.headers, customer, &info.bucket, &info.key)?;
        }
        Ok(())
    }

    pub(crate) async fn op_get_bucket_encryption(
        &self,
        req: S3Request<GetBucketEncryptionInput>,
    ) -> S3Result<S3Response<GetBucketEncryptionOutput>> {
        let b = self.bucket_access(&req.extensions, &req.input.bucket)?;
        let Some(e) = &b.doc.encryption else {
            let mut err = S3Error::with_message(
                S3ErrorCode::ServerSideEncryptionConfigurationNotFoundError,
                "The server side encryption configuration was not found",
            );
            err.set_status_code(http::StatusCode::NOT_FOUND);
            return Err(err);
        };
        Ok(S3Response::new(GetBucketEncryptionOutput {
            server_side_encryption_configuration: Some(ServerSideEncryptionConfiguration {
                rules: vec![ServerSideEncryptionRule {
                    apply_server_side_encryption_by_default: Some(ServerSideEncryptionByDefault {
                        kms_master_key_id: e.kms_key.clone(),
                        sse_algorithm: ServerSideEncryption::from(e.algorithm.clone()),
                    }),
                    bucket_key_enabled: Some(e.bucket_key),
                }],
            }),
        }))
    }

    pub(crate) async fn op_put_bucket_encryption(
        &self,
        req: S3Request<PutBucketEncryptionInput>,
    ) -> S3Result<S3Response<PutBucketEncryptionOutput>> {
        let i = req.input;
        let e = self.bucket_encryption_of(&i.server_side_encryption_configuration)?;
        self.access
            .update(&i.bucket, |d| {
                d.encryption = Some(e);
                Ok(())
            })
            .await?;
        Ok(S3Response::new(PutBucketEncryptionOutput {}))
    }

    pub(crate) async fn op_delete_bucket_encryption(
        &self,
        req: S3Request<DeleteBucketEncryptionInput>,
    ) -> S3Result<S3Response<DeleteBucketEncryptionOutput>> {
        self.access
            .update(&req.input.bucket, |d| {
                d.encryption = None;
                Ok(())
            })
            .await?;
        Ok(S3Response::new(DeleteBucketEncryptionOutput {}))
    }

    /// A bucket default as PutBucketEncryption sends it, checked against the
    /// keys this server has: a default new objects could not get is refused
    /// now, not at their PUT.
    fn bucket_encryption_of(
        &self,
        c: &ServerSideEncryptionConfiguration,
    ) -> S3Result<BucketEncryption> {
        let malformed = |m: &str| S3Error::with_message(S3ErrorCode::MalformedXML, m.to_string());
        let [rule] = c.rules.as_slice() else {
            return Err(malformed(
                "A server-side encryption configuration has exactly one rule.",
            ));
        };
        let Some(d) = &rule.apply_server_side_encryption_by_default else {
            return Err(malformed(
                "The rule needs ApplyServerSideEncryptionByDefault.",
            ));
        };
        let algorithm = d.sse_algorithm.as_str().to_string();
        let bucket_key = rule.bucket_key_enabled.unwrap_or(false);
        match algorithm.as_str() {
            sse::AES256 => {
                if d.kms_master_key_id.is_some() {
                    return Err(S3Error::with_message(
                        S3ErrorCode::InvalidArgument,
                        "a KMSMasterKeyID is only allowed with aws:kms",
                    ));
                }
                // Checked now: the default must be one new objects can get.
                self.keys
                    .seal_for(&Asked::S3, None, &probe_target())
                    .map(|_| ())?;
            }
            sse::KMS => {
                let asked = Asked::Kms {
                    key: d.kms_master_key_id.clone(),
                    context: None,
                    bucket_key: Some(bucket_key),
                };
                self.keys.seal_for(&asked, None, &probe_target())?;
            }
            other => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    format!("The encryption method {other} is not supported: AES256 or aws:kms."),
                ))
            }
        }
        let kms_key = match &d.kms_master_key_id {
            Some(k) => Some(self.keys.kms_key_named(k)?),
            None => None,
        };
        Ok(BucketEncryption {
            algorithm,
            kms_key,
            bucket_key,
        })
    }
}

fn probe_target() -> Target<'static> {
    Target {
        bucket: "",
        key: "",
        bucket_created_ns: 0,
    }
}

/// Why an encrypted read was refused: the S3 layer's judgement (keys) or the
/// engine's error.
pub(crate) enum Refused {
    S3(S3Error),
    Store(StoreError),
}

impl Refused {
    pub(crate) fn into_s3(self) -> S3Error {
        match self {
            Refused::S3(e) => e,
            Refused::Store(e) => s3_error(e),
        }
    }
}
