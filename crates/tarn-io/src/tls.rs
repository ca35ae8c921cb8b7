//! TLS for every listener of a node (S3, admin, KV over TCP, cluster RPC)
//! and for the clients that reach them: one certificate and key per node,
//! read from PEM files and read again when they change, so that a renewed
//! certificate (cert-manager, certbot) is served without a restart.
//!
//! A change is picked up by polling: every `RELOAD_INTERVAL` both files
//! are read and compared with what was loaded. A pair that does not parse,
//! or whose key is not the certificate's (a renewal caught half-written),
//! is logged and the previous pair keeps being served; the next poll tries
//! again. Handshakes already under way keep the pair they started with.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use rustls::crypto::CryptoProvider;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};

pub use rustls;
pub use tokio_rustls;

/// How often the certificate and key files are looked at for a change.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(2);
/// The longest a client may take over its TLS handshake: one that stalls
/// there holds a connection slot and no request.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// A node's certificate chain and private key, served to every TLS client
/// and replaced when the files change.
pub struct ServerCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: RwLock<Arc<CertifiedKey>>,
    /// The files' bytes as last loaded (or last refused, so that one bad
    /// pair is logged once, not every poll).
    seen: Mutex<(Vec<u8>, Vec<u8>)>,
    reloads: AtomicU64,
}

impl fmt::Debug for ServerCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerCert")
            .field("cert", &self.cert_path)
            .field("key", &self.key_path)
            .finish()
    }
}

/// A certificate chain and its key from PEM bytes, the key checked to be
/// the certificate's.
fn certified_key(
    cert: &[u8],
    key: &[u8],
    (cert_path, key_path): (&Path, &Path),
) -> Result<CertifiedKey, String> {
    let chain = CertificateDer::pem_slice_iter(cert)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", cert_path.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no PEM certificate in it", cert_path.display()));
    }
    let key = PrivateKeyDer::from_pem_slice(key)
        .map_err(|e| format!("{}: no PEM private key in it ({e})", key_path.display()))?;
    CertifiedKey::from_der(chain, key, &provider()).map_err(|e| {
        format!(
            "{} and {}: {e} (is the key the certificate's?)",
            cert_path.display(),
            key_path.display()
        )
    })
}

fn read_pair(cert: &Path, key: &Path) -> Result<(Vec<u8>, Vec<u8>), String> {
    let c = std::fs::read(cert).map_err(|e| format!("{}: {e}", cert.display()))?;
    let k = std::fs::read(key).map_err(|e| format!("{}: {e}", key.display()))?;
    Ok((c, k))
}

impl ServerCert {
    /// Reads and checks both files now: a wrong path or a key that is not
    /// the certificate's stops the server at start.
    pub fn load(cert: &Path, key: &Path) -> Result<Arc<ServerCert>, String> {
        let (c, k) = read_pair(cert, key)?;
        let ck = certified_key(&c, &k, (cert, key))?;
        Ok(Arc::new(ServerCert {
            cert_path: cert.to_path_buf(),
            key_path: key.to_path_buf(),
            current: RwLock::new(Arc::new(ck)),
            seen: Mutex::new((c, k)),
            reloads: AtomicU64::new(0),
        }))
    }

    /// Reads the files again; Ok(true) when a new pair is now served,
    /// Ok(false) when nothing changed (or the change was already refused),
    /// Err when the files changed into something that cannot be served.
    pub fn reload_if_changed(&self) -> Result<bool, String> {
        let (c, k) = read_pair(&self.cert_path, &self.key_path)?;
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.0 == c && seen.1 == k {
            return Ok(false);
        }
        let parsed = certified_key(&c, &k, (&self.cert_path, &self.key_path));
        *seen = (c, k);
        let ck = parsed?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(ck);
        self.reloads.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// How many times a changed pair was taken since start.
    pub fn reloads(&self) -> u64 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// The certificate served now (its end-entity certificate first).
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .cert
            .clone()
    }

