//! Tenants and the namespaces they are granted. The credentials and the
//! challenge-response that proves them are in `tarn_wire::auth` (re-exported
//! here), shared with the clients.
//!
//! A credential belongs to one tenant. Each tenant has its own engine: its own
//! RAM arena (the only one its shared-memory clients ever map, read-only) and
//! NVMe tier, so no tenant can read, evict or fill another's blocks. Within
//! its engine a tenant may use the namespaces its grants allow.

use std::sync::Arc;

pub use tarn_wire::auth::*;

use crate::engine::Engine;

/// Namespace prefixes a tenant may use; an empty prefix grants every name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grants {
    prefixes: Vec<Vec<u8>>,
}

impl Grants {
    /// Every namespace.
    pub fn all() -> Grants {
        Grants {
            prefixes: vec![Vec::new()],
        }
    }

    pub fn prefixes(prefixes: Vec<Vec<u8>>) -> Result<Grants, String> {
        if prefixes.is_empty() {
            return Err("a tenant needs at least one namespace grant".into());
        }
        if prefixes.len() > GRANTS_MAX {
            return Err(format!("more than {GRANTS_MAX} namespace grants"));
        }
        if let Some(p) = prefixes
            .iter()
            .find(|p| p.len() > crate::proto::NAMESPACE_MAX_BYTES)
        {
            return Err(format!(
                "namespace grant of {} bytes is longer than a namespace",
                p.len()
            ));
        }
        Ok(Grants { prefixes })
    }

    pub fn allows(&self, namespace: &[u8]) -> bool {
        self.prefixes.iter().any(|p| namespace.starts_with(p))
    }

    pub fn as_prefixes(&self) -> &[Vec<u8>] {
        &self.prefixes
    }
}

/// A tenant: its credentials, what it may use, and its own engine.
pub struct Tenant {
    pub name: String,
    pub credentials: Credentials,
    pub grants: Grants,
    pub engine: Arc<Engine>,
}

impl Tenant {
    pub fn new(
        name: impl Into<String>,
        credentials: Credentials,
        grants: Grants,
        engine: Arc<Engine>,
    ) -> Result<Tenant, String> {
        let name = name.into();
        if name.is_empty()
            || name.len() > TENANT_NAME_MAX_BYTES
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(format!(
                "tenant name {name:?}: 1 to {TENANT_NAME_MAX_BYTES} letters, digits, '-' or '_'"
            ));
        }
        let ak = &credentials.access_key;
        if ak.is_empty()
            || ak.len() > ACCESS_KEY_MAX_BYTES
            || ak.bytes().any(|b| b.is_ascii_control())
        {
            return Err(format!(
                "tenant {name}: an access key is 1 to {ACCESS_KEY_MAX_BYTES} printable bytes"
            ));
        }
        if credentials.secret_key.len() < 8 {
            return Err(format!(
                "tenant {name}: the secret key must be at least 8 characters"
            ));
        }
        Ok(Tenant {
            name,
            credentials,
            grants,
            engine,
        })
    }
}

/// The tenants of a server, found by access key.
#[derive(Clone)]
pub struct Tenants {
    list: Vec<Arc<Tenant>>,
}

impl Tenants {
    /// Access keys must be unique across tenants.
    pub fn new(list: Vec<Tenant>) -> Result<Tenants, String> {
        if list.is_empty() {
            return Err("the KV store needs at least one tenant".into());
        }
        for (i, t) in list.iter().enumerate() {
            if list[..i]
                .iter()
                .any(|o| o.credentials.access_key == t.credentials.access_key)
            {
                return Err(format!(
                    "access key {:?} is given to more than one tenant",
                    t.credentials.access_key
                ));
            }
            if list[..i].iter().any(|o| o.name == t.name) {
                return Err(format!("two tenants are named {:?}", t.name));
            }
        }
        Ok(Tenants {
            list: list.into_iter().map(Arc::new).collect(),
        })
    }

    /// One tenant holding every namespace: what tests and the fuzz target use.
    pub fn single(engine: Arc<Engine>, credentials: Credentials) -> Tenants {
        Tenants {
            list: vec![Arc::new(Tenant {
                name: "default".into(),
                credentials,
                grants: Grants::all(),
                engine,
            })],
        }
    }

    pub fn by_access_key(&self, access_key: &[u8]) -> Option<&Arc<Tenant>> {
        self.list
            .iter()
            .find(|t| t.credentials.access_key.as_bytes() == access_key)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<Tenant>> {
        self.list.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_are_prefixes() {
        let g = Grants::prefixes(vec![b"team-a/".to_vec(), b"shared/x".to_vec()]).unwrap();
        assert!(g.allows(b"team-a/llama"));
        assert!(g.allows(b"shared/x"));
        assert!(!g.allows(b"team-b/llama"));
        assert!(!g.allows(b"team-a"));
        assert!(Grants::all().allows(b"anything"));
        assert!(Grants::prefixes(vec![]).is_err());
    }
}
