//! Access control lists: grants of READ, WRITE, READ_ACP, WRITE_ACP and
//! FULL_CONTROL to users (canonical ID = the user name), to everyone
//! (`AllUsers`) or to every signed-in user (`AuthenticatedUsers`), from
//! canned ACLs, `x-amz-grant-*` headers or an `AccessControlPolicy` body.
//! A bucket keeps its ACL in its access document; an object keeps its owner
//! and grants with the version (`ACL_HEADER`).

use s3s::dto;
use s3s::{S3Error, S3ErrorCode, S3Result};
use serde::{Deserialize, Serialize};

/// The internal stored header holding an object version's owner and grants.
/// Never returned to clients; absent when the bucket owner owns the object
/// and nobody else holds a grant.
pub const ACL_HEADER: &str = "x-tarn-acl";
/// Most grants one ACL may hold (AWS's limit).
pub const MAX_GRANTS: usize = 100;
pub const ALL_USERS: &str = "http://acs.amazonaws.com/groups/global/AllUsers";
pub const AUTHENTICATED_USERS: &str = "http://acs.amazonaws.com/groups/global/AuthenticatedUsers";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Permission {
    #[serde(rename = "READ")]
    Read,
    #[serde(rename = "WRITE")]
    Write,
    #[serde(rename = "READ_ACP")]
    ReadAcp,
    #[serde(rename = "WRITE_ACP")]
    WriteAcp,
    #[serde(rename = "FULL_CONTROL")]
    FullControl,
}