    /// Polls the files every `RELOAD_INTERVAL` on a thread of its own for as
    /// long as the certificate is in use.
    pub fn watch(self: &Arc<Self>) {
        let me: Weak<ServerCert> = Arc::downgrade(self);
        let spawned = std::thread::Builder::new()
            .name("tarn-tls-reload".into())
            .spawn(move || loop {
                std::thread::sleep(RELOAD_INTERVAL);
                let Some(me) = me.upgrade() else { return };
                match me.reload_if_changed() {
                    Ok(true) => tracing::info!(
                        cert = %me.cert_path.display(),
                        "TLS certificate changed on disk: new connections get the new one"
                    ),
                    Ok(false) => {}
                    Err(error) => tracing::error!(
                        %error,
                        "TLS certificate or key changed into something that cannot be served; the previous pair is kept"
                    ),
                }
            });
        if let Err(error) = spawned {
            tracing::error!(%error, "cannot start the TLS reload thread: certificate changes need a restart");
        }
    }

    /// A server configuration that serves this certificate (as it is at
    /// each handshake), offering `alpn` (e.g. `http/1.1`; empty: none).
    pub fn server_config(self: &Arc<Self>, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let mut config = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_no_client_auth()
            .with_cert_resolver(self.clone());
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    /// An acceptor over `server_config`.
    pub fn acceptor(self: &Arc<Self>, alpn: &[&[u8]]) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.server_config(alpn))
    }
}

impl ResolvesServerCert for ServerCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }
}

/// The certificates of a CA bundle (PEM), at least one.
pub fn roots(ca: &Path) -> Result<rustls::RootCertStore, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))? {
        let cert = cert.map_err(|e| format!("{}: {e}", ca.display()))?;
        roots
            .add(cert)
            .map_err(|e| format!("{}: {e}", ca.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("{}: no PEM certificate in it", ca.display()));
    }
    Ok(roots)
}

/// A client configuration that trusts the CA bundle `ca`, or where none is
/// given the system's trusted roots.
pub fn client_config(ca: Option<&Path>) -> Result<Arc<rustls::ClientConfig>, String> {
    let roots = match ca {
        Some(ca) => roots(ca)?,
        None => {
            let mut roots = rustls::RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err("no CA bundle given and the system has no trusted roots".into());
            }
            roots
        }
    };
    Ok(client_config_with(roots))
}

/// A client configuration that trusts exactly `roots`.
pub fn client_config_with(roots: rustls::RootCertStore) -> Arc<rustls::ClientConfig> {
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// A client configuration that accepts exactly the certificate `cert`
/// serves now and nothing else: a node calling its own listener (the
/// console's S3 calls) checks that it reached itself, whoever signed its
/// certificate and whatever name it carries.
pub fn trusting_only(cert: &Arc<ServerCert>) -> Arc<rustls::ClientConfig> {
    let provider = provider();
    Arc::new(
        rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Pinned {
                cert: cert.clone(),
                provider,
            }))
            .with_no_client_auth(),
    )
}

/// Accepts the server's certificate when it is the one `cert` serves.
struct Pinned {
    cert: Arc<ServerCert>,
    provider: Arc<CryptoProvider>,
}

impl fmt::Debug for Pinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Pinned")
    }
}

impl rustls::client::danger::ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: rustls_pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        match self.cert.chain().first() {
            Some(mine) if mine.as_ref() == end_entity.as_ref() => {
                Ok(rustls::client::danger::ServerCertVerified::assertion())
            }
            _ => Err(rustls::Error::General(
                "the certificate is not this node's own".into(),
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The name an endpoint's certificate must carry: its host (a DNS name or
/// an IP address, `[v6]` unbracketed).
pub fn server_name(hostport: &str) -> Result<ServerName<'static>, String> {
    let host = match hostport.rsplit_once(':') {
        Some((h, port)) if port.chars().all(|c| c.is_ascii_digit()) => h,
        _ => hostport,
    }
    .trim_start_matches('[')
    .trim_end_matches(']');
    ServerName::try_from(host.to_string())
        .map_err(|e| format!("{host:?} is not a name a certificate can carry: {e}"))
}

/// A connection that is TLS or plain, as its listener (or its client's
/// options) say.
pub enum MaybeTls<S> {
    Plain(S),
    Tls(Box<tokio_rustls::TlsStream<S>>),
}

impl<S> MaybeTls<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    /// `stream` as is without `tls`, else after its server handshake
    /// (None: the handshake failed or took longer than `HANDSHAKE_TIMEOUT`;
    /// the connection is then dropped).
    pub async fn accept(stream: S, tls: Option<&tokio_rustls::TlsAcceptor>) -> Option<MaybeTls<S>> {
        let Some(tls) = tls else {
            return Some(MaybeTls::Plain(stream));
        };
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.accept(stream)).await {
            Ok(Ok(s)) => Some(MaybeTls::Tls(Box::new(s.into()))),
            Ok(Err(error)) => {
                tracing::debug!(%error, "TLS handshake failed");
                None
            }
            Err(_) => {
                tracing::debug!("TLS handshake timed out");
                None
            }
        }
    }

