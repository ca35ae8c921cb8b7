//! The S3 operations on permissions: bucket and object ACLs, bucket
//! policies and their status, the public access block and object ownership
//! controls. Who may call them is decided by `access` before they run.

use std::sync::Arc;

use s3s::dto::*;
use s3s::{S3Error, S3ErrorCode, S3Request, S3Response, S3Result};

use crate::access::{acl_not_supported, permit_of, BucketAccess, Ownership, PublicAccessBlock};
use crate::acl::{Acl, ACL_HEADER};
use crate::error::s3_error;
use crate::iam::ROOT_USER;
use crate::ops::TarnS3;

fn public_blocked(what: &str) -> S3Error {
    S3Error::with_message(
        S3ErrorCode::AccessDenied,
        format!("The bucket's public access block forbids a public {what}."),
    )
}

fn not_found(code: &'static str, msg: &str) -> S3Error {
    let mut e = S3Error::with_message(S3ErrorCode::Custom(code.into()), msg.to_string());
    e.set_status_code(http::StatusCode::NOT_FOUND);
    e
}

impl TarnS3 {
    /// The ACL a PutBucketAcl or PutObjectAcl asks for: exactly one of a
    /// canned ACL, grant headers or an AccessControlPolicy body.
    fn acl_of_request(
        &self,
        headers: &http::HeaderMap,
        body: Option<&AccessControlPolicy>,
        owner: &str,
        bucket_owner: &str,
    ) -> S3Result<Acl> {
        let exists = |u: &str| self.access.iam.user_exists(u);
        match (
            self.access.requested_acl(headers, owner, bucket_owner)?,
            body,
        ) {
            (Some(acl), None) => Ok(acl),
            (None, Some(p)) => Acl::from_policy(owner, p, &exists),
            (None, None) => Err(S3Error::with_message(
                S3ErrorCode::MissingSecurityHeader,
                "An ACL is required: x-amz-acl, x-amz-grant-* or an AccessControlPolicy body.",
            )),
            _ => Err(S3Error::with_message(
                S3ErrorCode::InvalidRequest,
                "Give one of x-amz-acl, x-amz-grant-* or an AccessControlPolicy body.",
            )),
        }
    }

    pub(crate) async fn op_get_bucket_acl(
        &self,
        req: S3Request<GetBucketAclInput>,
    ) -> S3Result<S3Response<GetBucketAclOutput>> {
        let b = self.bucket_access(&req.extensions, &req.input.bucket)?;
        let acl = if b.enforced() {
            Acl::private(&b.doc.owner)
        } else {
            b.acl.clone()
        };
        let (owner, grants) = acl.to_dto();
        Ok(S3Response::new(GetBucketAclOutput {
            grants: Some(grants),
            owner: Some(owner),
        }))
    }

    pub(crate) async fn op_put_bucket_acl(
        &self,
        req: S3Request<PutBucketAclInput>,
    ) -> S3Result<S3Response<PutBucketAclOutput>> {
        let i = req.input;
        let b = self.bucket_access(&req.extensions, &i.bucket)?;
        let owner = b.doc.owner.clone();
        let acl = self.acl_of_request(
            &req.headers,
            i.access_control_policy.as_ref(),
            &owner,
            &owner,
        )?;
        // A public ACL under BlockPublicAcls is 403 whatever else; where
        // ACLs are disabled, setting one (even `private`) is 400, as AWS.
        if acl.is_public() && b.pab().block_public_acls {
            return Err(public_blocked("ACL"));
        }
        if b.enforced() {
            return Err(acl_not_supported());
        }
        self.access
            .update(&i.bucket, |d| {
                d.grants = acl.grants;
                Ok(())
            })
            .await?;
        Ok(S3Response::new(PutBucketAclOutput {}))
    }

    pub(crate) async fn op_get_object_acl(
        &self,
        req: S3Request<GetObjectAclInput>,
    ) -> S3Result<S3Response<GetObjectAclOutput>> {
        let i = req.input;
        let b = self.bucket_access(&req.extensions, &i.bucket)?;
        let info = self
            .store
            .head_object(&i.bucket, &i.key, i.version_id.as_deref())
            .await
            .map_err(s3_error)?;
        if let Some(p) = permit_of(&req.extensions) {
            p.allows_object(&info)?;
        }
        let (owner, grants) = b.object_acl(&info).to_dto();
        Ok(S3Response::new(GetObjectAclOutput {
            grants: Some(grants),
            owner: Some(owner),
            ..Default::default()
        }))
    }