impl Permission {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "READ" => Permission::Read,
            "WRITE" => Permission::Write,
            "READ_ACP" => Permission::ReadAcp,
            "WRITE_ACP" => Permission::WriteAcp,
            "FULL_CONTROL" => Permission::FullControl,
            _ => return None,
        })
    }

    fn as_str(self) -> &'static str {
        match self {
            Permission::Read => "READ",
            Permission::Write => "WRITE",
            Permission::ReadAcp => "READ_ACP",
            Permission::WriteAcp => "WRITE_ACP",
            Permission::FullControl => "FULL_CONTROL",
        }
    }

    fn covers(self, wanted: Permission) -> bool {
        self == wanted || self == Permission::FullControl
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Grantee {
    #[serde(rename = "user")]
    User(String),
    #[serde(rename = "all")]
    AllUsers,
    #[serde(rename = "authenticated")]
    AuthenticatedUsers,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Grant {
    pub grantee: Grantee,
    pub permission: Permission,
}

/// An ACL: the owner (always allowed to read and change it) and grants.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Acl {
    pub owner: String,
    pub grants: Vec<Grant>,
}

fn malformed(msg: impl Into<String>) -> S3Error {
    S3Error::with_message(S3ErrorCode::MalformedACLError, msg.into())
}

impl Acl {
    /// The `private` ACL: the owner alone, with full control.
    pub fn private(owner: &str) -> Acl {
        Acl {
            owner: owner.to_string(),
            grants: vec![Grant {
                grantee: Grantee::User(owner.to_string()),
                permission: Permission::FullControl,
            }],
        }
    }

    /// A canned ACL. `bucket_owner` is the owner of the bucket an object
    /// lies in (for the bucket-owner-* ACLs of objects).
    pub fn canned(name: &str, owner: &str, bucket_owner: &str) -> S3Result<Acl> {
        let mut acl = Acl::private(owner);
        let mut add = |grantee: Grantee, permission| {
            acl.grants.push(Grant {
                grantee,
                permission,
            })
        };
        match name {
            "private" => {}
            "public-read" => add(Grantee::AllUsers, Permission::Read),
            "public-read-write" => {
                add(Grantee::AllUsers, Permission::Read);
                add(Grantee::AllUsers, Permission::Write);
            }
            "authenticated-read" => add(Grantee::AuthenticatedUsers, Permission::Read),
            "bucket-owner-read" => {
                if bucket_owner != owner {
                    add(Grantee::User(bucket_owner.to_string()), Permission::Read)
                }
            }
            "bucket-owner-full-control" => {
                if bucket_owner != owner {
                    add(
                        Grantee::User(bucket_owner.to_string()),
                        Permission::FullControl,
                    )
                }
            }
            "aws-exec-read" | "log-delivery-write" => {
                return Err(S3Error::with_message(
                    S3ErrorCode::NotImplemented,
                    format!("The canned ACL {name} names AWS services Tarn does not have."),
                ))
            }
            _ => {
                return Err(S3Error::with_message(
                    S3ErrorCode::InvalidArgument,
                    format!("Unknown canned ACL {name}"),
                ))
            }
        }
        Ok(acl)
    }

    /// An ACL from `x-amz-grant-*` headers (`id="alice", uri="…AllUsers"`).
    /// Each named user must exist.
    pub fn from_grant_headers(
        owner: &str,
        headers: &http::HeaderMap,
        user_exists: &dyn Fn(&str) -> bool,
    ) -> S3Result<Option<Acl>> {
        const HEADERS: [(&str, Permission); 5] = [
            ("x-amz-grant-read", Permission::Read),
            ("x-amz-grant-write", Permission::Write),
            ("x-amz-grant-read-acp", Permission::ReadAcp),
            ("x-amz-grant-write-acp", Permission::WriteAcp),
            ("x-amz-grant-full-control", Permission::FullControl),
        ];
        let mut grants = Vec::new();
        let mut any = false;
        for (name, permission) in HEADERS {
            for v in headers.get_all(name) {
                any = true;
                let v = v
                    .to_str()
                    .map_err(|_| invalid_argument(format!("{name} is not ASCII")))?;
                for item in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    let (kind, value) = item
                        .split_once('=')
                        .ok_or_else(|| invalid_argument(format!("Invalid {name}: {item}")))?;
                    let value = value.trim().trim_matches('"');
                    let grantee = grantee_of(kind.trim(), value, user_exists)?;
                    grants.push(Grant {
                        grantee,
                        permission,
                    });
                }
            }
        }
        if !any {
            return Ok(None);
        }
        if grants.len() > MAX_GRANTS {
            return Err(malformed(format!(
                "An ACL holds at most {MAX_GRANTS} grants"
            )));
        }
        Ok(Some(Acl {
            owner: owner.to_string(),
            grants,
        }))
    }

    /// An ACL from an `AccessControlPolicy` body. Its owner, when given,
    /// must be the resource's.
    pub fn from_policy(
        owner: &str,
        policy: &dto::AccessControlPolicy,
        user_exists: &dyn Fn(&str) -> bool,
    ) -> S3Result<Acl> {
        if let Some(id) = policy.owner.as_ref().and_then(|o| o.id.as_deref()) {
            if id != owner {
                return Err(S3Error::with_message(
                    S3ErrorCode::AccessDenied,
                    "The owner in the AccessControlPolicy is not the resource's owner.",
                ));
            }
        }
        let list = policy.grants.as_deref().unwrap_or_default();
        if list.len() > MAX_GRANTS {
            return Err(malformed(format!(
                "An ACL holds at most {MAX_GRANTS} grants"
            )));
        }
        let mut grants = Vec::with_capacity(list.len());
        for g in list {
            let permission = g
                .permission
                .as_ref()
                .and_then(|p| Permission::parse(p.as_str()))
                .ok_or_else(|| malformed("Each Grant needs a Permission of READ, WRITE, READ_ACP, WRITE_ACP or FULL_CONTROL"))?;
            let who = g
                .grantee
                .as_ref()
                .ok_or_else(|| malformed("Each Grant needs a Grantee"))?;
            let grantee = match who.type_.as_str() {
                dto::Type::CANONICAL_USER => {
                    grantee_of("id", who.id.as_deref().unwrap_or(""), user_exists)?
                }
                dto::Type::GROUP => {
                    grantee_of("uri", who.uri.as_deref().unwrap_or(""), user_exists)?
                }
                dto::Type::AMAZON_CUSTOMER_BY_EMAIL => grantee_of("emailAddress", "", user_exists)?,
                t => return Err(malformed(format!("Unknown Grantee type {t}"))),
            };
            grants.push(Grant {
                grantee,
                permission,
            });
        }
        Ok(Acl {
            owner: owner.to_string(),
            grants,
        })
    }

    /// Whether the ACL gives `who` (None: anonymous) `wanted`. The owner
    /// may always read and change the ACL itself. `ignore_public`: grants to
    /// everyone and to every signed-in user count for nothing.
    pub fn allows(&self, who: Option<&str>, wanted: Permission, ignore_public: bool) -> bool {
        if who == Some(self.owner.as_str())
            && matches!(wanted, Permission::ReadAcp | Permission::WriteAcp)
        {
            return true;
        }
        self.grants.iter().any(|g| {
            g.permission.covers(wanted)
                && match &g.grantee {
                    Grantee::User(u) => who == Some(u.as_str()),
                    Grantee::AllUsers => !ignore_public,
                    Grantee::AuthenticatedUsers => !ignore_public && who.is_some(),
                }
        })
    }

    /// Whether any grant reaches everyone or every signed-in user.
    pub fn is_public(&self) -> bool {
        self.grants
            .iter()
            .any(|g| matches!(g.grantee, Grantee::AllUsers | Grantee::AuthenticatedUsers))
    }

    /// Whether the ACL gives nobody but `owner` anything (what an ACL may be
    /// where ACLs are disabled: `private` or `bucket-owner-full-control`).
    pub fn owner_only(&self, owner: &str) -> bool {
        owner_only(&self.grants, owner)
    }

    pub fn to_dto(&self) -> (dto::Owner, Vec<dto::Grant>) {
        let owner = dto::Owner {
            display_name: Some(self.owner.clone()),
            id: Some(self.owner.clone()),
        };
        let grants = self
            .grants
            .iter()
            .map(|g| dto::Grant {
                grantee: Some(match &g.grantee {
                    Grantee::User(u) => dto::Grantee {
                        display_name: Some(u.clone()),
                        email_address: None,
                        id: Some(u.clone()),
                        type_: dto::Type::from_static(dto::Type::CANONICAL_USER),
                        uri: None,
                    },
                    Grantee::AllUsers | Grantee::AuthenticatedUsers => dto::Grantee {
                        display_name: None,
                        email_address: None,
                        id: None,
                        type_: dto::Type::from_static(dto::Type::GROUP),
                        uri: Some(
                            if g.grantee == Grantee::AllUsers {
                                ALL_USERS
                            } else {
                                AUTHENTICATED_USERS
                            }
                            .to_string(),
                        ),
                    },
                }),
                permission: Some(dto::Permission::from(g.permission.as_str().to_string())),
            })
            .collect();
        (owner, grants)
    }

    /// The stored form of an object's ACL.
    pub fn encode(&self) -> String {
        serde_json::to_string(self).expect("an ACL serializes")
    }

    pub fn decode(s: &str) -> Option<Acl> {
        serde_json::from_str(s).ok()
    }
}

