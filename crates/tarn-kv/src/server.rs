//! The KV server: TCP for any client, and for clients on the same host an
//! abstract Unix socket over which the daemon sends the arena's descriptor.
//!
//! Every connection authenticates first (HELLO, then AUTH: `auth.rs`) and is
//! then bound to its tenant: the tenant's engine serves it, and only the
//! namespaces the tenant is granted. A shared-memory client maps its
//! tenant's arena read-only (sealed against writable mappings) and never
//! touches another tenant's; it writes values into a put window of its own
//! (a memfd it passes with AUTH) that the daemon copies from (PUT_SHM).
//!
//! Each connection is served in order (a client may pipeline: frames queue in
//! the socket). What a connection holds — reservations not yet committed,
//! pins not yet released — is given back when it closes, however it closes,
//! so a client killed mid-put leaves no partial block and leaks nothing.
//! Connections that stay silent, or stop halfway through a frame or the
//! handshake, are closed after the configured timeouts.
//!
//! A shared-memory client may also ask for a request mailbox at HELLO
//! (`mailbox.rs`): its requests and responses then travel through shared
//! memory and the socket carries only doorbells.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio::sync::watch;

use crate::auth::{self, Side, Tenant, Tenants};
use crate::engine::{Engine, Key, PartCommit, ReadPlan, RoutingCounts};
use crate::fdpass;
use crate::mailbox::{self, Area, Mailbox};
use crate::park;
use crate::proto::*;
use crate::KvError;

/// Largest put window a client may pass with AUTH (it is the client's memory;
/// the limit keeps a bogus size from meaning anything).
pub const PUT_WINDOW_MAX_BYTES: u64 = 64 << 30;
/// GET_SHM results a mailbox publishes first; then twice as many each time.
const STREAM_FIRST_KEYS: usize = 2;
/// Pins one connection may hold at once.
const PINS_PER_CONNECTION_MAX: usize = 64 * BATCH_MAX_KEYS;
/// Read buffer per connection (frame headers and control parts).
const READ_BUFFER_BYTES: usize = 64 << 10;
/// Longest a connection spins for the client's next frame before parking.
/// A parked thread costs a wakeup (tens of microseconds on a VM) when the
/// next frame comes; an engine loading a prefix sends batches back to back,
/// a few hundred microseconds apart (the time it takes to copy one out).
/// The spin watches every socket of the thread (connections and listeners)
/// and ends as soon as any is readable, so it never holds up another client.
const NEXT_FRAME_SPIN_MAX: Duration = Duration::from_micros(2000);
/// While spinning, how often the sockets are polled (the mailboxes are looked
/// at continuously): a frame on a socket waits at most this much longer.
const SOCKET_POLL_INTERVAL: Duration = Duration::from_micros(5);
/// Gaps longer than this count as idle: they are clamped before averaging so
/// that a burst after a pause starts spinning after a couple of frames.
const FRAME_GAP_CLAMP_US: u64 = 4000;

thread_local! {
    /// Sockets served by this runtime thread: what a spin watches.
    static SOCKETS: std::cell::RefCell<Vec<libc::pollfd>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn watch_socket(fd: i32) {
    SOCKETS.with(|s| {
        s.borrow_mut().push(libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
    });
}

fn unwatch_socket(fd: i32) {
    SOCKETS.with(|s| s.borrow_mut().retain(|p| p.fd != fd));
}

thread_local! {
    /// Mailboxes served by this runtime thread: a spin ends when any of them
    /// holds a request, as it does when a socket becomes readable.
    static MAILBOXES: std::cell::RefCell<Vec<Arc<Mailbox>>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Spins until any socket of this thread is readable or the budget is spent.
fn spin_until_any_readable(budget: Duration) {
    let start = std::time::Instant::now();
    let mut polled = start;
    let mut backoff = mailbox::Backoff::default();
    SOCKETS.with(|s| {
        let mut fds = s.borrow_mut();
        MAILBOXES.with(|m| {
            let mailboxes = m.borrow();
            loop {
                // Mailboxes are memory: look at them every turn. Sockets take
                // a system call (~1 µs here): poll them every few turns only.
                if mailboxes.iter().any(|mb| mb.request_pending()) {
                    return;
                }
                let now = std::time::Instant::now();
                if now.duration_since(polled) >= SOCKET_POLL_INTERVAL || mailboxes.is_empty() {
                    polled = now;
                    // SAFETY: poll on live descriptors with a zero timeout.
                    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
                    if n != 0 {
                        return;
                    }
                }
                if now.duration_since(start) >= budget {
                    return;
                }
                backoff.turn();
            }
        })
    });
}

#[derive(Debug, Clone)]
pub struct ServerOptions {
    pub listen: SocketAddr,
    /// Runtime threads serving connections.
    pub threads: usize,
    /// Pin thread i to core i. Off in `tarn server`: a pinned thread whose
    /// core another process keeps busy cannot move to an idle one, and its
    /// clients wait (tests/kv_stall.rs).
    pub pin_cores: bool,
    pub io_uring: bool,
    /// Offer shared memory to clients on this host.
    pub shm: bool,
    /// Put the shared-memory socket in this directory (a file, e.g. on a
    /// host path that pods of one Kubernetes node share) rather than in
    /// the abstract namespace (which only the server's network namespace
    /// reaches).
    pub shm_dir: Option<std::path::PathBuf>,
    /// An authenticated connection with no request for this long is closed
    /// (its pins and reservations given back). Clients reconnect on their
    /// next call.
    pub idle_timeout: Duration,
    /// Longest the rest of a frame may take once its header arrived: a client
    /// that stalls mid-put cannot hold its reservations.
    pub frame_timeout: Duration,
    /// Longest from accept to a completed HELLO and AUTH, every byte of
    /// both frames included.
    pub handshake_timeout: Duration,
    /// Open connections (TCP and Unix, authenticated or not) past which a
    /// new one is closed at once, before it is read (each holds a
    /// descriptor and buffers).
    pub connections_max: usize,
    /// Authenticated connections one tenant may hold (each may pin blocks
    /// and hold put reservations); AUTH past it is answered `Limit`.
    pub connections_per_tenant_max: usize,
    /// TLS on TCP connections (None: plain). Shared-memory clients on the
    /// host talk over a Unix socket and share no bytes over the network.
    pub tls: Option<Arc<tarn_io::tls::rustls::ServerConfig>>,
}

/// Defaults of the timeouts (docs/configuration.md).
pub const IDLE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(300);
pub const FRAME_TIMEOUT_DEFAULT: Duration = Duration::from_secs(30);
pub const HANDSHAKE_TIMEOUT_DEFAULT: Duration = Duration::from_secs(10);
/// Defaults of the connection caps (docs/configuration.md): the server
/// derives its own from its descriptor limit.
pub const CONNECTIONS_MAX_DEFAULT: usize = 4096;
pub const CONNECTIONS_PER_TENANT_MAX_DEFAULT: usize = 3072;

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            threads: 1,
            pin_cores: false,
            io_uring: false,
            shm: true,
            shm_dir: None,
            idle_timeout: IDLE_TIMEOUT_DEFAULT,
            frame_timeout: FRAME_TIMEOUT_DEFAULT,
            handshake_timeout: HANDSHAKE_TIMEOUT_DEFAULT,
            connections_max: CONNECTIONS_MAX_DEFAULT,
            connections_per_tenant_max: CONNECTIONS_PER_TENANT_MAX_DEFAULT,
            tls: None,
        }
    }
}

/// The view of the cluster's KV members this node routes by: what CLUSTER
/// answers, and what routed batches are checked against. Outside a cluster
/// it stays empty (epoch 0, no members).
#[derive(Default)]
pub struct Views(std::sync::RwLock<Arc<ClusterView>>);

