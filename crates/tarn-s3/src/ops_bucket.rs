//! Bucket settings that are documents of their own: tags, and the logging
//! and request-payment settings Tarn answers as a bucket that has neither
//! (it refuses to turn them on, never ignores them).

use s3s::dto::*;
use s3s::{S3Error, S3ErrorCode, S3Request, S3Response, S3Result};

use crate::ops::TarnS3;
use crate::util::check_bucket_tags;

impl TarnS3 {
    pub(crate) async fn op_get_bucket_tagging(
        &self,
        req: S3Request<GetBucketTaggingInput>,
    ) -> S3Result<S3Response<GetBucketTaggingOutput>> {
        let b = self.bucket_access(&req.extensions, &req.input.bucket)?;
        if b.doc.tags.is_empty() {
            let mut e = S3Error::with_message(
                S3ErrorCode::Custom("NoSuchTagSet".into()),
                "The TagSet does not exist",
            );
            e.set_status_code(http::StatusCode::NOT_FOUND);
            return Err(e);
        }
        Ok(S3Response::new(GetBucketTaggingOutput {
            tag_set: b
                .doc
                .tags
                .iter()
                .map(|(k, v)| Tag {
                    key: Some(k.clone()),
                    value: Some(v.clone()),
                })
                .collect(),
        }))
    }

    pub(crate) async fn op_put_bucket_tagging(
        &self,
        req: S3Request<PutBucketTaggingInput>,
    ) -> S3Result<S3Response<PutBucketTaggingOutput>> {
        let i = req.input;
        let tags = crate::util::tag_pairs(i.tagging.tag_set);
        check_bucket_tags(&tags)?;
        self.access
            .update(&i.bucket, |d| {
                d.tags = tags;
                Ok(())
            })
            .await?;
        Ok(S3Response::new(PutBucketTaggingOutput {}))
    }

    pub(crate) async fn op_delete_bucket_tagging(
        &self,
        req: S3Request<DeleteBucketTaggingInput>,
    ) -> S3Result<S3Response<DeleteBucketTaggingOutput>> {
        self.access
            .update(&req.input.bucket, |d| {
                d.tags.clear();
                Ok(())
            })
            .await?;
        Ok(S3Response::new(DeleteBucketTaggingOutput {}))
    }

    /// Server access logging is never on: the answer of a bucket without
    /// it.
    pub(crate) async fn op_get_bucket_logging(
        &self,
        req: S3Request<GetBucketLoggingInput>,
    ) -> S3Result<S3Response<GetBucketLoggingOutput>> {
        self.bucket_access(&req.extensions, &req.input.bucket)?;
        Ok(S3Response::new(GetBucketLoggingOutput {
            logging_enabled: None,
        }))
    }

    /// Turning logging off is what it is already; turning it on is refused.
    pub(crate) async fn op_put_bucket_logging(
        &self,
        req: S3Request<PutBucketLoggingInput>,
    ) -> S3Result<S3Response<PutBucketLoggingOutput>> {
        self.bucket_access(&req.extensions, &req.input.bucket)?;
        if req.input.bucket_logging_status.logging_enabled.is_some() {
            return Err(S3Error::with_message(
                S3ErrorCode::NotImplemented,
                "Server access logging is not supported; Tarn's request log and metrics are on the admin port. Nothing was changed.",
            ));
        }
        Ok(S3Response::new(PutBucketLoggingOutput {}))
    }

    /// The bucket owner pays: there is no one else to bill.
    pub(crate) async fn op_get_bucket_request_payment(
        &self,
        req: S3Request<GetBucketRequestPaymentInput>,
    ) -> S3Result<S3Response<GetBucketRequestPaymentOutput>> {
        self.bucket_access(&req.extensions, &req.input.bucket)?;
        Ok(S3Response::new(GetBucketRequestPaymentOutput {
            payer: Some(Payer::from_static(Payer::BUCKET_OWNER)),
        }))
    }