    pub(crate) async fn op_put_object_acl(
        &self,
        req: S3Request<PutObjectAclInput>,
    ) -> S3Result<S3Response<PutObjectAclOutput>> {
        let i = req.input;
        let b = self.bucket_access(&req.extensions, &i.bucket)?;
        let info = self
            .store
            .head_object(&i.bucket, &i.key, i.version_id.as_deref())
            .await
            .map_err(s3_error)?;
        if let Some(p) = permit_of(&req.extensions) {
            p.allows_object(&info)?;
        }
        let owner = b.object_acl(&info).owner;
        let acl = self.acl_of_request(
            &req.headers,
            i.access_control_policy.as_ref(),
            &owner,
            &b.doc.owner,
        )?;
        if acl.is_public() && b.pab().block_public_acls {
            return Err(public_blocked("ACL"));
        }
        if b.enforced() {
            // Only the ACL the object has anyway, named as AWS accepts it.
            let canned = req.headers.get("x-amz-acl").map(|v| v.as_bytes());
            return if canned == Some(b"bucket-owner-full-control") {
                Ok(S3Response::new(PutObjectAclOutput::default()))
            } else {
                Err(acl_not_supported())
            };
        }
        let value = (owner != b.doc.owner || !acl.owner_only(&owner)).then(|| acl.encode());
        let version = info.version_id.clone();
        self.store
            .set_object_header(&i.bucket, &i.key, version.as_deref(), ACL_HEADER, value)
            .await
            .map_err(s3_error)?;
        Ok(S3Response::new(PutObjectAclOutput::default()))
    }

    pub(crate) async fn op_get_bucket_policy(
        &self,
        req: S3Request<GetBucketPolicyInput>,
    ) -> S3Result<S3Response<GetBucketPolicyOutput>> {
        let b = self.bucket_access(&req.extensions, &req.input.bucket)?;
        match &b.doc.policy {
            Some(p) => Ok(S3Response::new(GetBucketPolicyOutput {
                policy: Some(p.clone()),
            })),
            None => Err(S3Error::with_message(
                S3ErrorCode::NoSuchBucketPolicy,
                "The bucket policy does not exist",
            )),
        }
    }

    pub(crate) async fn op_put_bucket_policy(
        &self,
        req: S3Request<PutBucketPolicyInput>,
    ) -> S3Result<S3Response<PutBucketPolicyOutput>> {
        let i = req.input;
        let b = self.bucket_access(&req.extensions, &i.bucket)?;
        let policy = self.access.parse_policy(&i.bucket, &i.policy)?;
        if policy.is_public() && b.pab().block_public_policy {
            return Err(public_blocked("policy"));
        }
        self.access
            .update(&i.bucket, |d| {
                d.policy = Some(i.policy);
                Ok(())
            })
            .await?;
        Ok(S3Response::new(PutBucketPolicyOutput {}))
    }

    pub(crate) async fn op_delete_bucket_policy(
        &self,
        req: S3Request<DeleteBucketPolicyInput>,
    ) -> S3Result<S3Response<DeleteBucketPolicyOutput>> {
        self.access
            .update(&req.input.bucket, |d| {
                d.policy = None;
                Ok(())
            })
            .await?;
        Ok(S3Response::new(DeleteBucketPolicyOutput {}))
    }

    pub(crate) async fn op_get_bucket_policy_status(
        &self,
        req: S3Request<GetBucketPolicyStatusInput>,
    ) -> S3Result<S3Response<GetBucketPolicyStatusOutput>> {
        let b = self.bucket_access(&req.extensions, &req.input.bucket)?;
        let Some(p) = &b.policy else {
            return Err(S3Error::with_message(
                S3ErrorCode::NoSuchBucketPolicy,
                "The bucket policy does not exist",
            ));
        };
        Ok(S3Response::new(GetBucketPolicyStatusOutput {
            policy_status: Some(PolicyStatus {
                is_public: Some(p.is_public()),
            }),
        }))
    }

    pub(crate) async fn op_get_public_access_block(
        &self,
        req: S3Request<GetPublicAccessBlockInput>,
    ) -> S3Result<S3Response<GetPublicAccessBlockOutput>> {
        let b = self.bucket_access(&req.extensions, &req.input.bucket)?;
        let Some(p) = b.doc.public_access_block else {
            return Err(not_found(
                "NoSuchPublicAccessBlockConfiguration",
                "The public access block configuration was not found",
            ));
        };
        Ok(S3Response::new(GetPublicAccessBlockOutput {
            public_access_block_configuration: Some(PublicAccessBlockConfiguration {
                block_public_acls: Some(p.block_public_acls),
                block_public_policy: Some(p.block_public_policy),
                ignore_public_acls: Some(p.ignore_public_acls),
                restrict_public_buckets: Some(p.restrict_public_buckets),
            }),
        }))
    }

