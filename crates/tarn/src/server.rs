//! The daemon: one pinned single-threaded runtime per core, each accepting on
//! its own SO_REUSEPORT listener and serving HTTP/1.1 with hyper. A request stays
//! on the core that accepted it.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use s3s::service::S3Service;
use tarn_store::Store;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::metrics::{operation, Metrics};

/// Largest request head hyper will buffer.
const REQUEST_HEAD_MAX_BYTES: usize = 64 << 10;
/// Largest total of header names and values we accept (S3 allows 8 KiB of
/// headers plus 2 KiB of user metadata; this leaves room for long presigned
/// query strings, which are not headers).
const REQUEST_HEADERS_MAX_BYTES: usize = 16 << 10;
/// S3's limit on user metadata (x-amz-meta-*), names plus values.
const USER_METADATA_MAX_BYTES: usize = 2 << 10;
/// How long in-flight requests get to finish after SIGTERM.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

pub struct ServerSettings {
    pub listen: SocketAddr,
    pub admin_listen: SocketAddr,
    pub cores: usize,
    pub pin: bool,
    pub io_uring: bool,
    pub inflight_requests_max: usize,
    pub domains: Vec<String>,
    /// The region requests must be signed for.
    pub region: String,
    pub admin_token: String,
    pub scan_interval: Option<Duration>,
    /// The KV engines by tenant, for /metrics.
    pub kv: Vec<(String, Arc<tarn_kv::Engine>)>,
}

/// Refuses an address another process listens on. The S3 listeners use
/// SO_REUSEPORT (one per core), which would let a second server on the same
/// port start and take most of the connections, serving its own (empty)
/// store: a plain bind first finds any listener already there.
fn check_address_free(addr: SocketAddr) -> anyhow::Result<()> {
    if addr.port() == 0 {
        return Ok(());
    }
    let probe = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    probe.set_reuse_address(true)?;
    match probe.bind(&addr.into()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            anyhow::bail!("another process is already listening on {addr} (another tarn server?)")
        }
        Err(e) => Err(e).with_context(|| format!("binding {addr}")),
    }
}

/// Claims `addr` for this server for as long as the returned socket lives: an
/// abstract Unix socket named after it, which only one process can bind (the
/// kernel releases it when the process exits, however it exits). It closes the
/// window between two servers' free-address checks.
pub fn claim_address(
    what: &str,
    addr: SocketAddr,
) -> anyhow::Result<std::os::unix::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt;
    let name = format!("tarn-{what}.{addr}");
    let unix = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
    std::os::unix::net::UnixListener::bind_addr(&unix).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            anyhow::anyhow!("another tarn server is already serving {what} on {addr}")
        } else {
            anyhow::Error::new(e).context(format!("claiming {addr}"))
        }
    })
}

fn bind_reuseport(addr: SocketAddr) -> anyhow::Result<std::net::TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket
        .bind(&addr.into())
        .with_context(|| format!("binding {addr}"))?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// Wraps the S3 service with admission control and metrics.
#[derive(Clone)]
struct Front {
    s3: S3Service,
    metrics: Arc<Metrics>,
    inflight_max: usize,
    domains: Arc<Vec<String>>,
    region: Arc<str>,
}

type Resp = http::Response<s3s::Body>;

fn error_response(status: http::StatusCode, code: &str, message: &str) -> Resp {
    let body = format!("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>");
    let mut r = http::Response::new(s3s::Body::from(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/xml"),
    );
    r
}

/// A request signed for another region, or a presigned URL valid too long.
fn scope_error(e: tarn_s3::scope::ScopeError) -> Resp {
    let mut body = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>{}</Code><Message>{}</Message>",
        e.code, e.message
    );
    if let Some(r) = &e.region {
        body.push_str(&format!("<Region>{r}</Region>"));
    }
    body.push_str("</Error>");
    let mut r = http::Response::new(s3s::Body::from(body));
    *r.status_mut() = http::StatusCode::BAD_REQUEST;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/xml"),
    );
    if let Some(v) = e.region.and_then(|r| http::HeaderValue::from_str(&r).ok()) {
        r.headers_mut().insert("x-amz-bucket-region", v);
    }
    r
}