    /// `stream` as is without `tls`, else after a client handshake with
    /// the server named by `hostport`'s host (the name its certificate
    /// must carry).
    pub async fn connect(
        stream: S,
        tls: Option<&Arc<rustls::ClientConfig>>,
        hostport: &str,
    ) -> std::io::Result<MaybeTls<S>> {
        let Some(tls) = tls else {
            return Ok(MaybeTls::Plain(stream));
        };
        let name = server_name(hostport)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let s = tokio_rustls::TlsConnector::from(tls.clone())
            .connect(name, stream)
            .await?;
        Ok(MaybeTls::Tls(Box::new(s.into())))
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, MaybeTls::Tls(_))
    }

    /// The negotiated TLS version (`"1.2"`, `"1.3"`), None for a plain
    /// connection.
    pub fn tls_version(&self) -> Option<&'static str> {
        let MaybeTls::Tls(s) = self else { return None };
        match s.get_ref().1.protocol_version() {
            Some(rustls::ProtocolVersion::TLSv1_3) => Some("1.3"),
            Some(rustls::ProtocolVersion::TLSv1_2) => Some("1.2"),
            // rustls speaks nothing else; a version it cannot name is still TLS.
            _ => Some("1.2"),
        }
    }
}

impl<S: std::os::fd::AsRawFd> std::os::fd::AsRawFd for MaybeTls<S> {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        match self {
            MaybeTls::Plain(s) => s.as_raw_fd(),
            MaybeTls::Tls(s) => s.get_ref().0.as_raw_fd(),
        }
    }
}

impl<S> tokio::io::AsyncRead for MaybeTls<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            MaybeTls::Tls(s) => std::pin::Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl<S> tokio::io::AsyncWrite for MaybeTls<S>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            MaybeTls::Tls(s) => std::pin::Pin::new(s).poll_write(cx, buf),
        }
    }

    // Without these the default says "not vectored", and hyper then copies
    // every body chunk into one buffer before writing it (a sixth of a
    // large GET's server CPU).
    fn poll_write_vectored(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => std::pin::Pin::new(s).poll_write_vectored(cx, bufs),
            MaybeTls::Tls(s) => std::pin::Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            MaybeTls::Plain(s) => s.is_write_vectored(),
            MaybeTls::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => std::pin::Pin::new(s).poll_flush(cx),
            MaybeTls::Tls(s) => std::pin::Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            MaybeTls::Tls(s) => std::pin::Pin::new(s).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_names_drop_the_port_and_brackets() {
        assert_eq!(
            server_name("127.0.0.1:9000").unwrap(),
            ServerName::try_from("127.0.0.1").unwrap()
        );
        assert_eq!(
            server_name("[::1]:9000").unwrap(),
            ServerName::try_from("::1").unwrap()
        );
        assert_eq!(
            server_name("node-1.tarn.svc:9000").unwrap(),
            ServerName::try_from("node-1.tarn.svc").unwrap()
        );
        assert!(server_name("bad name:1").is_err());
    }

    #[test]
    fn files_that_are_not_a_certificate_and_key_are_refused() {
        let dir = std::env::temp_dir().join(format!("tarn-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (c, k) = (dir.join("c.pem"), dir.join("k.pem"));
        std::fs::write(&c, "not a certificate").unwrap();
        std::fs::write(&k, "not a key").unwrap();
        let e = ServerCert::load(&c, &k).unwrap_err();
        assert!(e.contains("no PEM certificate"), "{e}");
        assert!(ServerCert::load(&dir.join("missing"), &k).is_err());
        assert!(roots(&c).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