    pub(crate) async fn op_put_public_access_block(
        &self,
        req: S3Request<PutPublicAccessBlockInput>,
    ) -> S3Result<S3Response<PutPublicAccessBlockOutput>> {
        let c = req.input.public_access_block_configuration;
        let pab = PublicAccessBlock {
            block_public_acls: c.block_public_acls.unwrap_or(false),
            ignore_public_acls: c.ignore_public_acls.unwrap_or(false),
            block_public_policy: c.block_public_policy.unwrap_or(false),
            restrict_public_buckets: c.restrict_public_buckets.unwrap_or(false),
        };
        self.access
            .update(&req.input.bucket, |d| {
                d.public_access_block = Some(pab);
                Ok(())
            })
            .await?;
        Ok(S3Response::new(PutPublicAccessBlockOutput {}))
    }

    pub(crate) async fn op_delete_public_access_block(
        &self,
        req: S3Request<DeletePublicAccessBlockInput>,
    ) -> S3Result<S3Response<DeletePublicAccessBlockOutput>> {
        self.access
            .update(&req.input.bucket, |d| {
                d.public_access_block = None;
                Ok(())
            })
            .await?;
        Ok(S3Response::new(DeletePublicAccessBlockOutput {}))
    }

    pub(crate) async fn op_get_bucket_ownership_controls(
        &self,
        req: S3Request<GetBucketOwnershipControlsInput>,
    ) -> S3Result<S3Response<GetBucketOwnershipControlsOutput>> {
        let b = self.bucket_access(&req.extensions, &req.input.bucket)?;
        let Some(o) = b.doc.ownership else {
            return Err(S3Error::with_message(
                S3ErrorCode::OwnershipControlsNotFoundError,
                "The bucket ownership controls were not found",
            ));
        };
        Ok(S3Response::new(GetBucketOwnershipControlsOutput {
            ownership_controls: Some(OwnershipControls {
                rules: vec![OwnershipControlsRule {
                    object_ownership: ObjectOwnership::from(o.as_str().to_string()),
                }],
            }),
        }))
    }

    pub(crate) async fn op_put_bucket_ownership_controls(
        &self,
        req: S3Request<PutBucketOwnershipControlsInput>,
    ) -> S3Result<S3Response<PutBucketOwnershipControlsOutput>> {
        let rules = &req.input.ownership_controls.rules;
        if rules.len() != 1 {
            return Err(S3Error::with_message(
                S3ErrorCode::MalformedXML,
                "OwnershipControls holds exactly one Rule",
            ));
        }
        let ownership = Ownership::parse(rules[0].object_ownership.as_str())?;
        self.access
            .update(&req.input.bucket, |d| {
                if ownership == Ownership::BucketOwnerEnforced
                    && !crate::acl::owner_only(&d.grants, &d.owner)
                {
                    return Err(S3Error::with_message(
                        S3ErrorCode::InvalidBucketAclWithObjectOwnership,
                        "Bucket cannot have ACLs set with ObjectOwnership's BucketOwnerEnforced setting",
                    ));
                }
                d.ownership = Some(ownership);
                Ok(())
            })
            .await?;
        Ok(S3Response::new(PutBucketOwnershipControlsOutput {}))
    }

    pub(crate) async fn op_delete_bucket_ownership_controls(
        &self,
        req: S3Request<DeleteBucketOwnershipControlsInput>,
    ) -> S3Result<S3Response<DeleteBucketOwnershipControlsOutput>> {
        self.access
            .update(&req.input.bucket, |d| {
                d.ownership = None;
                Ok(())
            })
            .await?;
        Ok(S3Response::new(DeleteBucketOwnershipControlsOutput {}))
    }

    /// Whether the caller may see `bucket` in ListBuckets: root sees all,
    /// other users the buckets they own.
    pub(crate) fn lists_bucket(&self, caller: Option<&str>, bucket: &str) -> bool {
        match caller {
            Some(ROOT_USER) => true,
            Some(user) => self
                .access
                .bucket(bucket)
                .is_some_and(|b: Arc<BucketAccess>| b.doc.owner == user),
            None => false,
        }
    }
}