    pub(crate) async fn op_put_bucket_request_payment(
        &self,
        req: S3Request<PutBucketRequestPaymentInput>,
    ) -> S3Result<S3Response<PutBucketRequestPaymentOutput>> {
        self.bucket_access(&req.extensions, &req.input.bucket)?;
        let payer = req.input.request_payment_configuration.payer;
        if payer.as_str() != Payer::BUCKET_OWNER {
            return Err(S3Error::with_message(
                S3ErrorCode::NotImplemented,
                "Requester Pays is not supported: the bucket owner pays. Nothing was changed.",
            ));
        }
        Ok(S3Response::new(PutBucketRequestPaymentOutput {}))
    }
}

impl TarnS3 {
    pub(crate) async fn op_get_bucket_lifecycle_configuration(
        &self,
        req: S3Request<GetBucketLifecycleConfigurationInput>,
    ) -> S3Result<S3Response<GetBucketLifecycleConfigurationOutput>> {
        let b = self.bucket_access(&req.extensions, &req.input.bucket)?;
        let Some(lc) = &b.doc.lifecycle else {
            let mut e = S3Error::with_message(
                S3ErrorCode::NoSuchLifecycleConfiguration,
                "The lifecycle configuration does not exist",
            );
            e.set_status_code(http::StatusCode::NOT_FOUND);
            return Err(e);
        };
        Ok(S3Response::new(GetBucketLifecycleConfigurationOutput {
            rules: Some(lc.to_dto()),
            ..Default::default()
        }))
    }

    pub(crate) async fn op_put_bucket_lifecycle_configuration(
        &self,
        req: S3Request<PutBucketLifecycleConfigurationInput>,
    ) -> S3Result<S3Response<PutBucketLifecycleConfigurationOutput>> {
        let i = req.input;
        self.refuse_on_cache(
            &i.bucket,
            "lifecycle rules (a cache bucket evicts by its size)",
        )?;
        let c = i.lifecycle_configuration.as_ref().ok_or_else(|| {
            S3Error::with_message(
                S3ErrorCode::MalformedXML,
                "A LifecycleConfiguration body is required",
            )
        })?;
        let lc = crate::lifecycle::Lifecycle::from_dto(c)?;
        self.access
            .update(&i.bucket, |d| {
                d.lifecycle = Some(lc);
                Ok(())
            })
            .await?;
        Ok(S3Response::new(
            PutBucketLifecycleConfigurationOutput::default(),
        ))
    }

    pub(crate) async fn op_delete_bucket_lifecycle(
        &self,
        req: S3Request<DeleteBucketLifecycleInput>,
    ) -> S3Result<S3Response<DeleteBucketLifecycleOutput>> {
        self.access
            .update(&req.input.bucket, |d| {
                d.lifecycle = None;
                Ok(())
            })
            .await?;
        Ok(S3Response::new(DeleteBucketLifecycleOutput {}))
    }
}

impl TarnS3 {
    pub(crate) async fn op_get_bucket_cors(
        &self,
        req: S3Request<GetBucketCorsInput>,
    ) -> S3Result<S3Response<GetBucketCorsOutput>> {
        let b = self.bucket_access(&req.extensions, &req.input.bucket)?;
        let Some(c) = &b.doc.cors else {
            let mut e = S3Error::with_message(
                S3ErrorCode::NoSuchCORSConfiguration,
                "The CORS configuration does not exist",
            );
            e.set_status_code(http::StatusCode::NOT_FOUND);
            return Err(e);
        };
        Ok(S3Response::new(GetBucketCorsOutput {
            cors_rules: Some(c.to_dto()),
        }))
    }

    pub(crate) async fn op_put_bucket_cors(
        &self,
        req: S3Request<PutBucketCorsInput>,
    ) -> S3Result<S3Response<PutBucketCorsOutput>> {
        let i = req.input;
        let c = crate::cors::Cors::from_dto(&i.cors_configuration)?;
        self.access
            .update(&i.bucket, |d| {
                d.cors = Some(c);
                Ok(())
            })
            .await?;
        Ok(S3Response::new(PutBucketCorsOutput {}))
    }

    pub(crate) async fn op_delete_bucket_cors(
        &self,
        req: S3Request<DeleteBucketCorsInput>,
    ) -> S3Result<S3Response<DeleteBucketCorsOutput>> {
        self.access
            .update(&req.input.bucket, |d| {
                d.cors = None;
                Ok(())
            })
            .await?;
        Ok(S3Response::new(DeleteBucketCorsOutput {}))
    }
}
