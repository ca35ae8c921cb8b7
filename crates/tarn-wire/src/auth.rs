//! Credentials and the challenge-response that proves them (both ways)
//! without sending the secret. The tenants a credential belongs to, and the
//! namespaces they are granted, are the daemon's (`tarn_kv::auth`).
//!
//! A connection starts unauthenticated. HELLO's reply carries a random
//! server nonce; the client answers with AUTH: its access key, a nonce of its
//! own and `HMAC-SHA256(secret, "tarn-kv-auth-v2 client" ‖ server nonce ‖
//! client nonce ‖ access key)`. The server checks it and answers with the
//! same HMAC under the "server" label, so a client also learns that it
//! reached a daemon that knows the secret (a process squatting on the port
//! or the socket cannot pass). The nonces make every proof single-use.

use hmac::{KeyInit, Mac};
use sha2::Sha256;

type HmacSha256 = hmac::Hmac<Sha256>;

/// Credentials the daemon accepts only while every listener is on loopback
/// (S3 and KV alike); clients fall back to them when nothing is configured,
/// so a daemon started with no configuration is usable on its own host.
pub const DEFAULT_ACCESS_KEY: &str = "tarnadmin";
pub const DEFAULT_SECRET_KEY: &str = "tarnadmin-secret";
/// Environment variables naming the credentials, for clients and daemon.
pub const ACCESS_KEY_ENV: &str = "TARN_ACCESS_KEY";
pub const SECRET_KEY_ENV: &str = "TARN_SECRET_KEY";

/// Length of each side's nonce.
pub const NONCE_BYTES: usize = 32;
/// Length of an HMAC-SHA256 proof.
pub const PROOF_BYTES: usize = 32;
/// Longest access key accepted on the wire.
pub const ACCESS_KEY_MAX_BYTES: usize = 128;
/// Longest tenant name.
pub const TENANT_NAME_MAX_BYTES: usize = 64;
/// Most namespace grants one tenant may have.
pub const GRANTS_MAX: usize = 64;

pub type Nonce = [u8; NONCE_BYTES];
pub type Proof = [u8; PROOF_BYTES];

/// An access key and its secret.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub access_key: String,
    pub secret_key: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the secret, not even in a debug print.
        f.debug_struct("Credentials")
            .field("access_key", &self.access_key)
            .finish_non_exhaustive()
    }
}

impl Credentials {
    pub fn new(access_key: impl Into<String>, secret_key: impl Into<String>) -> Credentials {
        Credentials {
            access_key: access_key.into(),
            secret_key: secret_key.into(),
        }
    }

    /// The built-in loopback credentials.
    pub fn loopback_default() -> Credentials {
        Credentials::new(DEFAULT_ACCESS_KEY, DEFAULT_SECRET_KEY)
    }

    /// True for the built-in credentials, however they were set.
    pub fn is_default(&self) -> bool {
        self.access_key == DEFAULT_ACCESS_KEY || self.secret_key == DEFAULT_SECRET_KEY
    }

    /// What a client uses when its caller names no credentials:
    /// `TARN_ACCESS_KEY` and `TARN_SECRET_KEY` when both are set, the
    /// built-in loopback credentials when neither is. One without the other
    /// is a mistake worth saying so.
    pub fn from_env_or_default() -> Result<Credentials, String> {
        let a = std::env::var(ACCESS_KEY_ENV).ok().filter(|s| !s.is_empty());
        let s = std::env::var(SECRET_KEY_ENV).ok().filter(|s| !s.is_empty());
        match (a, s) {
            (Some(a), Some(s)) => Ok(Credentials::new(a, s)),
            (None, None) => Ok(Credentials::loopback_default()),
            _ => Err(format!(
                "set both {ACCESS_KEY_ENV} and {SECRET_KEY_ENV}, or neither"
            )),
        }
    }
}

/// Which side a proof speaks for: the two proofs of one handshake differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
}

/// `HMAC-SHA256(secret, label ‖ server_nonce ‖ client_nonce ‖ access_key)`.
pub fn proof(
    side: Side,
    secret_key: &str,
    server_nonce: &Nonce,
    client_nonce: &Nonce,
    access_key: &[u8],
) -> Proof {
    proof_for(
        KV_LABELS,
        side,
        secret_key,
        server_nonce,
        client_nonce,
        access_key,
    )
}

/// The labels of the KV handshake's two proofs.
const KV_LABELS: [&[u8]; 2] = [b"tarn-kv-auth-v2 client", b"tarn-kv-auth-v2 server"];

/// [`proof`] under a protocol's own labels (client's, server's), so that a
/// proof made for one protocol is worth nothing in another.
pub fn proof_for(
    labels: [&[u8]; 2],
    side: Side,
    secret_key: &str,
    server_nonce: &Nonce,
    client_nonce: &Nonce,
    access_key: &[u8],
) -> Proof {
    mac(
        labels,
        side,
        secret_key,
        server_nonce,
        client_nonce,
        access_key,
    )
    .finalize()
    .into_bytes()
    .into()
}

/// [`verify`] under a protocol's own labels.
pub fn verify_for(
    labels: [&[u8]; 2],
    side: Side,
    secret_key: &str,
    server_nonce: &Nonce,
    client_nonce: &Nonce,
    access_key: &[u8],
    proof: &Proof,
) -> bool {
    mac(
        labels,
        side,
        secret_key,
        server_nonce,
        client_nonce,
        access_key,
    )
    .verify_slice(proof)
    .is_ok()
}

/// Checks a proof in constant time.
pub fn verify(
    side: Side,
    secret_key: &str,
    server_nonce: &Nonce,
    client_nonce: &Nonce,
    access_key: &[u8],
    proof: &Proof,
) -> bool {
    verify_for(
        KV_LABELS,
        side,
        secret_key,
        server_nonce,
        client_nonce,
        access_key,
        proof,
    )
}

fn mac(
    labels: [&[u8]; 2],
    side: Side,
    secret_key: &str,
    server_nonce: &Nonce,
    client_nonce: &Nonce,
    access_key: &[u8],
) -> HmacSha256 {
    let mut m =
        HmacSha256::new_from_slice(secret_key.as_bytes()).expect("HMAC takes any key length");
    m.update(match side {
        Side::Client => labels[0],
        Side::Server => labels[1],
    });
    m.update(server_nonce);
    m.update(client_nonce);
    m.update(access_key);
    m
}

/// A fresh random nonce.
pub fn nonce() -> Nonce {
    let mut n = [0u8; NONCE_BYTES];
    // The OS random source failing is not something to limp on with.
    getrandom::fill(&mut n).expect("the OS random number source");
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_both_nonces_the_key_and_the_side() {
        let (sn, cn) = ([1u8; 32], [2u8; 32]);
        let p = proof(Side::Client, "secret-1", &sn, &cn, b"ak");
        assert!(verify(Side::Client, "secret-1", &sn, &cn, b"ak", &p));
        assert!(!verify(Side::Server, "secret-1", &sn, &cn, b"ak", &p));
        assert!(!verify(Side::Client, "secret-2", &sn, &cn, b"ak", &p));
        assert!(!verify(Side::Client, "secret-1", &[3; 32], &cn, b"ak", &p));
        assert!(!verify(Side::Client, "secret-1", &sn, &[3; 32], b"ak", &p));
        assert!(!verify(Side::Client, "secret-1", &sn, &cn, b"ak2", &p));
        assert_ne!(nonce(), nonce());
    }

    #[test]
    fn debug_never_shows_the_secret() {
        let c = Credentials::new("ak", "very-secret");
        assert!(!format!("{c:?}").contains("very-secret"));
    }
}