/// Whether `grants` give nobody but `owner` anything.
pub fn owner_only(grants: &[Grant], owner: &str) -> bool {
    grants.iter().all(|g| {
        matches!(&g.grantee, Grantee::User(u) if u == owner)
            && g.permission == Permission::FullControl
    })
}

fn invalid_argument(msg: String) -> S3Error {
    S3Error::with_message(S3ErrorCode::InvalidArgument, msg)
}

fn grantee_of(kind: &str, value: &str, user_exists: &dyn Fn(&str) -> bool) -> S3Result<Grantee> {
    match kind {
        "id" => {
            if user_exists(value) {
                Ok(Grantee::User(value.to_string()))
            } else {
                Err(invalid_argument(format!("Invalid id: no user {value:?}")))
            }
        }
        "uri" => match value {
            ALL_USERS => Ok(Grantee::AllUsers),
            AUTHENTICATED_USERS => Ok(Grantee::AuthenticatedUsers),
            _ => Err(invalid_argument(format!("Invalid group uri {value:?}"))),
        },
        "emailAddress" => Err(S3Error::with_message(
            S3ErrorCode::UnresolvableGrantByEmailAddress,
            "Tarn users have no e-mail addresses: grant by id (the user name).",
        )),
        _ => Err(invalid_argument(format!("Invalid grantee type {kind:?}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exists(u: &str) -> bool {
        matches!(u, "alice" | "bob")
    }

    #[test]
    fn canned_acls() {
        let a = Acl::canned("public-read", "alice", "alice").unwrap();
        assert!(a.allows(None, Permission::Read, false));
        assert!(!a.allows(None, Permission::Read, true));
        assert!(!a.allows(None, Permission::Write, false));
        assert!(a.allows(Some("alice"), Permission::Write, false));
        assert!(a.is_public());
        let b = Acl::canned("bucket-owner-full-control", "bob", "alice").unwrap();
        assert!(b.allows(Some("alice"), Permission::Read, false));
        assert!(!b.is_public());
        let c = Acl::canned("authenticated-read", "alice", "alice").unwrap();
        assert!(c.allows(Some("bob"), Permission::Read, false));
        assert!(!c.allows(None, Permission::Read, false));
        assert!(Acl::canned("private", "alice", "alice")
            .unwrap()
            .owner_only("alice"));
        assert!(Acl::canned("bogus", "a", "a").is_err());
        assert_eq!(Acl::decode(&a.encode()), Some(a));
    }

    #[test]
    fn grant_headers() {
        let mut h = http::HeaderMap::new();
        h.insert(
            "x-amz-grant-read",
            "id=\"bob\", uri=\"http://acs.amazonaws.com/groups/global/AllUsers\""
                .parse()
                .unwrap(),
        );
        h.insert("x-amz-grant-write-acp", "id=bob".parse().unwrap());
        let a = Acl::from_grant_headers("alice", &h, &exists)
            .unwrap()
            .unwrap();
        assert!(a.allows(Some("bob"), Permission::Read, false));
        assert!(a.allows(Some("bob"), Permission::WriteAcp, false));
        assert!(!a.allows(Some("bob"), Permission::Write, false));
        assert!(a.is_public());
        h.insert(
            "x-amz-grant-full-control",
            "id=\"mallory\"".parse().unwrap(),
        );
        assert!(Acl::from_grant_headers("alice", &h, &exists).is_err());
        assert!(
            Acl::from_grant_headers("alice", &http::HeaderMap::new(), &exists)
                .unwrap()
                .is_none()
        );
    }
}
