//! `tarn._native`: the Rust KV client under the Python package `tarn`.
//!
//! The Python layer (`python/tarn/kv.py`) adds the asyncio client, the status
//! enum and the docs; everything that touches caller memory is here. Buffers
//! are borrowed through the buffer protocol (or, for torch tensors, which do
//! not export it, through `data_ptr()`), held for the length of the call and
//! handed to the client as slices: no copy on the Python side. Every call
//! releases the GIL for its I/O.
//!
//! A client owns a small pool of connections so threads (and the asyncio
//! client's executor) can have calls in flight at once. A connection that
//! fails is dropped; a call that failed on a pooled connection (say the
//! server restarted since it was opened) is retried once on a fresh one.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use tarn_client::kv::{denied, BlockingKvClient, ConnectOptions, Error, TransportChoice};
use tarn_client::Credentials;
use tarn_client::{Digest, Part, Status, TransportKind};

mod buffers;
mod objects;
mod routing;

use buffers::{borrow, raise, Borrowed, Region};

/// A client error as the Python exception a caller can act on.
fn py_err(py: Python<'_>, e: Failure) -> PyErr {
    match e {
        Failure::Connect(_, Error::Usage(m)) => PyValueError::new_err(m),
        Failure::Connect(endpoint, e) if denied(&e) => raise(
            py,
            "KvPermissionError",
            format!("the Tarn KV server at {endpoint} refused the credentials: {e}"),
        ),
        Failure::Connect(endpoint, e) => raise(
            py,
            "KvConnectionError",
            format!("cannot connect to the Tarn KV server at {endpoint}: {e}"),
        ),
        Failure::Closed => raise(py, "KvConnectionError", "the client is closed".into()),
        Failure::Call(e) if denied(&e) => raise(py, "KvPermissionError", e.to_string()),
        Failure::Call(e) => match e {
            Error::Io(_) | Error::Broken => raise(py, "KvConnectionError", e.to_string()),
            Error::Server(_) => raise(py, "KvServerError", e.to_string()),
            Error::Protocol(_) => raise(py, "KvProtocolError", e.to_string()),
            Error::Usage(m) => PyValueError::new_err(m),
        },
    }
}

enum Failure {
    Connect(String, Error),
    Closed,
    Call(Error),
}

/// True when the error leaves the connection unusable.
fn fatal(e: &Error) -> bool {
    matches!(e, Error::Io(_) | Error::Broken | Error::Protocol(_))
}

/// A server that did not answer in time is not helped by asking again.
fn timed_out(e: &Error) -> bool {
    matches!(e, Error::Io(io) if io.kind() == std::io::ErrorKind::TimedOut)
}

struct PoolState {
    idle: Vec<BlockingKvClient>,
    open: usize,
    closed: bool,
    pid: u32,
}

/// Connections to one endpoint, opened on demand up to `max`.
struct Pool {
    endpoint: String,
    opts: ConnectOptions,
    max: usize,
    state: Mutex<PoolState>,
    freed: Condvar,
}