fn slow_down() -> Resp {
    let mut r = error_response(
        http::StatusCode::SERVICE_UNAVAILABLE,
        "SlowDown",
        "Please reduce your request rate.",
    );
    r.headers_mut().insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from_static("1"),
    );
    r
}

/// Rejects oversized header sections before any parsing or authentication.
fn check_header_sizes(headers: &http::HeaderMap) -> Option<Resp> {
    let mut total = 0;
    let mut meta = 0;
    for (name, value) in headers {
        let n = name.as_str().len() + value.len();
        total += n;
        if let Some(m) = name.as_str().strip_prefix("x-amz-meta-") {
            meta += m.len() + value.len();
        }
    }
    if total > REQUEST_HEADERS_MAX_BYTES {
        return Some(error_response(
            http::StatusCode::BAD_REQUEST,
            "RequestHeaderSectionTooLarge",
            "Your request header section exceeds the maximum allowed size.",
        ));
    }
    if meta > USER_METADATA_MAX_BYTES {
        return Some(error_response(
            http::StatusCode::BAD_REQUEST,
            "MetadataTooLarge",
            "Your metadata headers exceed the maximum allowed metadata size.",
        ));
    }
    None
}

impl hyper::service::Service<http::Request<Incoming>> for Front {
    type Response = Resp;
    type Error = s3s::HttpError;
    type Future = Pin<Box<dyn Future<Output = Result<Resp, s3s::HttpError>> + Send>>;

    fn call(&self, req: http::Request<Incoming>) -> Self::Future {
        let metrics = self.metrics.clone();
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        let host_name = host.rsplit_once(':').map_or(host, |(h, _)| h);
        let bucket_in_host = self
            .domains
            .iter()
            .any(|d| host_name.len() > d.len() && host_name.ends_with(&format!(".{d}")));
        let op = operation(
            req.method(),
            req.uri().path(),
            req.uri().query().unwrap_or(""),
            bucket_in_host,
            req.headers().contains_key("x-amz-copy-source"),
        );
        if let Some(r) = check_header_sizes(req.headers()) {
            metrics.record(op, 400, Duration::ZERO);
            return Box::pin(async { Ok(r) });
        }
        if let Err(e) = tarn_s3::scope::check(req.headers(), req.uri().query(), &self.region) {
            metrics.record(op, 400, Duration::ZERO);
            return Box::pin(async { Ok(scope_error(e)) });
        }
        let declared_in = req
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0);
        // Admission control: answer quickly instead of queueing without bound.
        let inflight = metrics.inflight.fetch_add(1, Ordering::Relaxed) + 1;
        if inflight as usize > self.inflight_max {
            metrics.inflight.fetch_sub(1, Ordering::Relaxed);
            metrics.rejected_overload.fetch_add(1, Ordering::Relaxed);
            metrics.record(op, 503, Duration::ZERO);
            return Box::pin(async { Ok(slow_down()) });
        }
        metrics.bytes_in.fetch_add(declared_in, Ordering::Relaxed);
        let start = Instant::now();
        let fut = hyper::service::Service::call(&self.s3, req);
        Box::pin(async move {
            let res = fut.await;
            metrics.inflight.fetch_sub(1, Ordering::Relaxed);
            match &res {
                Ok(r) => {
                    let out = r
                        .headers()
                        .get(http::header::CONTENT_LENGTH)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0);
                    metrics.bytes_out.fetch_add(out, Ordering::Relaxed);
                    metrics.record(op, r.status().as_u16(), start.elapsed());
                    if r.status().is_server_error() {
                        tracing::warn!(op, status = r.status().as_u16(), "request failed");
                    }
                }
                Err(_) => metrics.record(op, 500, start.elapsed()),
            }
            res
        })
    }
}