impl Views {
    pub fn get(&self) -> Arc<ClusterView> {
        self.0.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes `view` unless it is older than the one held.
    pub fn set(&self, view: ClusterView) {
        let mut cur = self.0.write().unwrap_or_else(|p| p.into_inner());
        if view.epoch >= cur.epoch {
            *cur = Arc::new(view);
        }
    }
}

/// A running KV server; stops when dropped.
pub struct Server {
    pub tcp_addr: SocketAddr,
    /// The cluster view it routes by (set by the node's membership watch).
    pub views: Arc<Views>,
    /// The shared-memory transport's Unix socket: an abstract name, or a
    /// path (starting with `/`) under [`ServerOptions::shm_dir`].
    pub shm_socket: Option<String>,
    /// The socket file to remove at shutdown (with `shm_dir`).
    shm_file: Option<std::path::PathBuf>,
    /// Open connections and those refused for the caps.
    pub connections: Arc<ConnectionCounts>,
    stop: watch::Sender<bool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

#[derive(Debug, Clone, Copy)]
struct Timeouts {
    idle: Duration,
    frame: Duration,
    handshake: Duration,
}

/// Open connections against their caps, and those refused.
#[derive(Default)]
pub struct ConnectionCounts {
    open: std::sync::atomic::AtomicUsize,
    max: usize,
    per_tenant_max: usize,
    /// Authenticated connections by tenant name.
    authenticated: std::sync::Mutex<std::collections::HashMap<String, usize>>,
    pub refused_open: AtomicU64,
    pub refused_tenant: AtomicU64,
}

impl ConnectionCounts {
    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// A slot for a new connection, or `None` past the cap.
    fn admit(self: &Arc<Self>) -> Option<Admitted> {
        if self.open.fetch_add(1, Ordering::Relaxed) >= self.max {
            self.open.fetch_sub(1, Ordering::Relaxed);
            self.refused_open.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(Admitted(self.clone()))
    }

    /// A slot for one more authenticated connection of `tenant`.
    fn authenticate(self: &Arc<Self>, tenant: &str) -> Option<TenantSlot> {
        let mut m = self.authenticated.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(tenant.to_string()).or_insert(0);
        if *n >= self.per_tenant_max {
            self.refused_tenant.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *n += 1;
        Some(TenantSlot(self.clone(), tenant.to_string()))
    }
}

/// One open connection's slot, given back when dropped.
struct Admitted(Arc<ConnectionCounts>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One authenticated connection's slot in its tenant's count.
struct TenantSlot(Arc<ConnectionCounts>, String);

impl Drop for TenantSlot {
    fn drop(&mut self) {
        let mut m = self
            .0
            .authenticated
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.1) {
            *n -= 1;
        }
    }
}

struct Shared {
    tenants: Tenants,
    counts: Arc<ConnectionCounts>,
    shm_socket: Option<Vec<u8>>,
    next_conn: AtomicU64,
    /// Random per server: the Unix socket's HELLO reply repeats it, so a
    /// client knows it reached the daemon its TCP connection did.
    instance_id: [u8; 16],
    value_max_bytes: u64,
    timeouts: Timeouts,
    views: Arc<Views>,
}

impl Shared {
    fn new(
        tenants: Tenants,
        shm_socket: Option<Vec<u8>>,
        timeouts: Timeouts,
        counts: Arc<ConnectionCounts>,
    ) -> Shared {
        let value_max_bytes = tenants
            .iter()
            .map(|t| t.engine.config().value_max_bytes)
            .min()
            .expect("at least one tenant");
        Shared {
            tenants,
            counts,
            shm_socket,
            next_conn: AtomicU64::new(1),
            instance_id: auth::nonce()[..16].try_into().expect("16 bytes"),
            value_max_bytes,
            timeouts,
            views: Arc::default(),
        }
    }
}

impl Server {
    pub fn start(tenants: Tenants, opts: ServerOptions) -> Result<Server, KvError> {
        let tcp = std::net::TcpListener::bind(opts.listen)
            .map_err(|e| KvError::Io("binding the KV listener", e))?;
        tcp.set_nonblocking(true)
            .map_err(|e| KvError::Io("KV listener", e))?;
        let tcp_addr = tcp
            .local_addr()
            .map_err(|e| KvError::Io("KV listener", e))?;
        // Shared memory only where the kernel keeps clients' mappings of the
        // arena read-only: a client that could write it could forge blocks.
        let sealed = tenants.iter().all(|t| t.engine.arena().write_sealed);
        if opts.shm && !sealed {
            tracing::warn!(
                "this kernel does not seal the KV arena against writable mappings \
                 (F_SEAL_FUTURE_WRITE); shared memory is off, clients use TCP"
            );
        }
        let (uds, shm_socket) = if opts.shm && sealed {
            let mut r = [0u8; 8];
            getrandom::fill(&mut r).map_err(|e| KvError::Config(e.to_string()))?;
            let name = format!(
                "tarn-kv.{}.{}.{:016x}",
                std::process::id(),
                tcp_addr.port(),
                u64::from_le_bytes(r)
            );
            let (l, name) = match &opts.shm_dir {
                Some(dir) => bind_shm_file(dir, &name)?,
                None => {
                    use std::os::linux::net::SocketAddrExt;
                    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
                        .map_err(|e| KvError::Io("KV shared-memory socket name", e))?;
                    let l = std::os::unix::net::UnixListener::bind_addr(&addr)
                        .map_err(|e| KvError::Io("binding the KV shared-memory socket", e))?;
                    (l, name)
                }
            };
            l.set_nonblocking(true)
                .map_err(|e| KvError::Io("KV shared-memory socket", e))?;
            (Some(l), Some(name))
        } else {
            (None, None)
        };
        let shared = Arc::new(Shared::new(
            tenants,
            shm_socket.as_ref().map(|s| s.as_bytes().to_vec()),
            Timeouts {
                idle: opts.idle_timeout,
                frame: opts.frame_timeout,
                handshake: opts.handshake_timeout,
            },
            Arc::new(ConnectionCounts {
                max: opts.connections_max.max(1),
                per_tenant_max: opts.connections_per_tenant_max.max(1),
                ..ConnectionCounts::default()
            }),
        ));
        let (stop, stop_rx) = watch::channel(false);
        let mut threads = Vec::new();
        for core in 0..opts.threads.max(1) {
            let tcp = tcp.try_clone().map_err(|e| KvError::Io("KV listener", e))?;
            let uds = match &uds {
                Some(u) => Some(
                    u.try_clone()
                        .map_err(|e| KvError::Io("KV shared-memory socket", e))?,
                ),
                None => None,
            };
            let shared = shared.clone();
            let stop = stop_rx.clone();
            let (pin, uring) = (opts.pin_cores, opts.io_uring);
            let tls = opts
                .tls
                .clone()
                .map(tarn_io::tls::tokio_rustls::TlsAcceptor::from);
            let t = std::thread::Builder::new()
                .name(format!("tarn-kv-{core}"))
                .spawn(move || {
                    let rt = match tarn_io::runtime::build_core_runtime(core, pin, uring) {
                        Ok(rt) => rt,
                        Err(error) => {
                            tracing::error!(%error, "KV runtime failed to start");
                            return;
                        }
                    };
                    rt.block_on(accept_loop(tcp, uds, shared, tls, stop));
                })
                .map_err(|e| KvError::Io("starting a KV thread", e))?;
            threads.push(t);
        }
        Ok(Server {
            tcp_addr,
            connections: shared.counts.clone(),
            views: shared.views.clone(),
            shm_file: shm_socket
                .as_ref()
                .filter(|s| s.starts_with('/'))
                .map(std::path::PathBuf::from),
            shm_socket,
            stop,
            threads,
        })
    }

    /// Stops accepting, drops every connection and joins the threads. The
    /// arena has no name anywhere: it goes away with the last mapping.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        let _ = self.stop.send(true);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        if let Some(f) = self.shm_file.take() {
            let _ = std::fs::remove_file(f);
        }
    }
}

/// Binds the shared-memory socket as the file `dir/name.sock`, readable
/// and writable by every local user (a client still authenticates, and
/// learns the name only from an authenticated server's HELLO). Sockets of
/// this user's servers that died without removing theirs (nothing accepts
/// on them) are removed first.
fn bind_shm_file(
    dir: &std::path::Path,
    name: &str,
) -> Result<(std::os::unix::net::UnixListener, String), KvError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let io = |what: &'static str| move |e| KvError::Io(what, e);
    let dir = std::fs::canonicalize(dir).map_err(io("the KV shared-memory directory"))?;
    if let Ok(entries) = std::fs::read_dir(&dir) {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        for e in entries.flatten() {
            let n = e.file_name();
            let n = n.to_string_lossy();
            let ours = n.starts_with("tarn-kv.")
                && n.ends_with(".sock")
                && e.metadata().is_ok_and(|m| m.uid() == me);
            if ours
                && std::os::unix::net::UnixStream::connect(e.path())
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
            {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    let path = dir.join(format!("{name}.sock"));
    let Some(text) = path.to_str().map(str::to_string) else {
        return Err(KvError::Config(format!(
            "the KV shared-memory directory {} is not UTF-8",
            dir.display()
        )));
    };
    // sun_path holds 108 bytes with the NUL.
    if text.len() > 107 {
        return Err(KvError::Config(format!(
            "the KV shared-memory directory {} is too long a path for a Unix socket",
            dir.display()
        )));
    }
    let l = std::os::unix::net::UnixListener::bind(&path)
        .map_err(io("binding the KV shared-memory socket"))?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666))
        .map_err(io("the KV shared-memory socket's permissions"))?;
    Ok((l, text))
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn default_timeouts() -> Timeouts {
    Timeouts {
        idle: IDLE_TIMEOUT_DEFAULT,
        frame: FRAME_TIMEOUT_DEFAULT,
        handshake: HANDSHAKE_TIMEOUT_DEFAULT,
    }
}

fn default_counts() -> Arc<ConnectionCounts> {
    Arc::new(ConnectionCounts {
        max: CONNECTIONS_MAX_DEFAULT,
        per_tenant_max: CONNECTIONS_PER_TENANT_MAX_DEFAULT,
        ..ConnectionCounts::default()
    })
}

/// Serves one connection on any byte stream with TCP semantics (no shared
/// memory): used by the fuzz target and by tests. With `preauthenticated`
/// the connection starts as the first tenant (the fuzz target explores the
/// operations); otherwise it must do HELLO and AUTH like any client.
pub async fn serve_stream<S: AsyncRead + AsyncWrite + Unpin>(
    tenants: Tenants,
    stream: S,
    preauthenticated: bool,
) {
    let first = tenants.iter().next().cloned();
    let shared = Arc::new(Shared::new(
        tenants,
        None,
        default_timeouts(),
        default_counts(),
    ));
    let mut c = Connection::new(u64::MAX, shared, false);
    if preauthenticated {
        c.tenant = first;
    }
    c.serve(BufReader::with_capacity(READ_BUFFER_BYTES, stream))
        .await;
}

/// Answers one request placed in `mailbox` on a connection of its own,
/// authenticated as the engine's only tenant (what the fuzz target drives;
/// the daemon's connections run `serve_mailbox`).
pub async fn answer_mailbox_once(engine: Arc<Engine>, mailbox: &Mailbox, seq: u64) {
    let tenants = Tenants::single(engine, auth::Credentials::loopback_default());
    let first = tenants.iter().next().cloned();
    let shared = Arc::new(Shared::new(
        tenants,
        None,
        default_timeouts(),
        default_counts(),
    ));
    let mut c = Connection::new(u64::MAX, shared, true);
    c.tenant = first;
    let mut out = Vec::new();
    c.answer_mailbox(mailbox, seq, &mut out).await;
    c.release();
}

async fn accept_loop(
    tcp: std::net::TcpListener,
    uds: Option<std::os::unix::net::UnixListener>,
    shared: Arc<Shared>,
    tls: Option<tarn_io::tls::tokio_rustls::TlsAcceptor>,
    mut stop: watch::Receiver<bool>,
) {
    let tcp = match TcpListener::from_std(tcp) {
        Ok(l) => l,
        Err(error) => {
            tracing::error!(%error, "KV listener");
            return;
        }
    };
    let uds = uds.and_then(|u| UnixListener::from_std(u).ok());
    watch_socket(tcp.as_raw_fd());
    if let Some(u) = &uds {
        watch_socket(u.as_raw_fd());
    }
    loop {
        tokio::select! {
            a = tcp.accept() => match a {
                Ok((s, _)) => {
                    // Over the cap the descriptor goes back before any read.
                    let Some(admitted) = shared.counts.admit() else {
                        drop(s);
                        continue;
                    };
                    let _ = s.set_nodelay(true);
                    let shared = shared.clone();
                    let tls = tls.clone();
                    tokio::spawn(async move {
                        let _admitted = admitted;
                        let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                        let mut c = Connection::new(conn, shared, false);
                        let Some(tls) = tls else {
                            c.spin_fd = Some(s.as_raw_fd());
                            c.serve(BufReader::with_capacity(READ_BUFFER_BYTES, s)).await;
                            return;
                        };
                        // The handshake counts against the HELLO/AUTH time.
                        // No spinning on the socket: plaintext may wait in
                        // the TLS layer while the socket has nothing new.
                        let limit = c.shared.timeouts.handshake;
                        match tokio::time::timeout(limit, tls.accept(s)).await {
                            Ok(Ok(s)) => c.serve(BufReader::with_capacity(READ_BUFFER_BYTES, s)).await,
                            Ok(Err(error)) => tracing::debug!(conn, %error, "KV TLS handshake failed"),
                            Err(_) => tracing::debug!(conn, "KV TLS handshake timed out"),
                        }
                    });
                }
                Err(error) => {
                    tracing::warn!(%error, "KV accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            a = async { match &uds { Some(u) => u.accept().await, None => std::future::pending().await } } => match a {
                Ok((s, _)) => {
                    let Some(admitted) = shared.counts.admit() else {
                        drop(s);
                        continue;
                    };
                    let shared = shared.clone();
                    tokio::spawn(async move {
                        let _admitted = admitted;
                        let conn = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                        let mut c = Connection::new(conn, shared, true);
                        let limit = c.shared.timeouts.handshake;
                        let handshake = tokio::time::timeout(limit, c.shm_handshake(&s)).await;
                        match handshake {
                            Ok(Ok(())) => {}
                            Ok(Err(error)) => {
                                tracing::debug!(conn, %error, "KV shared-memory handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(conn, "KV shared-memory handshake timed out");
                                return;
                            }
                        }
                        c.spin_fd = Some(s.as_raw_fd());
                        match c.mailbox.take() {
                            Some(mailbox) => c.serve_mailbox(s, mailbox).await,
                            None => c.serve(BufReader::with_capacity(READ_BUFFER_BYTES, s)).await,
                        }
                    });
                }
                Err(error) => {
                    tracing::warn!(%error, "KV accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            _ = stop.changed() => break,
        }
    }
}

/// Takes a connection's socket (and mailbox) off the thread's spin lists
/// however `serve` ends.
struct WatchGuard(Option<i32>, Option<Arc<Mailbox>>);

impl WatchGuard {
    fn new(fd: Option<i32>, mailbox: Option<Arc<Mailbox>>) -> WatchGuard {
        if let Some(fd) = fd {
            watch_socket(fd);
        }
        if let Some(mb) = &mailbox {
            MAILBOXES.with(|m| m.borrow_mut().push(mb.clone()));
        }
        WatchGuard(fd, mailbox)
    }
}

impl Drop for WatchGuard {
    fn drop(&mut self) {
        if let Some(fd) = self.0 {
            unwatch_socket(fd);
        }
        if let Some(mb) = self.1.take() {
            MAILBOXES.with(|m| m.borrow_mut().retain(|x| !Arc::ptr_eq(x, &mb)));
        }
    }
}

/// A shared-memory client's put window: a memfd it owns, passed with AUTH.
/// A window sealed against shrinking (`F_SEAL_SHRINK`, as Tarn's clients
/// seal theirs) is mapped read-only and copied from with a plain memcpy:
/// its size can never drop below the mapping, so no read of it can fault
/// (a hole punched in it reads as zeros). Any other window is only read
/// with `pread`, which turns a truncated window into a short read. Either
/// way a client that rewrites its window while the daemon reads gets a
/// checksum mismatch on its own put, and cannot make the daemon fault.
/// What PUT_SHM reads from a put window per `pread` before checksumming it.
const WINDOW_READ_PIECE_BYTES: usize = 64 << 10;

struct Window {
    fd: OwnedFd,
    len: u64,
    /// The window mapped read-only, when it is sealed against shrinking.
    map: Option<WindowMap>,
}

/// A read-only mapping of a sealed put window.
struct WindowMap {
    base: *const u8,
    len: usize,
}

// SAFETY: a read-only mapping owned by one connection, unmapped in Drop.
unsafe impl Send for WindowMap {}
unsafe impl Sync for WindowMap {}

impl WindowMap {
    /// Maps `fd` read-only if its seals forbid shrinking it; None otherwise
    /// (or if the mapping fails), and the window is read with `pread`.
    fn sealed(fd: &OwnedFd, len: u64) -> Option<WindowMap> {
        // SAFETY: fcntl and mmap on a descriptor we own; the mapping is
        // owned by the returned value.
        unsafe {
            let seals = libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS);
            if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
                return None;
            }
            let p = libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            );
            (p != libc::MAP_FAILED).then(|| WindowMap {
                base: p.cast(),
                len: len as usize,
            })
        }
    }
}

impl Drop for WindowMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

impl Window {
    /// Only memory-backed files (memfd, tmpfs): a descriptor of a file on a
    /// FUSE mount or a device could make the daemon's reads block, and a
    /// hugetlbfs one could fault on holes.
    fn accept(fd: OwnedFd) -> Result<Window, String> {
        // SAFETY: fstat/fstatfs into zeroed structs on a descriptor we own.
        let (st, fs) = unsafe {
            let mut st: libc::stat = std::mem::zeroed();
            let mut fs: libc::statfs = std::mem::zeroed();
            if libc::fstat(fd.as_raw_fd(), &mut st) < 0
                || libc::fstatfs(fd.as_raw_fd(), &mut fs) < 0
            {
                return Err(format!(
                    "put window descriptor: {}",
                    io::Error::last_os_error()
                ));
            }
            (st, fs)
        };
        if st.st_mode & libc::S_IFMT != libc::S_IFREG || fs.f_type != libc::TMPFS_MAGIC {
            return Err("the put window must be a memfd (shared memory)".into());
        }
        let len = st.st_size as u64;
        if len == 0 || len > PUT_WINDOW_MAX_BYTES {
            return Err(format!(
                "put window of {len} bytes (1 to {PUT_WINDOW_MAX_BYTES})"
            ));
        }
        let map = WindowMap::sealed(&fd, len);
        Ok(Window { fd, len, map })
    }

    /// Reads `dst.len()` bytes at `offset` of the window and returns their
    /// CRC32C, computed a piece at a time right after each piece is read,
    /// while it is in the cache (one pass over memory, not two).
    fn read_into(&self, offset: u64, dst: &mut [u8]) -> io::Result<u32> {
        if let Some(m) = &self.map {
            let end = (offset as usize)
                .checked_add(dst.len())
                .filter(|&e| e <= m.len)
                .ok_or(io::ErrorKind::UnexpectedEof)?;
            // SAFETY: inside the mapping (checked above), which the seal keeps
            // backed by the file; the client may write it meanwhile, which
            // only makes its own checksum fail.
            let src = unsafe {
                std::slice::from_raw_parts(m.base.add(offset as usize), end - offset as usize)
            };
            return Ok(copy_with_crc_into_arena(dst, src));
        }
        let mut crc = Crc32c::default();
        for (i, piece) in dst.chunks_mut(WINDOW_READ_PIECE_BYTES).enumerate() {
            self.read_exact_at(offset + (i * WINDOW_READ_PIECE_BYTES) as u64, piece)?;
            crc.update(piece);
        }
        Ok(crc.finish())
    }

    fn read_exact_at(&self, mut offset: u64, mut dst: &mut [u8]) -> io::Result<()> {
        while !dst.is_empty() {
            // SAFETY: pread into a live buffer of dst.len() bytes.
            let n = unsafe {
                libc::pread(
                    self.fd.as_raw_fd(),
                    dst.as_mut_ptr().cast(),
                    dst.len(),
                    offset as libc::off_t,
                )
            };
            match n {
                n if n > 0 => {
                    offset += n as u64;
                    dst = &mut dst[n as usize..];
                }
                0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                _ => {
                    let e = io::Error::last_os_error();
                    if e.kind() != io::ErrorKind::Interrupted {
                        return Err(e);
                    }
                }
            }
        }
        Ok(())
    }
}

/// Per-connection state, buffers reused across frames.
struct Connection {
    id: u64,
    shared: Arc<Shared>,
    shm: bool,
    /// After HELLO: the nonce AUTH must answer, and HELLO's flags.
    hello: Option<(auth::Nonce, u32)>,
    /// After AUTH: who this connection is, and its slot in the tenant's
    /// count of authenticated connections.
    tenant: Option<Arc<Tenant>>,
    tenant_slot: Option<TenantSlot>,
    /// Shared memory: the client's put window (PUT_SHM reads from it).
    window: Option<Window>,
    /// The socket to spin on between frames (None: never spin).
    spin_fd: Option<i32>,
    /// Set by a handshake that asked for a request mailbox.
    mailbox: Option<Arc<Mailbox>>,
    /// When the last answer went out, and the average time the client took
    /// to send its next frame (microseconds, clamped).
    answered_at: Instant,
    gap_ewma_us: u64,
    reservations: Vec<u64>,
    pins: Vec<Key>,
    payload: Vec<u8>,
    out: Vec<u8>,
    digests: Vec<Digest>,
    gets: Vec<GetEntry>,
    plans: Vec<ReadPlan>,
    statuses: Vec<Status>,
    present: Vec<bool>,
    held: Vec<u32>,
    /// Flags of the batch being served (`BATCH_FALLBACK`, `BATCH_COPY`).
    batch_flags: u16,
}

/// How a frame ended for the connection.
enum Next {
    Continue,
    Close,
}

fn frame_error(out: &mut Vec<u8>, request_id: u64, e: &ProtoError) {
    begin_frame(out, Op::Error as u16 | RESPONSE_BIT, request_id);
    encode_error(out, e.code, &e.message);
    finish_frame(out, 0);
}

/// Reads one whole frame from the Unix socket during the handshake, with any
/// descriptors sent along, never past the frame's end.
async fn read_frame_uds(
    s: &UnixStream,
    payload_max: u64,
) -> io::Result<(FrameHeader, Vec<u8>, Vec<OwnedFd>)> {
    let mut fds = Vec::new();
    let mut head = [0u8; FRAME_HEADER_BYTES];
    recv_exact_uds(s, &mut head, &mut fds).await?;
    let h = FrameHeader::decode(&head).map_err(io::Error::other)?;
    if h.len > payload_max {
        return Err(io::Error::other(format!(
            "handshake frame of {} bytes",
            h.len
        )));
    }
    let mut payload = vec![0u8; h.len as usize];
    recv_exact_uds(s, &mut payload, &mut fds).await?;
    Ok((h, payload, fds))
}

async fn recv_exact_uds(s: &UnixStream, buf: &mut [u8], fds: &mut Vec<OwnedFd>) -> io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        s.readable().await?;
        match s.try_io(tokio::io::Interest::READABLE, || {
            fdpass::recv(s.as_raw_fd(), &mut buf[done..])
        }) {
            Ok((0, _)) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok((n, f)) => {
                done += n;
                fds.extend(f);
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Connection {
    fn new(id: u64, shared: Arc<Shared>, shm: bool) -> Self {
        Connection {
            id,
            shared,
            shm,
            hello: None,
            tenant: None,
            tenant_slot: None,
            window: None,
            spin_fd: None,
            mailbox: None,
            answered_at: Instant::now(),
            gap_ewma_us: FRAME_GAP_CLAMP_US,
            reservations: Vec::new(),
            pins: Vec::new(),
            payload: Vec::new(),
            out: Vec::new(),
            digests: Vec::new(),
            gets: Vec::new(),
            plans: Vec::new(),
            statuses: Vec::new(),
            present: Vec::new(),
            held: Vec::new(),
            batch_flags: 0,
        }
    }

    fn tenant(&self) -> &Arc<Tenant> {
        self.tenant
            .as_ref()
            .expect("operations run on authenticated connections only")
    }

    fn engine(&self) -> Arc<Engine> {
        self.tenant().engine.clone()
    }

    /// Gives back what the connection holds (however it ended).
    fn release(&mut self) {
        if let Some(t) = &self.tenant {
            t.engine
                .release_connection(self.id, &self.reservations, &self.pins);
        }
        self.reservations.clear();
        self.pins.clear();
    }

    fn hello_reply(
        &mut self,
        hello: &Hello,
        request_id: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), ProtoError> {
        let version = hello.version_max.min(VERSION_MAX);
        if version < hello.version_min.max(VERSION_MIN) {
            return Err(ProtoError::new(
                ErrorCode::Version,
                format!(
                    "client speaks versions {}..={}, server {VERSION_MIN}..={VERSION_MAX}",
                    hello.version_min, hello.version_max
                ),
            ));
        }
        let nonce = auth::nonce();
        self.hello = Some((nonce, hello.flags));
        let reply = HelloReply {
            version,
            flags: if self.shared.shm_socket.is_some() {
                HELLO_SHM_OFFERED
            } else {
                0
            },
            value_max_bytes: self.shared.value_max_bytes,
            batch_max_keys: BATCH_MAX_KEYS as u32,
            namespace_max_bytes: NAMESPACE_MAX_BYTES as u16,
            instance_id: self.shared.instance_id,
            nonce,
            shm_socket: self.shared.shm_socket.clone().unwrap_or_default(),
        };
        begin_frame(out, Op::Hello as u16 | RESPONSE_BIT, request_id);
        reply.encode(out);
        finish_frame(out, 0);
        Ok(())
    }

    /// Checks an AUTH request against the nonce of this connection's HELLO
    /// and binds the connection to its tenant. A failure closes the
    /// connection (the caller's job); the reason is logged, not told: an
    /// unknown key and a wrong secret look the same to the client.
    fn authenticate(
        &mut self,
        payload: &[u8],
        window: Option<OwnedFd>,
    ) -> Result<AuthReply, ProtoError> {
        let Some((nonce, _)) = self.hello else {
            return Err(ProtoError::new(
                ErrorCode::HandshakeRequired,
                "AUTH before HELLO",
            ));
        };
        let a = Auth::decode(payload)?;
        let denied = || ProtoError::new(ErrorCode::Denied, "access denied");
        let Some(tenant) = self.shared.tenants.by_access_key(&a.access_key).cloned() else {
            tracing::info!(conn = self.id, access_key = %String::from_utf8_lossy(&a.access_key), "KV AUTH with an unknown access key");
            return Err(denied());
        };
        let secret = &tenant.credentials.secret_key;
        if !auth::verify(
            Side::Client,
            secret,
            &nonce,
            &a.client_nonce,
            &a.access_key,
            &a.proof,
        ) {
            tracing::info!(conn = self.id, tenant = %tenant.name, "KV AUTH with a wrong proof");
            return Err(denied());
        }
        let Some(slot) = self.shared.counts.authenticate(&tenant.name) else {
            tracing::warn!(conn = self.id, tenant = %tenant.name, "KV AUTH refused: the tenant holds its cap of connections");
            return Err(ProtoError::new(
                ErrorCode::Limit,
                "this tenant holds as many connections as it may (connections_per_tenant_max)",
            ));
        };
        self.tenant_slot = Some(slot);
        let mut flags = 0;
        if a.flags & AUTH_WINDOW != 0 {
            if !self.shm {
                return Err(ProtoError::new(
                    ErrorCode::BadFrame,
                    "a put window needs the shared-memory socket",
                ));
            }
            let fd = window.ok_or_else(|| {
                ProtoError::new(
                    ErrorCode::BadFrame,
                    "AUTH names a put window but carries none",
                )
            })?;
            self.window =
                Some(Window::accept(fd).map_err(|m| ProtoError::new(ErrorCode::BadFrame, m))?);
            flags |= AUTH_WINDOW_ACCEPTED;
        }
        if self.shm {
            flags |= AUTH_SHM;
        }
        self.hello = None;
        let reply = AuthReply {
            flags,
            server_proof: auth::proof(Side::Server, secret, &nonce, &a.client_nonce, &a.access_key),
            arena_bytes: if self.shm {
                tenant.engine.arena().len() as u64
            } else {
                0
            },
            tenant: tenant.name.clone(),
            grants: tenant.grants.as_prefixes().to_vec(),
        };
        self.tenant = Some(tenant);
        Ok(reply)
    }

    /// The Unix socket's handshake: HELLO (with `WANT_SHM`), then AUTH, whose
    /// reply carries the tenant's arena (and the mailbox) as SCM_RIGHTS.
    /// Any failure is answered with an error frame and ends the connection.
    async fn shm_handshake(&mut self, s: &UnixStream) -> io::Result<()> {
        let mut out = Vec::new();
        let (h, payload, _) = read_frame_uds(s, AUTH_MAX_BYTES as u64).await?;
        let r = if h.op != Op::Hello as u16 {
            Err(ProtoError::new(
                ErrorCode::HandshakeRequired,
                "the first frame must be HELLO",
            ))
        } else {
            Hello::decode(&payload).and_then(|hello| {
                if hello.flags & HELLO_WANT_SHM == 0 {
                    return Err(ProtoError::new(
                        ErrorCode::BadFrame,
                        "HELLO on the shared-memory socket without WANT_SHM",
                    ));
                }
                self.hello_reply(&hello, h.request_id, &mut out)
            })
        };
        if let Err(e) = r {
            return self.refuse_uds(s, h.request_id, e).await;
        }
        send_with_fds(s, &out, &[]).await?;

        let (h, payload, fds) = read_frame_uds(s, AUTH_MAX_BYTES as u64).await?;
        if h.op != Op::Auth as u16 {
            let e = ProtoError::new(ErrorCode::HandshakeRequired, "AUTH must follow HELLO");
            return self.refuse_uds(s, h.request_id, e).await;
        }
        let want_mailbox = self.hello.is_some_and(|(_, f)| f & HELLO_WANT_MAILBOX != 0);
        let mut reply = match self.authenticate(&payload, fds.into_iter().next()) {
            Ok(r) => r,
            Err(e) => return self.refuse_uds(s, h.request_id, e).await,
        };
        if want_mailbox {
            match Mailbox::create() {
                Ok(mb) => {
                    self.mailbox = Some(Arc::new(mb));
                    reply.flags |= AUTH_MAILBOX;
                }
                Err(error) => {
                    tracing::warn!(%error, "creating a KV mailbox; serving on the socket")
                }
            }
        }
        begin_frame(&mut out, Op::Auth as u16 | RESPONSE_BIT, h.request_id);
        reply.encode(&mut out);
        finish_frame(&mut out, 0);
        let arena = self.tenant().engine.arena().fd().as_raw_fd();
        match &self.mailbox {
            Some(mb) => send_with_fds(s, &out, &[arena, mb.fd().as_raw_fd()]).await,
            None => send_with_fds(s, &out, &[arena]).await,
        }
    }

    async fn refuse_uds(
        &mut self,
        s: &UnixStream,
        request_id: u64,
        e: ProtoError,
    ) -> io::Result<()> {
        let mut out = Vec::new();
        frame_error(&mut out, request_id, &e);
        send_with_fds(s, &out, &[]).await?;
        Err(io::Error::other(e))
    }

    async fn serve<S: AsyncRead + AsyncWrite + Unpin>(&mut self, mut io: BufReader<S>) {
        let _watch = WatchGuard::new(self.spin_fd, None);
        let accepted = Instant::now();
        loop {
            let authenticated = self.tenant.is_some();
            if authenticated && self.spin_fd.is_some() && io.buffer().is_empty() {
                // Adaptive: spin about as long as this client usually takes to
                // send its next frame, and not at all for an idle client.
                let spin = Duration::from_micros(self.gap_ewma_us * 3 / 2 + 20);
                if spin <= NEXT_FRAME_SPIN_MAX {
                    spin_until_any_readable(spin);
                }
            }
            // Between frames a connection may be silent for the idle timeout;
            // before it has authenticated, only for what is left of the
            // handshake's time.
            let wait = if authenticated {
                self.shared.timeouts.idle
            } else {
                self.shared
                    .timeouts
                    .handshake
                    .saturating_sub(accepted.elapsed())
            };
            // The first byte of a header may take the idle time; once a
            // frame has begun, its header must come whole within the frame
            // timeout (or what is left of the handshake's).
            match tokio::time::timeout(wait, io.fill_buf()).await {
                Ok(Ok(b)) if !b.is_empty() => {}
                Ok(_) => break,
                Err(_) => {
                    tracing::debug!(conn = self.id, authenticated, "KV connection timed out");
                    break;
                }
            }
            let mut head = [0u8; FRAME_HEADER_BYTES];
            let rest = self.frame_time_left(accepted);
            match tokio::time::timeout(rest, io.read_exact(&mut head)).await {
                Ok(Ok(_)) => {}
                Ok(Err(_)) => break,
                Err(_) => {
                    tracing::debug!(conn = self.id, "KV connection stalled mid-header");
                    break;
                }
            }
            let gap = (self.answered_at.elapsed().as_micros() as u64).min(FRAME_GAP_CLAMP_US);
            self.gap_ewma_us = (3 * self.gap_ewma_us + gap) / 4;
            let r = self.frame(&mut io, &head, accepted).await;
            self.answered_at = Instant::now();
            match r {
                Ok(Next::Continue) => {}
                Ok(Next::Close) => break,
                Err(error) => {
                    tracing::debug!(conn = self.id, %error, "KV connection ended");
                    break;
                }
            }
        }
        let _ = io.get_mut().shutdown().await;
        self.release();
    }

    /// How long the rest of a frame may take: the frame timeout, or before
    /// AUTH what is left of the handshake's time (HELLO and AUTH, every
    /// byte, within it).
    fn frame_time_left(&self, accepted: Instant) -> Duration {
        if self.tenant.is_some() {
            self.shared.timeouts.frame
        } else {
            self.shared
                .timeouts
                .handshake
                .saturating_sub(accepted.elapsed())
        }
    }

    async fn frame<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut BufReader<S>,
        head: &[u8; FRAME_HEADER_BYTES],
        accepted: Instant,
    ) -> io::Result<Next> {
        let mut out = std::mem::take(&mut self.out);
        let r = self.frame_inner(io, head, &mut out, accepted).await;
        self.out = out;
        r
    }

    async fn frame_inner<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut BufReader<S>,
        head: &[u8; FRAME_HEADER_BYTES],
        out: &mut Vec<u8>,
        accepted: Instant,
    ) -> io::Result<Next> {
        let h = match FrameHeader::decode(head) {
            Ok(h) => h,
            Err(e) => {
                // Framing is lost: say why, then close.
                frame_error(out, 0, &e);
                io.get_mut().write_all(out).await?;
                return Ok(Next::Close);
            }
        };
        let op = Op::from_u16(h.op);
        let authenticated = self.tenant.is_some();
        if op == Some(Op::Put) && authenticated {
            return self.put_tcp(io, &h, out).await;
        }
        // Before AUTH only handshake frames, which are small.
        let limit = if authenticated {
            CONTROL_MAX_BYTES
        } else {
            AUTH_MAX_BYTES
        };
        if h.len > limit as u64 {
            let e = if authenticated {
                ProtoError::new(
                    ErrorCode::Limit,
                    format!("frame of {} bytes exceeds {CONTROL_MAX_BYTES}", h.len),
                )
            } else {
                ProtoError::new(ErrorCode::HandshakeRequired, "HELLO and AUTH come first")
            };
            frame_error(out, h.request_id, &e);
            io.get_mut().write_all(out).await?;
            return Ok(Next::Close);
        }
        let mut payload = std::mem::take(&mut self.payload);
        payload.resize(h.len as usize, 0);
        let limit = self.frame_time_left(accepted);
        let read = tokio::time::timeout(limit, io.read_exact(&mut payload)).await;
        let result = match read {
            Ok(Ok(_)) => self.dispatch(io, op, &h, &payload, out).await,
            Ok(Err(e)) => Err(e),
            Err(_) => Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "frame body timed out",
            )),
        };
        self.payload = payload;
        result
    }

    async fn dispatch<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut BufReader<S>,
        op: Option<Op>,
        h: &FrameHeader,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> io::Result<Next> {
        let authenticated = self.tenant.is_some();
        // The handshake: any failure answers an error and closes, as a
        // connection that cannot identify itself has nothing else to do.
        let handshake: Option<Result<(), ProtoError>> = match op {
            Some(Op::Hello) if !authenticated => Some(
                Hello::decode(payload)
                    .and_then(|hello| self.hello_reply(&hello, h.request_id, out)),
            ),
            Some(Op::Auth) if !authenticated => Some(self.authenticate(payload, None).map(|r| {
                begin_frame(out, Op::Auth as u16 | RESPONSE_BIT, h.request_id);
                r.encode(out);
                finish_frame(out, 0);
            })),
            _ if !authenticated => Some(Err(ProtoError::new(
                ErrorCode::HandshakeRequired,
                "HELLO and AUTH come first",
            ))),
            _ => None,
        };
        if let Some(r) = handshake {
            let next = match r {
                Ok(()) => Next::Continue,
                Err(e) => {
                    frame_error(out, h.request_id, &e);
                    Next::Close
                }
            };
            io.get_mut().write_all(out).await?;
            return Ok(next);
        }
        let result: Result<(), ProtoError> = match op {
            Some(Op::Put) => unreachable!("handled before the payload is read"),
            // Allowed on the Unix socket too: the data simply follows.
            Some(Op::Get) => return self.get_tcp(io, h, payload, out).await,
            _ => self.control(op, h, payload, out, None).await,
        };
        match result {
            Ok(()) => finish_frame(out, 0),
            Err(e) => frame_error(out, h.request_id, &e),
        }
        io.get_mut().write_all(out).await?;
        Ok(Next::Continue)
    }

    /// The operations whose requests and responses are control bytes only,
    /// over a socket or through a mailbox. Leaves the response in `out`.
    ///
    /// `stream`: the mailbox (and the request's sequence) that GET_SHM may
    /// publish its results through as it finds them.
    async fn control(
        &mut self,
        op: Option<Op>,
        h: &FrameHeader,
        payload: &[u8],
        out: &mut Vec<u8>,
        stream: Option<(&Mailbox, u64)>,
    ) -> Result<(), ProtoError> {
        let reply = |out: &mut Vec<u8>| begin_frame(out, h.op | RESPONSE_BIT, h.request_id);
        match op {
            None | Some(Op::Error) => Err(ProtoError::new(
                ErrorCode::UnknownOp,
                format!("unknown op {}", h.op),
            )),
            Some(o @ (Op::Hello | Op::Auth)) => Err(ProtoError::new(
                ErrorCode::BadFrame,
                format!("{o:?} after the connection authenticated"),
            )),
            Some(o @ (Op::Get | Op::Put)) => Err(ProtoError::new(
                ErrorCode::UnknownOp,
                format!("{o:?} does not travel through a mailbox"),
            )),
            Some(Op::GetShm) => self.get_shm(payload, out, reply, stream).await,
            Some(Op::Exists) => self.digest_batch(payload).map(|ns| {
                let mut present = std::mem::take(&mut self.present);
                self.engine().exists(ns, &self.digests, &mut present);
                let hits = present.iter().filter(|p| **p).count();
                self.count_routed(ns, present.len(), hits);
                reply(out);
                ExistsReply::encode_from(out, &present);
                self.present = present;
            }),
            Some(o @ (Op::Touch | Op::Pin | Op::Unpin | Op::Delete)) => {
                self.status_batch(o, payload, out, reply)
            }
            Some(Op::PutShm) => self.put_shm(payload, out, reply),
            Some(Op::Cluster) => {
                if !payload.is_empty() {
                    return Err(ProtoError::new(
                        ErrorCode::BadFrame,
                        "CLUSTER takes no payload",
                    ));
                }
                reply(out);
                self.shared.views.get().encode(out);
                Ok(())
            }
            Some(Op::Stats) => {
                let mut r = Reader::new(payload);
                read_batch_head(&mut r, 0).and_then(|b| {
                    no_parts(b.flags)?;
                    let ns = if b.namespace.is_empty() {
                        None
                    } else {
                        Some(self.namespace(b.namespace)?)
                    };
                    let stats = self.engine().stats(ns);
                    reply(out);
                    encode_stats(out, &stats);
                    Ok(())
                })
            }
        }
    }

    /// Serves a shared-memory connection whose requests come through its
    /// mailbox (see `mailbox.rs` for the protocol). The socket only carries
    /// doorbells now, and its end is the client's end.
    async fn serve_mailbox(&mut self, s: UnixStream, mailbox: Arc<Mailbox>) {
        let fd = s.as_raw_fd();
        let _watch = WatchGuard::new(Some(fd), Some(mailbox.clone()));
        let mb = &*mailbox;
        let mut answered = 0u64;
        let mut out = std::mem::take(&mut self.out);
        loop {
            let mut seq = mb.request_seq().load(Ordering::Acquire);
            if seq == answered {
                let spin = Duration::from_micros(self.gap_ewma_us * 3 / 2 + 20);
                if spin <= NEXT_FRAME_SPIN_MAX {
                    spin_until_any_readable(spin);
                }
                seq = mb.request_seq().load(Ordering::Acquire);
            }
            if seq == answered {
                // Park: announce it, then look once more (park.rs: the
                // client publishes, then looks at the flag; one of us sees
                // the other).
                let pending = || mb.request_seq().load(Ordering::Acquire) != answered;
                if park::prepare_park(mb.server_parked(), pending) {
                    tracing::trace!(conn = self.id, answered, "mailbox parked");
                    let idle = self.shared.timeouts.idle;
                    let open = tokio::time::timeout(idle, wait_doorbell(&s)).await;
                    park::unpark(mb.server_parked());
                    tracing::trace!(conn = self.id, ?open, "mailbox unparked");
                    match open {
                        Ok(true) => continue,
                        Ok(false) => break,
                        Err(_) => {
                            // The client's next request finds the socket
                            // closed once it parks; a pooled client then
                            // reconnects.
                            tracing::debug!(conn = self.id, "idle KV connection closed");
                            break;
                        }
                    }
                }
                seq = mb.request_seq().load(Ordering::Acquire);
            }
            let gap = (self.answered_at.elapsed().as_micros() as u64).min(FRAME_GAP_CLAMP_US);
            self.gap_ewma_us = (3 * self.gap_ewma_us + gap) / 4;
            tracing::trace!(conn = self.id, seq, "mailbox request");
            self.answer_mailbox(mb, seq, &mut out).await;
            let ring = park::publish(mb.response_seq(), seq, mb.client_parked());
            if ring {
                mailbox::ring(fd);
            }
            tracing::trace!(conn = self.id, seq, ring, "mailbox answered");
            answered = seq;
            self.answered_at = std::time::Instant::now();
            // Other connections of this thread get their turn between requests.
            tokio::task::yield_now().await;
        }
        self.out = out;
        self.release();
    }

    /// Answers the request in the mailbox's request area. The area belongs to
    /// an untrusted process: the frame is copied out once (header, then the
    /// payload length it validated) and only the copy is parsed. Every request
    /// gets a response frame, an error frame for a bad one: each request stands
    /// alone, so a bad one does not lose the framing of the next.
    async fn answer_mailbox(&mut self, mb: &Mailbox, seq: u64, out: &mut Vec<u8>) {
        let mut head = [0u8; FRAME_HEADER_BYTES];
        mb.read(Area::Request, 0, &mut head);
        let h = match FrameHeader::decode(&head) {
            Ok(h) if h.len <= CONTROL_MAX_BYTES as u64 => h,
            Ok(h) => {
                let e = ProtoError::new(
                    ErrorCode::Limit,
                    format!("frame of {} bytes exceeds {CONTROL_MAX_BYTES}", h.len),
                );
                frame_error(out, h.request_id, &e);
                return self.post_response(mb, out, h.request_id);
            }
            Err(e) => {
                frame_error(out, 0, &e);
                return self.post_response(mb, out, 0);
            }
        };
        let mut payload = std::mem::take(&mut self.payload);
        payload.resize(h.len as usize, 0);
        let copied = mb.read(Area::Request, FRAME_HEADER_BYTES, &mut payload);
        debug_assert!(copied, "the request area holds the largest control frame");
        match self
            .control(Op::from_u16(h.op), &h, &payload, out, Some((mb, seq)))
            .await
        {
            Ok(()) => finish_frame(out, 0),
            Err(e) => frame_error(out, h.request_id, &e),
        }
        self.payload = payload;
        self.post_response(mb, out, h.request_id)
    }

    fn post_response(&self, mb: &Mailbox, out: &mut Vec<u8>, request_id: u64) {
        if mb.write(Area::Response, out).is_err() {
            let e = ProtoError::new(ErrorCode::Limit, "response exceeds the mailbox");
            frame_error(out, request_id, &e);
            mb.write(Area::Response, out)
                .expect("an error frame fits the response area");
        }
    }

    /// The engine's id of a namespace the connection's tenant is granted.
    fn namespace(&self, name: &[u8]) -> Result<u32, ProtoError> {
        let t = self.tenant();
        if !t.grants.allows(name) {
            return Err(ProtoError::new(
                ErrorCode::Denied,
                format!(
                    "namespace {:?} is not granted to tenant {}",
                    String::from_utf8_lossy(name),
                    t.name
                ),
            ));
        }
        t.engine
            .namespace(name)
            .map_err(|_| ProtoError::new(ErrorCode::Limit, "too many namespaces"))
    }

    /// A batch's namespace id, once its route (if any) is current: a batch
    /// routed by a view older than this node's and different from it is
    /// refused (`NotOwner`), the client re-routes with the new one.
    /// `puts`: the op is PUT or PUT_SHM, the only ones that take parts.
    fn batch_namespace(&mut self, b: &BatchHead<'_>, puts: bool) -> Result<u32, ProtoError> {
        if !puts {
            no_parts(b.flags)?;
        }
        let ns = self.namespace(b.namespace)?;
        self.batch_flags = b.flags;
        if let Some(route) = b.route {
            let v = self.shared.views.get();
            if route.view != v.view && route.epoch < v.epoch {
                let c = RoutingCounts {
                    not_owner: b.count as u64,
                    ..RoutingCounts::default()
                };
                self.engine().count_routing(ns, c);
                return Err(ProtoError::new(
                    ErrorCode::NotOwner,
                    format!(
                        "routed by the KV members of epoch {}; this node has epoch {} ({} members): ask CLUSTER again",
                        route.epoch,
                        v.epoch,
                        v.members.len()
                    ),
                ));
            }
        }
        Ok(ns)
    }

    /// Counts a fallback batch's gets and hits, or a copy batch's stores.
    fn count_routed(&self, ns: u32, keys: usize, done: usize) {
        let mut c = RoutingCounts::default();
        if self.batch_flags & BATCH_FALLBACK != 0 {
            c.fallback_gets = keys as u64;
            c.fallback_hits = done as u64;
        }
        if self.batch_flags & BATCH_COPY != 0 {
            c.copies_stored = done as u64;
        }
        if self.batch_flags & (BATCH_FALLBACK | BATCH_COPY) != 0 {
            self.engine().count_routing(ns, c);
        }
    }

    /// Parses `ns + count digests` into self.digests; returns the namespace id.
    fn digest_batch(&mut self, payload: &[u8]) -> Result<u32, ProtoError> {
        let mut r = Reader::new(payload);
        let b = read_batch_head(&mut r, DIGEST_BYTES)?;
        self.digests.clear();
        for _ in 0..b.count {
            self.digests.push(r.digest()?);
        }
        r.finish()?;
        self.batch_namespace(&b, false)
    }

    fn status_batch(
        &mut self,
        op: Op,
        payload: &[u8],
        out: &mut Vec<u8>,
        reply: impl Fn(&mut Vec<u8>),
    ) -> Result<(), ProtoError> {
        let mut r = Reader::new(payload);
        let arg = read_batch_head(&mut r, DIGEST_BYTES)?.arg;
        let ns = self.digest_batch(payload)?;
        let e = self.engine();
        let mut st = std::mem::take(&mut self.statuses);
        match op {
            Op::Touch => e.touch(ns, &self.digests, &mut st),
            Op::Pin => {
                if self.pins.len() + self.digests.len() > PINS_PER_CONNECTION_MAX {
                    st.clear();
                    st.resize(self.digests.len(), Status::NoSpace);
                } else {
                    e.pin(ns, &self.digests, arg as u64, &mut st, &mut self.pins)
                }
            }
            Op::Unpin => e.unpin(ns, &self.digests, &mut st, &mut self.pins),
            Op::Delete => e.delete(ns, &self.digests, &mut st),
            _ => unreachable!("status ops only"),
        }
        reply(out);
        encode_statuses(out, &st);
        self.statuses = st;
        Ok(())
    }

    fn get_entries(&mut self, payload: &[u8]) -> Result<u32, ProtoError> {
        let mut r = Reader::new(payload);
        let b = read_batch_head(&mut r, GET_ENTRY_BYTES)?;
        self.gets.clear();
        for _ in 0..b.count {
            self.gets.push(GetEntry::decode(&mut r)?);
        }
        r.finish()?;
        self.batch_namespace(&b, false)
    }

    /// GET with the data in the response: result table, then the bytes of
    /// every hit, sent with vectored writes straight from the arena.
    async fn get_tcp<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut BufReader<S>,
        h: &FrameHeader,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> io::Result<Next> {
        let ns = match self.get_entries(payload) {
            Ok(ns) => ns,
            Err(e) => {
                frame_error(out, h.request_id, &e);
                io.get_mut().write_all(out).await?;
                return Ok(Next::Continue);
            }
        };
        let engine = self.engine();
        let mut plans = std::mem::take(&mut self.plans);
        engine.plan_reads(ns, &self.gets, true, &mut plans);
        self.held.clear();
        for p in &plans {
            if let ReadPlan::Ram(r) = p {
                self.held.push(r.slot);
            }
        }
        let disk = read_disk_plans(&engine, &plans).await;
        begin_frame(out, h.op | RESPONSE_BIT, h.request_id);
        out.put_u32(self.gets.len() as u32);
        let mut slices: Vec<&[u8]> = Vec::with_capacity(self.gets.len());
        let mut bulk = 0u64;
        let mut hits = 0;
        let mut disk_iter = disk.iter();
        for (g, plan) in self.gets.iter().zip(&plans) {
            let res = match plan {
                ReadPlan::Miss(s) => GetResult::miss(*s),
                ReadPlan::Ram(r) => {
                    let (off, len) = g.range(r.value_len).expect("range checked by plan_reads");
                    let whole = off == 0 && len == r.value_len;
                    if !whole && !engine.verify_ram(ns, &g.digest, r) {
                        GetResult::miss(Status::Corrupt)
                    } else {
                        // SAFETY: we hold a read reference on the slot; in range.
                        slices.push(unsafe {
                            engine.arena().slice(r.value_offset + off, len as usize)
                        });
                        bulk += len;
                        GetResult {
                            status: Status::Ok,
                            hot: r.hot,
                            crc: r.crc,
                            value_len: r.value_len,
                            data_len: len,
                        }
                    }
                }
                ReadPlan::Disk(d) => match disk_iter.next().expect("one result per disk plan") {
                    Ok(bytes) => {
                        let (off, len) = g.range(d.value_len).expect("range checked by plan_reads");
                        slices.push(&bytes.value()[off as usize..(off + len) as usize]);
                        bulk += len;
                        GetResult {
                            status: Status::Ok,
                            hot: false,
                            crc: d.crc,
                            value_len: d.value_len,
                            data_len: len,
                        }
                    }
                    Err(s) => GetResult::miss(*s),
                },
            };
            hits += (res.status == Status::Ok) as usize;
            res.encode(out);
        }
        finish_frame(out, bulk);
        let mut iov: Vec<IoSlice<'_>> = Vec::with_capacity(slices.len() + 1);
        iov.push(IoSlice::new(out));
        iov.extend(
            slices
                .iter()
                .filter(|s| !s.is_empty())
                .map(|s| IoSlice::new(s)),
        );
        let sent = write_all_vectored(io.get_mut(), &mut iov).await;
        drop(slices);
        engine.release(&self.held);
        engine.count_read(ns, bulk, 0);
        self.count_routed(ns, self.gets.len(), hits);
        // Promote what came from the NVMe tier, after the client has its bytes.
        for bytes in disk.iter().flatten() {
            engine.promote(bytes, false);
        }
        self.plans = plans;
        sent?;
        Ok(Next::Continue)
    }

    /// GET over shared memory: where each block is in the arena; the client
    /// copies and checks. Blocks on the NVMe tier are promoted first.
    ///
    /// Through a mailbox (`stream`), results are published as they are found,
    /// a few keys first and then twice as many each time: the client copies
    /// the first blocks while the daemon looks up the rest. The lookups are
    /// cache misses (index, slot, generation) after the client's copies have
    /// swept the caches, ~0.4 µs a key here: 13 µs of waiting per 32 keys
    /// when answered whole. A chunk's NVMe reads still run concurrently.
    async fn get_shm(
        &mut self,
        payload: &[u8],
        out: &mut Vec<u8>,
        reply: impl Fn(&mut Vec<u8>),
        stream: Option<(&Mailbox, u64)>,
    ) -> Result<(), ProtoError> {
        if !self.shm {
            return Err(ProtoError::new(
                ErrorCode::NotShm,
                "GET_SHM needs the shared-memory socket",
            ));
        }
        let ns = self.get_entries(payload)?;
        let engine = self.engine();
        let mut plans = std::mem::take(&mut self.plans);
        reply(out);
        out.put_u32(self.gets.len() as u32);
        let (mut bytes_read, mut no_space, mut hits) = (0u64, 0u64, 0);
        let (mut done, mut chunk, mut published) = (0, STREAM_FIRST_KEYS, 0);
        while done < self.gets.len() {
            let n = match stream {
                Some(_) => chunk.min(self.gets.len() - done),
                None => self.gets.len(),
            };
            let gets = &self.gets[done..done + n];
            engine.plan_reads(ns, gets, false, &mut plans);
            let disk = read_disk_plans(&engine, &plans).await;
            let mut disk_iter = disk.iter();
            for (g, plan) in gets.iter().zip(&plans) {
                let ram = match plan {
                    ReadPlan::Miss(s) => Err(*s),
                    ReadPlan::Ram(r) => Ok(*r),
                    ReadPlan::Disk(_) => {
                        match disk_iter.next().expect("one result per disk plan") {
                            Ok(bytes) => engine.promote(bytes, false).ok_or_else(|| {
                                no_space += 1;
                                Status::NoSpace
                            }),
                            Err(s) => Err(*s),
                        }
                    }
                };
                let res = match ram {
                    Err(s) => ShmGetResult::miss(s),
                    Ok(r) => {
                        let (off, len) = g.range(r.value_len).expect("range checked by plan_reads");
                        let whole = off == 0 && len == r.value_len;
                        if !whole && !engine.verify_ram(ns, &g.digest, &r) {
                            ShmGetResult::miss(Status::Corrupt)
                        } else {
                            bytes_read += len;
                            ShmGetResult {
                                status: Status::Ok,
                                hot: r.hot,
                                crc: r.crc,
                                value_len: r.value_len,
                                data_len: len,
                                arena_offset: r.value_offset + off,
                                slot: r.generation_index,
                                generation: r.generation,
                            }
                        }
                    }
                };
                hits += (res.status == Status::Ok) as usize;
                res.encode(out);
            }
            done += n;
            chunk *= 2;
            if let Some((mb, seq)) = stream {
                mb.write_at(Area::Response, published, &out[published..])
                    .expect("a GET_SHM batch fits the response area");
                published = out.len();
                mb.publish_progress(seq, done);
            }
        }
        engine.count_read(ns, bytes_read, no_space);
        self.count_routed(ns, self.gets.len(), hits);
        self.plans = plans;
        Ok(())
    }

    /// PUT over shared memory: the client wrote each value into its put
    /// window; the daemon copies it into a slot it reserved (the client never
    /// sees the slot), checksums the slot, and makes it visible if the
    /// checksum matches the client's. The daemon's copy is the only one the
    /// block is ever served from.
    fn put_shm(
        &mut self,
        payload: &[u8],
        out: &mut Vec<u8>,
        reply: impl Fn(&mut Vec<u8>),
    ) -> Result<(), ProtoError> {
        if !self.shm {
            return Err(ProtoError::new(
                ErrorCode::NotShm,
                "PUT_SHM needs the shared-memory socket",
            ));
        }
        if self.window.is_none() {
            return Err(ProtoError::new(
                ErrorCode::NotShm,
                "PUT_SHM needs a put window, passed with AUTH",
            ));
        }
        let mut r = Reader::new(payload);
        let b = read_batch_head(&mut r, PUT_SHM_ENTRY_BYTES)?;
        let count = b.count as usize;
        let parts = b.flags & BATCH_PARTS != 0;
        let entry_bytes = PUT_SHM_ENTRY_BYTES + if parts { PART_BYTES } else { 0 };
        if r.remaining() != count * entry_bytes {
            return Err(ProtoError::new(
                ErrorCode::BadFrame,
                "PUT_SHM length does not match its count",
            ));
        }
        let ns = self.batch_namespace(&b, true)?;
        let engine = self.engine();
        let value_max = self.shared.value_max_bytes;
        let window = self.window.as_ref().expect("checked above");
        let mut st = std::mem::take(&mut self.statuses);
        st.clear();
        for _ in 0..count {
            let e = PutShmEntry::decode(&mut r)?;
            let part = if parts {
                Some(Part::decode(&mut r)?)
            } else {
                None
            };
            let in_window = e
                .window_offset
                .checked_add(e.len)
                .is_some_and(|end| end <= window.len);
            let s = if e.len > value_max {
                Status::TooLarge
            } else if !in_window {
                Status::BadWindow
            } else if let Some(part) = part {
                match engine.reserve_part(ns, &e.digest, part.value_len, part.offset, e.len) {
                    Err(s) => s,
                    Ok((token, offset)) => {
                        // SAFETY: the part's bytes of a slot reserved for
                        // the value, inside the arena.
                        let dst = unsafe { engine.arena().slice_mut(offset, e.len as usize) };
                        match window.read_into(e.window_offset, dst) {
                            Ok(crc) => {
                                finish_part(&engine, token, part.offset, e.len, crc == e.crc)
                            }
                            Err(_) => {
                                engine.abort_part(token);
                                Status::BadWindow
                            }
                        }
                    }
                }
            } else {
                match engine.reserve(self.id, ns, &e.digest, e.len) {
                    Err(s) => s,
                    Ok((token, offset)) => {
                        // SAFETY: our reservation, inside the arena.
                        let slot = unsafe { engine.arena().slice_mut(offset, e.len as usize) };
                        match window.read_into(e.window_offset, slot) {
                            Ok(crc) => engine.commit(self.id, token, crc, crc == e.crc),
                            Err(_) => {
                                engine.abort(self.id, token);
                                Status::BadWindow
                            }
                        }
                    }
                }
            };
            st.push(s);
        }
        let stored = st.iter().filter(|s| **s == Status::Ok).count();
        self.count_routed(ns, count, stored);
        reply(out);
        encode_statuses(out, &st);
        self.statuses = st;
        Ok(())
    }

    /// PUT with the data in the frame: each value is read straight into a
    /// reserved arena slot, checksummed, then committed. The frame's length
    /// must equal its table plus the values, else framing is lost and the
    /// connection closes.
    async fn put_tcp<S: AsyncRead + AsyncWrite + Unpin>(
        &mut self,
        io: &mut BufReader<S>,
        h: &FrameHeader,
        out: &mut Vec<u8>,
    ) -> io::Result<Next> {
        let value_max = self.shared.value_max_bytes;
        let limit = self.shared.timeouts.frame;
        let close = |out: &mut Vec<u8>, e: ProtoError| {
            frame_error(out, h.request_id, &e);
        };
        let mut fixed = [0u8; BATCH_HEADER_BYTES];
        if h.len < BATCH_HEADER_BYTES as u64 {
            close(
                out,
                ProtoError::new(ErrorCode::BadFrame, "PUT frame shorter than a batch head"),
            );
            io.get_mut().write_all(out).await?;
            return Ok(Next::Close);
        }
        timed(limit, io.read_exact(&mut fixed)).await?;
        let mut r = Reader::new(&fixed);
        let ns_len = r.u16().expect("fixed") as usize;
        let flags = r.u16().expect("fixed");
        let count = r.u32().expect("fixed") as usize;
        let route_len = if flags & BATCH_ROUTED != 0 {
            ROUTE_BYTES
        } else {
            0
        };
        let parts = flags & BATCH_PARTS != 0;
        let entry_bytes = PUT_ENTRY_BYTES + if parts { PART_BYTES } else { 0 };
        let head_len = ns_len + route_len;
        let table_len = BATCH_HEADER_BYTES + head_len + count * entry_bytes;
        if ns_len > NAMESPACE_MAX_BYTES || count > BATCH_MAX_KEYS || (table_len as u64) > h.len {
            close(
                out,
                ProtoError::new(ErrorCode::Limit, "PUT batch head out of limits"),
            );
            io.get_mut().write_all(out).await?;
            return Ok(Next::Close);
        }
        // The whole table, batch head first, so that the head goes through
        // the common parser (flags, route) below.
        let mut payload = std::mem::take(&mut self.payload);
        payload.clear();
        payload.extend_from_slice(&fixed);
        payload.resize(table_len, 0);
        timed(limit, io.read_exact(&mut payload[BATCH_HEADER_BYTES..])).await?;
        let entries_at = BATCH_HEADER_BYTES + head_len;
        let mut r = Reader::new(&payload[entries_at..]);
        let data: u128 = (0..count)
            .map(|_| {
                let e = PutEntry::decode(&mut r).expect("length checked");
                if parts {
                    Part::decode(&mut r).expect("length checked");
                }
                e.len as u128
            })
            .sum();
        if table_len as u128 + data != h.len as u128 {
            self.payload = payload;
            close(
                out,
                ProtoError::new(
                    ErrorCode::BadFrame,
                    "PUT frame length does not match its table",
                ),
            );
            io.get_mut().write_all(out).await?;
            return Ok(Next::Close);
        }
        let head = read_batch_head(&mut Reader::new(&payload[..entries_at]), 0);
        let ns = match head.and_then(|b| self.batch_namespace(&b, true)) {
            Ok(ns) => Some(ns),
            Err(e)
                if matches!(
                    e.code,
                    ErrorCode::Denied | ErrorCode::NotOwner | ErrorCode::BadFrame
                ) =>
            {
                // Refused as a whole; the values are read past to keep the
                // framing, and the connection stays usable.
                self.payload = payload;
                discard(io, data as u64, limit).await?;
                close(out, e);
                io.get_mut().write_all(out).await?;
                return Ok(Next::Continue);
            }
            Err(_) => None,
        };
        let engine = self.engine();
        let mut st = std::mem::take(&mut self.statuses);
        st.clear();
        let mut r = Reader::new(&payload[entries_at..]);
        for _ in 0..count {
            let e = PutEntry::decode(&mut r).expect("length checked");
            let part = parts.then(|| Part::decode(&mut r).expect("length checked"));
            let reserved = match (ns, part) {
                (None, _) => Err(Status::NoSpace),
                (Some(_), _) if e.len > value_max => Err(Status::TooLarge),
                (Some(ns), Some(p)) => {
                    engine.reserve_part(ns, &e.digest, p.value_len, p.offset, e.len)
                }
                (Some(ns), None) => engine.reserve(self.id, ns, &e.digest, e.len),
            };
            match reserved {
                Ok((token, offset)) => {
                    // Given back if the connection ends mid-read.
                    self.reservations.push(token);
                    // SAFETY: our reservation (or our part of an assembly's
                    // slot), inside the arena.
                    let slot = unsafe { engine.arena().slice_mut(offset, e.len as usize) };
                    timed(limit, io.read_exact(slot)).await?;
                    let crc = crc32c(slot);
                    self.reservations.pop();
                    st.push(match part {
                        Some(p) => finish_part(&engine, token, p.offset, e.len, crc == e.crc),
                        None => engine.commit(self.id, token, crc, crc == e.crc),
                    });
                }
                Err(s) => {
                    discard(io, e.len, limit).await?;
                    st.push(s);
                }
            }
        }
        self.payload = payload;
        if let Some(ns) = ns {
            let stored = st.iter().filter(|s| **s == Status::Ok).count();
            self.count_routed(ns, count, stored);
        }
        begin_frame(out, h.op | RESPONSE_BIT, h.request_id);
        encode_statuses(out, &st);
        finish_frame(out, 0);
        self.statuses = st;
        io.get_mut().write_all(out).await?;
        Ok(Next::Continue)
    }
}

/// Only PUT and PUT_SHM take parts: the flag on another op is refused,
/// never ignored.
fn no_parts(flags: u16) -> Result<(), ProtoError> {
    if flags & BATCH_PARTS != 0 {
        return Err(ProtoError::new(
            ErrorCode::BadFrame,
            "only PUT and PUT_SHM take parts (batch flag PARTS)",
        ));
    }
    Ok(())
}

/// Records a part copied into its value's slot; the one that completes the
/// value checksums it whole and makes it visible.
fn finish_part(engine: &Engine, token: u64, offset: u64, len: u64, ok: bool) -> Status {
    match engine.commit_part(token, offset, len, ok) {
        PartCommit::Status(s) => s,
        PartCommit::Complete { value_offset, len } => {
            // SAFETY: the assembly's slot, complete and written by no one.
            let crc = crc32c(unsafe { engine.arena().slice(value_offset, len as usize) });
            engine.finish_value(token, crc)
        }
    }
}

async fn timed<T>(
    limit: Duration,
    f: impl std::future::Future<Output = io::Result<T>>,
) -> io::Result<T> {
    match tokio::time::timeout(limit, f).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "frame body timed out",
        )),
    }
}

async fn discard<R: AsyncRead + Unpin>(io: &mut R, mut n: u64, limit: Duration) -> io::Result<()> {
    let mut scratch = [0u8; 8192];
    while n > 0 {
        let k = (n as usize).min(scratch.len());
        timed(limit, io.read_exact(&mut scratch[..k])).await?;
        n -= k as u64;
    }
    Ok(())
}

/// Reads every NVMe-tier plan of a batch at once.
async fn read_disk_plans(
    engine: &Engine,
    plans: &[ReadPlan],
) -> Vec<Result<crate::engine::DiskBytes, Status>> {
    let reads = plans.iter().filter_map(|p| match p {
        ReadPlan::Disk(d) => Some(engine.read_disk(d)),
        _ => None,
    });
    futures::future::join_all(reads).await
}

async fn write_all_vectored<W: AsyncWrite + Unpin>(
    w: &mut W,
    mut iov: &mut [IoSlice<'_>],
) -> io::Result<()> {
    while !iov.is_empty() {
        let n = w.write_vectored(iov).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                "connection closed",
            ));
        }
        IoSlice::advance_slices(&mut iov, n);
    }
    Ok(())
}

/// Waits for doorbell bytes on a mailbox connection's socket and drains them.
/// False when the client closed its end (or the socket failed).
async fn wait_doorbell(s: &UnixStream) -> bool {
    let mut buf = [0u8; 64];
    loop {
        if s.readable().await.is_err() {
            return false;
        }
        match s.try_read(&mut buf) {
            Ok(0) => return false,
            Ok(_) => loop {
                match s.try_read(&mut buf) {
                    Ok(0) => return false,
                    Ok(_) => {}
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                    Err(_) => return false,
                }
            },
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(_) => return false,
        }
    }
}

/// Sends `data` with descriptors attached (SCM_RIGHTS) to its first byte.
async fn send_with_fds(s: &UnixStream, data: &[u8], fds: &[i32]) -> io::Result<()> {
    let mut sent = 0;
    let mut fds = fds;
    while sent < data.len() {
        s.writable().await?;
        let r = s.try_io(tokio::io::Interest::WRITABLE, || {
            fdpass::send(s.as_raw_fd(), &data[sent..], fds)
        });
        match r {
            Ok(n) => {
                sent += n;
                fds = &[];
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