impl Pool {
    fn new(endpoint: &str, opts: ConnectOptions, max: usize) -> Pool {
        Pool {
            endpoint: endpoint.to_string(),
            opts,
            max,
            state: Mutex::new(PoolState {
                idle: Vec::new(),
                open: 0,
                closed: false,
                pid: std::process::id(),
            }),
            freed: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let pid = std::process::id();
        if s.pid != pid {
            // A forked child shares the parent's sockets and mappings: never
            // use (or tear down) those; start afresh.
            for c in s.idle.drain(..) {
                std::mem::forget(c);
            }
            s.open = 0;
            s.pid = pid;
        }
        s
    }

    /// An idle connection (`true`: it was used before) or a new one.
    fn checkout(&self) -> Result<(BlockingKvClient, bool), Failure> {
        let mut s = self.lock();
        loop {
            if s.closed {
                return Err(Failure::Closed);
            }
            if let Some(c) = s.idle.pop() {
                return Ok((c, true));
            }
            if s.open < self.max {
                s.open += 1;
                drop(s);
                return match BlockingKvClient::connect(&self.endpoint, self.opts.clone()) {
                    Ok(c) => Ok((c, false)),
                    Err(e) => {
                        self.lock().open -= 1;
                        self.freed.notify_one();
                        Err(Failure::Connect(self.endpoint.clone(), e))
                    }
                };
            }
            s = self.freed.wait(s).unwrap_or_else(|p| p.into_inner());
        }
    }

    fn checkin(&self, c: BlockingKvClient, usable: bool) {
        let mut s = self.lock();
        if usable && !s.closed {
            s.idle.push(c);
        } else {
            s.open = s.open.saturating_sub(1);
            if !usable {
                // The others were opened to the same server: if it went away
                // they are dead too, and finding out costs a failed call each.
                let stale = s.idle.len();
                s.idle.clear();
                s.open -= stale;
            }
        }
        drop(s);
        self.freed.notify_all();
    }

    /// Runs `f` on a connection; retried once on a fresh connection when a
    /// pooled one turns out to be dead.
    fn run<T>(
        &self,
        mut f: impl FnMut(&mut BlockingKvClient) -> Result<T, Error>,
    ) -> Result<T, Failure> {
        let mut retried = false;
        loop {
            let (mut c, reused) = self.checkout()?;
            match f(&mut c) {
                Ok(v) => {
                    self.checkin(c, true);
                    return Ok(v);
                }
                Err(e) => {
                    let dead = fatal(&e);
                    self.checkin(c, !dead);
                    if !(dead && reused && !retried) || timed_out(&e) {
                        return Err(Failure::Call(e));
                    }
                    retried = true;
                }
            }
        }
    }

    fn close(&self) {
        let mut s = self.lock();
        s.closed = true;
        let n = s.idle.len();
        s.idle.clear();
        s.open -= n;
        drop(s);
        self.freed.notify_all();
    }
}

fn digest(obj: &Bound<'_, PyAny>, i: usize) -> PyResult<Digest> {
    let bad = |n: usize| {
        PyValueError::new_err(format!(
            "key {i} is {n} bytes; keys are 32-byte digests (tarn.kv.key() hashes anything else)"
        ))
    };
    if let Ok(b) = obj.cast::<PyBytes>() {
        let b = b.as_bytes();
        return b.try_into().map_err(|_| bad(b.len()));
    }
    if obj.is_instance_of::<pyo3::types::PyString>() {
        return Err(PyTypeError::new_err(format!(
            "key {i} is a str; keys are 32-byte digests (tarn.kv.key() hashes anything else)"
        )));
    }
    let b = borrow(obj, false, i)
        .map_err(|e| PyTypeError::new_err(format!("key {i}: {}", e.value(obj.py()))))?;
    // SAFETY: the view is live for the length of this function.
    let bytes = unsafe { std::slice::from_raw_parts(b.ptr, b.len) };
    bytes.try_into().map_err(|_| bad(b.len))
}

fn digests(keys: &Bound<'_, PyAny>) -> PyResult<Vec<Digest>> {
    let mut out = Vec::with_capacity(keys.len().unwrap_or(0));
    for (i, k) in keys.try_iter()?.enumerate() {
        out.push(digest(&k?, i)?);
    }
    Ok(out)
}

fn buffers(bufs: &Bound<'_, PyAny>, writable: bool, want: usize) -> PyResult<Vec<Borrowed>> {
    let mut out = Vec::with_capacity(want);
    for (i, b) in bufs.try_iter()?.enumerate() {
        out.push(borrow(&b?, writable, i)?);
    }
    if out.len() != want {
        return Err(PyValueError::new_err(format!(
            "{want} keys but {} buffers",
            out.len()
        )));
    }
    Ok(out)
}

/// Reads land in distinct memory: two buffers over the same bytes would be
/// two mutable borrows of it.
fn check_disjoint(regions: &[Region]) -> PyResult<()> {
    let mut order: Vec<usize> = (0..regions.len()).filter(|i| regions[*i].1 > 0).collect();
    order.sort_by_key(|i| regions[*i].0);
    for w in order.windows(2) {
        let (a, b) = (regions[w[0]], regions[w[1]]);
        if a.0 + a.1 > b.0 {
            return Err(PyValueError::new_err(format!(
                "buffers {} and {} overlap; each read needs its own memory",
                w[0].min(w[1]),
                w[0].max(w[1])
            )));
        }
    }
    Ok(())
}

fn bools(statuses: &[Status]) -> Vec<bool> {
    statuses.iter().map(|s| *s == Status::Ok).collect()
}

/// The native KV client; `tarn.kv.Client` derives from it.
#[pyclass(subclass, frozen, module = "tarn._native", name = "Client")]
struct Client {
    /// The endpoint given: the only one, or the first member asked.
    pool: Arc<Pool>,
    /// Set when that endpoint is a member of a cluster's KV store.
    router: Option<routing::Router>,
    /// The connection whose arena mapping device copies read from (GPU
    /// memory gets): opened on first use, kept until `_reader_close` (its
    /// mapping may be registered with the CUDA driver meanwhile).
    reader: Mutex<Option<BlockingKvClient>>,
    namespace: Vec<u8>,
    transport: TransportKind,
    value_max_bytes: u64,
}

#[pymethods]
impl Client {
    #[new]
    // The Python constructor's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (endpoint = "127.0.0.1:9400", namespace = None, *, transport = "auto",
        connect_timeout = 5.0, timeout = None, max_connections = 4, shm_mailbox = true,
        access_key = None, secret_key = None, cluster = true, ca_bundle = None))]
    fn new(
        py: Python<'_>,
        endpoint: &str,
        namespace: Option<&Bound<'_, PyAny>>,
        transport: &str,
        connect_timeout: f64,
        timeout: Option<f64>,
        max_connections: usize,
        shm_mailbox: bool,
        access_key: Option<String>,
        secret_key: Option<String>,
        cluster: bool,
        ca_bundle: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let namespace = match namespace {
            None => Vec::new(),
            Some(ns) => {
                if let Ok(s) = ns.extract::<String>() {
                    s.into_bytes()
                } else if let Ok(b) = ns.cast::<PyBytes>() {
                    b.as_bytes().to_vec()
                } else {
                    return Err(PyTypeError::new_err("namespace must be str or bytes"));
                }
            }
        };
        let transport = match transport {
            "auto" => TransportChoice::Auto,
            "shm" => TransportChoice::Shm,
            "tcp" => TransportChoice::Tcp,
            other => {
                return Err(PyValueError::new_err(format!(
                    "transport {other:?}: expected \"auto\", \"shm\" or \"tcp\""
                )))
            }
        };
        if !(connect_timeout.is_finite() && connect_timeout > 0.0) {
            return Err(PyValueError::new_err(
                "connect_timeout must be a positive number of seconds",
            ));
        }
        let call_timeout = match timeout {
            None => None,
            Some(t) if t.is_finite() && t > 0.0 => Some(Duration::from_secs_f64(t)),
            Some(_) => {
                return Err(PyValueError::new_err(
                    "timeout must be a positive number of seconds or None",
                ))
            }
        };
        if max_connections == 0 {
            return Err(PyValueError::new_err("max_connections must be at least 1"));
        }
        // Given here, or TARN_ACCESS_KEY/TARN_SECRET_KEY, or the built-in
        // loopback credentials: resolved once, so every pooled connection
        // uses the same.
        let credentials = match (access_key, secret_key) {
            (Some(a), Some(s)) => Credentials::new(a, s),
            (None, None) => Credentials::from_env_or_default().map_err(PyValueError::new_err)?,
            _ => {
                return Err(PyValueError::new_err(
                    "give both access_key and secret_key, or neither",
                ))
            }
        };
        // TLS: with a CA bundle, or for a tls:// endpoint the system's
        // roots; resolved once for every connection of the pool.
        let tls = if ca_bundle.is_some() || endpoint.starts_with("tls://") {
            let c = tarn_client::tls::client_config(ca_bundle.as_deref())
                .map_err(|e| PyValueError::new_err(format!("ca_bundle: {e}")))?;
            Some(c)
        } else {
            None
        };
        let opts = ConnectOptions {
            transport,
            namespace: namespace.clone(),
            connect_timeout: Duration::from_secs_f64(connect_timeout),
            shm_mailbox,
            call_timeout,
            credentials: Some(credentials),
            tls,
            ..ConnectOptions::default()
        };
        let pool = Arc::new(Pool::new(endpoint, opts.clone(), max_connections));
        // Connect now: a wrong endpoint or namespace fails here, not at the
        // first call, and the transport is known.
        let first = py.detach(|| pool.checkout());
        let (mut c, _) = first.map_err(|e| py_err(py, e))?;
        let transport = c.transport();
        let value_max_bytes = c.client().value_max_bytes();
        // A member of a cluster names the others: keys are routed over them.
        let view = if cluster {
            let v = py.detach(|| c.cluster_view());
            match v {
                Ok(v) => Some(v),
                Err(e) => {
                    pool.checkin(c, !fatal(&e));
                    return Err(py_err(py, Failure::Call(e)));
                }
            }
        } else {
            None
        };
        pool.checkin(c, true);
        let router = view
            .filter(|v| !v.members.is_empty())
            .map(|v| routing::Router::new(v, opts, max_connections));
        Ok(Client {
            pool,
            router,
            reader: Mutex::new(None),
            namespace,
            transport,
            value_max_bytes,
        })
    }

    /// "shm" or "tcp": how the first connection reached the server.
    #[getter]
    fn transport(&self) -> &'static str {
        match self.transport {
            TransportKind::Shm => "shm",
            TransportKind::Tcp => "tcp",
        }
    }

    #[getter]
    fn namespace<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.namespace)
    }

    #[getter]
    fn endpoint(&self) -> &str {
        &self.pool.endpoint
    }

    /// Largest value the server stores.
    #[getter]
    fn value_max_bytes(&self) -> u64 {
        self.value_max_bytes
    }

    /// Which keys are stored: a list of bools.
    fn exists(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let d = digests(keys)?;
        py.detach(|| self.present(&d)).map_err(|e| py_err(py, e))
    }

    /// How many leading keys are all stored (a prompt's cached prefix).
    fn prefix_hits(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let d = digests(keys)?;
        py.detach(|| self.present(&d))
            .map(|p| p.iter().take_while(|p| **p).count())
            .map_err(|e| py_err(py, e))
    }

    /// Reads each key's whole value into the front of its buffer. Returns,
    /// per key, the number of bytes read or None for a miss (never stored,
    /// evicted, or dropped because it failed its checksum).
    #[pyo3(signature = (keys, buffers, offsets = None))]
    fn get_into<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        buffers: &Bound<'py, PyAny>,
        offsets: Option<Vec<u64>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let d = digests(keys)?;
        let held = self::buffers(buffers, true, d.len())?;
        let regions: Vec<Region> = held.iter().map(Borrowed::region).collect();
        check_disjoint(&regions)?;
        if offsets.as_ref().is_some_and(|o| o.len() != d.len()) {
            return Err(PyValueError::new_err("one offset per key"));
        }
        let offsets = offsets.as_deref();
        let outcomes = py
            .detach(|| {
                if let Some(r) = &self.router {
                    return r.get_into(&d, &regions, offsets);
                }
                self.pool.run(|c| {
                    let all: Vec<usize> = (0..d.len()).collect();
                    c.get_into(&mut routing::get_requests(&d, &regions, offsets, &all))
                })
            })
            .map_err(|e| py_err(py, e))?;
        drop(held);
        let out = PyList::empty(py);
        for (i, o) in outcomes.iter().enumerate() {
            match o.status {
                Status::Ok => out.append(o.len)?,
                s if s.is_miss() => out.append(py.None())?,
                Status::BufferTooSmall => {
                    return Err(PyValueError::new_err(format!(
                        "buffer {i} holds {} bytes but key {i}'s value is {} bytes",
                        regions[i].1, o.len
                    )))
                }
                // A range past a value's end: not the layout asked for.
                Status::BadRange if offsets.is_some() => out.append(py.None())?,
                Status::BadRange => {
                    return Err(PyValueError::new_err(format!(
                        "key {i}: bytes {}..{} lie outside its value",
                        offsets.map_or(0, |o| o[i]),
                        offsets.map_or(0, |o| o[i]) + regions[i].1 as u64
                    )))
                }
                s => {
                    return Err(raise(
                        py,
                        "KvServerError",
                        format!("get of key {i}: unexpected status {s:?}"),
                    ))
                }
            }
        }
        Ok(out)
    }

    /// Stores each buffer under its key. Returns the protocol status codes
    /// (`tarn.kv.Status`); `Client.put_from` maps them.
    fn put_from(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<u8>> {
        let d = digests(keys)?;
        let held = self::buffers(buffers, false, d.len())?;
        let regions: Vec<Region> = held.iter().map(Borrowed::region).collect();
        let statuses = py
            .detach(|| {
                if let Some(r) = &self.router {
                    return r.put_from(&d, &regions);
                }
                self.pool.run(|c| {
                    let all: Vec<usize> = (0..d.len()).collect();
                    c.put_from(&routing::put_items(&d, &regions, &all))
                })
            })
            .map_err(|e| py_err(py, e))?;
        drop(held);
        Ok(statuses.iter().map(|s| *s as u8).collect())
    }

    /// Stores parts of values: buffer i is bytes `[offsets[i], offsets[i] +
    /// len)` of key i's value of `value_lens[i]` bytes, which becomes
    /// visible once every byte was put (by any clients). Status codes as
    /// `put_from`.
    fn put_parts(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        buffers: &Bound<'_, PyAny>,
        value_lens: Vec<u64>,
        offsets: Vec<u64>,
    ) -> PyResult<Vec<u8>> {
        let d = digests(keys)?;
        let held = self::buffers(buffers, false, d.len())?;
        let regions: Vec<Region> = held.iter().map(Borrowed::region).collect();
        if value_lens.len() != d.len() || offsets.len() != d.len() {
            return Err(PyValueError::new_err(
                "one value length and one offset per key",
            ));
        }
        let parts: Vec<Part> = value_lens
            .iter()
            .zip(&offsets)
            .map(|(v, o)| Part {
                value_len: *v,
                offset: *o,
            })
            .collect();
        for (i, (p, r)) in parts.iter().zip(&regions).enumerate() {
            if r.1 == 0
                || p.offset
                    .checked_add(r.1 as u64)
                    .is_none_or(|e| e > p.value_len)
            {
                return Err(PyValueError::new_err(format!(
                    "part {i}: {} bytes at offset {} do not fit a value of {} bytes",
                    r.1, p.offset, p.value_len
                )));
            }
        }
        let statuses = py
            .detach(|| {
                if let Some(r) = &self.router {
                    return r.put_parts(&d, &regions, &parts);
                }
                self.pool.run(|c| {
                    let all: Vec<usize> = (0..d.len()).collect();
                    c.put_parts(&routing::put_items(&d, &regions, &all), &parts)
                })
            })
            .map_err(|e| py_err(py, e))?;
        drop(held);
        Ok(statuses.iter().map(|s| *s as u8).collect())
    }

    /// Marks blocks recently used; per key, whether it was stored.
    fn touch(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let d = digests(keys)?;
        py.detach(|| self.keys_call(&d, &|c, d| c.touch(d), false))
            .map(|s| bools(&s))
            .map_err(|e| py_err(py, e))
    }

    /// Protects blocks from eviction for `lease` seconds (the server caps
    /// it) or until unpinned; per key, whether it was stored.
    #[pyo3(signature = (keys, lease = 60.0))]
    fn pin(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, lease: f64) -> PyResult<Vec<bool>> {
        if !(lease.is_finite() && lease > 0.0) {
            return Err(PyValueError::new_err(
                "lease must be a positive number of seconds",
            ));
        }
        let d = digests(keys)?;
        let lease = Duration::from_secs_f64(lease.min(u32::MAX as f64 / 1000.0));
        py.detach(|| self.keys_call(&d, &|c, d| c.pin(d, lease), false))
            .map(|s| bools(&s))
            .map_err(|e| py_err(py, e))
    }

    fn unpin(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let d = digests(keys)?;
        py.detach(|| self.keys_call(&d, &|c, d| c.unpin(d), false))
            .map(|s| bools(&s))
            .map_err(|e| py_err(py, e))
    }

    /// Deletes blocks; per key, whether it was stored.
    fn delete(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<Vec<bool>> {
        let d = digests(keys)?;
        py.detach(|| self.keys_call(&d, &|c, d| c.delete(d), true))
            .map(|s| bools(&s))
            .map_err(|e| py_err(py, e))
    }

    /// Server counters, and this namespace's (keys prefixed `namespace.`).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py
            .detach(|| self.pool.run(|c| c.stats()))
            .map_err(|e| py_err(py, e))?;
        let d = PyDict::new(py);
        for (k, v) in s {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// The cluster's KV members this client routes over, as dicts (`id`,
    /// `endpoint`, `weight` per mille of a full share); empty when the
    /// server is not a cluster member (or `cluster=False`).
    #[getter]
    fn members<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        if let Some(r) = &self.router {
            for m in r.view().members {
                let d = PyDict::new(py);
                d.set_item("id", m.id)?;
                d.set_item("endpoint", m.endpoint)?;
                d.set_item("weight", m.weight)?;
                out.append(d)?;
            }
        }
        Ok(out)
    }

    /// The epoch of the view routed by (0 outside a cluster).
    #[getter]
    fn cluster_epoch(&self) -> u64 {
        self.router.as_ref().map_or(0, |r| r.view().epoch)
    }

    /// Each key's first-ranked member id (None outside a cluster).
    fn owners(&self, keys: &Bound<'_, PyAny>) -> PyResult<Vec<Option<String>>> {
        let d = digests(keys)?;
        Ok(match &self.router {
            Some(r) => r.owners(&d),
            None => vec![None; d.len()],
        })
    }

    /// What routing did so far: view refreshes, fallback gets and hits,
    /// copies written back, hot blocks copied, member failures.
    fn routing_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        if let Some(r) = &self.router {
            let c = &r.counters;
            for (k, v) in [
                ("refreshes", &c.refreshes),
                ("fallback_gets", &c.fallback_gets),
                ("fallback_hits", &c.fallback_hits),
                ("copies_written", &c.copies_written),
                ("hot_copies", &c.hot_copies),
                ("member_failures", &c.member_failures),
            ] {
                d.set_item(k, v.load(Ordering::Relaxed))?;
            }
        }
        Ok(d)
    }

    /// The arena mapping device copies read from: (address, bytes) of the
    /// reader connection's read-only mapping (opened now if needed); None
    /// when the client is not on shared memory or routes over a cluster.
    fn _reader_arena(&self, py: Python<'_>) -> PyResult<Option<(usize, usize)>> {
        if self.transport != TransportKind::Shm || self.router.is_some() {
            return Ok(None);
        }
        let mut r = self.reader.lock().unwrap_or_else(|p| p.into_inner());
        if r.is_none() {
            let opts = ConnectOptions {
                transport: TransportChoice::Shm,
                ..self.pool.opts.clone()
            };
            let c = py
                .detach(|| BlockingKvClient::connect(&self.pool.endpoint, opts))
                .map_err(|e| py_err(py, Failure::Connect(self.pool.endpoint.clone(), e)))?;
            *r = Some(c);
        }
        Ok(r.as_mut().and_then(|c| c.client().arena_mapping()))
    }

    /// Locates whole values in the reader's arena mapping without copying:
    /// per key (address, length) or None for a miss. Check them with
    /// `_verify` after copying.
    fn _locate<'py>(&self, py: Python<'py>, keys: &Bound<'py, PyAny>) -> PyResult<Located> {
        let d = digests(keys)?;
        let reqs: Vec<(Digest, u64, Option<u64>)> = d.iter().map(|k| (*k, 0, None)).collect();
        let mut r = self.reader.lock().unwrap_or_else(|p| p.into_inner());
        let Some(c) = r.as_mut() else {
            return Err(PyValueError::new_err(
                "no reader connection: call _reader_arena first",
            ));
        };
        let locs = py
            .detach(|| c.locate(&reqs))
            .map_err(|e| py_err(py, Failure::Call(e)))?;
        Ok(Located(locs))
    }

    /// Per located block: the copy holds it (the slot was not reused; with
    /// `check_crc`, its arena bytes match the value's CRC, computed while a
    /// device copy runs, without a copy of its own).
    fn _verify(&self, py: Python<'_>, located: &Located, check_crc: bool) -> PyResult<Vec<bool>> {
        let r = self.reader.lock().unwrap_or_else(|p| p.into_inner());
        let Some(c) = r.as_ref() else {
            return Err(PyValueError::new_err("no reader connection"));
        };
        Ok(py.detach(|| c.verify_located(&located.0, check_crc)))
    }

    /// Closes the reader connection (after its mapping was unregistered
    /// from the CUDA driver).
    fn _reader_close(&self, py: Python<'_>) {
        let c = self.reader.lock().unwrap_or_else(|p| p.into_inner()).take();
        py.detach(|| drop(c));
    }

    /// Closes idle connections; calls after this raise.
    fn close(&self, py: Python<'_>) {
        py.detach(|| {
            self.pool.close();
            if let Some(r) = &self.router {
                r.close();
            }
        })
    }
}