/// Runs the server until SIGTERM/SIGINT. Blocks the calling thread.
pub fn run(store: Arc<Store>, s3: S3Service, settings: ServerSettings) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::default());
    if !settings.kv.is_empty() {
        let _ = metrics.kv.set(settings.kv.clone());
    }
    // Bind the first listener to learn the port (the flag may say :0), then give
    // every core its own listener on that same port.
    check_address_free(settings.listen)?;
    let first = bind_reuseport(settings.listen)?;
    let addr = first.local_addr()?;
    let _claim = claim_address("s3", addr)?;
    let mut listeners = vec![first];
    for _ in 1..settings.cores {
        listeners.push(bind_reuseport(addr)?);
    }
    let admin = std::net::TcpListener::bind(settings.admin_listen)
        .with_context(|| format!("binding admin {}", settings.admin_listen))?;
    admin.set_nonblocking(true)?;
    let admin_addr = admin.local_addr()?;

    let (stop_tx, stop_rx) = watch::channel(false);
    let front = Front {
        s3,
        metrics: metrics.clone(),
        inflight_max: settings.inflight_requests_max,
        domains: Arc::new(settings.domains.clone()),
        region: Arc::from(settings.region.as_str()),
    };

    let mut threads = Vec::new();
    for (core, listener) in listeners.into_iter().enumerate() {
        let front = front.clone();
        let stop = stop_rx.clone();
        let store = store.clone();
        let (pin, uring) = (settings.pin, settings.io_uring);
        let admin = if core == 0 {
            admin.try_clone().ok()
        } else {
            None
        };
        let admin_ctx = (metrics.clone(), settings.admin_token.clone());
        let scan = settings.scan_interval;
        threads.push(
            std::thread::Builder::new()
                .name(format!("tarn-core-{core}"))
                .spawn(move || -> anyhow::Result<()> {
                    let rt = tarn_io::runtime::build_core_runtime(core, pin, uring)?;
                    rt.block_on(async move {
                        if core == 0 {
                            store.spawn_background(scan);
                        }
                        if let Some(admin) = admin {
                            let listener = TcpListener::from_std(admin)?;
                            tokio::spawn(crate::admin::serve(
                                listener,
                                store.clone(),
                                admin_ctx.0,
                                admin_ctx.1,
                                stop.clone(),
                            ));
                        }
                        let listener = TcpListener::from_std(listener)?;
                        serve_core(listener, front, stop).await;
                        Ok::<_, anyhow::Error>(())
                    })
                })?,
        );
    }
    let backend = if settings.io_uring {
        "io_uring"
    } else {
        "blocking threads"
    };
    println!("S3 endpoint: http://{addr}");
    println!("Admin endpoint: http://{admin_addr} (/metrics, /health/live, /health/ready)");
    tracing::info!(%addr, %admin_addr, cores = settings.cores, backend, "tarn serving");

    // Signals on their own small runtime; cores are told through the watch.
    let signal_rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    signal_rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = int.recv() => tracing::info!("SIGINT: shutting down"),
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let _ = stop_tx.send(true);
    for t in threads {
        match t.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "core runtime failed"),
            Err(_) => tracing::error!("core thread panicked"),
        }
    }
    tracing::info!("stopped");
    Ok(())
}

async fn serve_core(listener: TcpListener, front: Front, mut stop: watch::Receiver<bool>) {
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.max_buf_size(REQUEST_HEAD_MAX_BYTES)
        .keep_alive(true)
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, _) = match accepted {
                    Ok(s) => s,
                    Err(error) => {
                        tracing::warn!(%error, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                // Small responses must not wait for the delayed-ACK timer.
                let _ = stream.set_nodelay(true);
                let conn = http.serve_connection(TokioIo::new(stream), front.clone());
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(error) = conn.await {
                        tracing::debug!(%error, "connection ended with an error");
                    }
                });
            }
            _ = stop.changed() => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("in-flight requests did not finish within the grace period");
    }
}