/// Blocks located in the reader's arena mapping (`Client._locate`).
#[pyclass(frozen, module = "tarn._native", name = "Located")]
struct Located(Vec<tarn_client::Located>);

#[pymethods]
impl Located {
    /// Per key (address, length) of its bytes in the arena mapping, or None.
    #[getter]
    fn entries(&self) -> Vec<Option<(usize, u64)>> {
        self.0
            .iter()
            .map(|l| (l.status == Status::Ok).then_some((l.address, l.len)))
            .collect()
    }
}

/// A per-key status call on a connection (touch, pin, unpin, delete).
type KeysCall<'a> =
    dyn Fn(&mut BlockingKvClient, &[Digest]) -> Result<Vec<Status>, Error> + Sync + 'a;

impl Client {
    /// Which keys are stored, through the router when there is one.
    fn present(&self, d: &[Digest]) -> Result<Vec<bool>, Failure> {
        match &self.router {
            Some(r) => r.exists(d),
            None => self.pool.run(|c| c.exists(d)).map(|r| r.present),
        }
    }

    /// A per-key status call, through the router when there is one (`both`:
    /// at a key's second-ranked member too).
    fn keys_call(
        &self,
        d: &[Digest],
        f: &KeysCall<'_>,
        both: bool,
    ) -> Result<Vec<Status>, Failure> {
        match &self.router {
            Some(r) => {
                let sub = |c: &mut BlockingKvClient, idx: &[usize]| {
                    let keys: Vec<Digest> = idx.iter().map(|i| d[*i]).collect();
                    f(c, &keys)
                };
                r.statuses(d, &sub, both)
            }
            None => self.pool.run(|c| f(c, d)),
        }
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Client>()?;
    m.add_class::<Located>()?;
    m.add_class::<objects::ObjectClient>()?;
    m.add_class::<objects::Ring>()?;
    m.add_class::<objects::HostMemory>()?;
    m.add_class::<objects::Multipart>()?;
    m.add("DIGEST_BYTES", std::mem::size_of::<Digest>())?;
    Ok(())
}
