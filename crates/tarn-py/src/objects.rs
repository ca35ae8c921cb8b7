//! `tarn._native.ObjectClient` and `Ring`: the Rust object client under
//! `tarn.objects`. Buffers (anything with the buffer protocol, torch CPU
//! tensors) are borrowed, registered with the client and held until their
//! read completes; every wait and every blocking call releases the GIL.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use tarn_client::object::{
    self, Addressing, Buffer, ClientConfig, Completion, Error, Failure, ObjectError, PutOptions,
    S3Credentials,
};

use crate::buffers::{borrow, raise, Borrowed};

/// The Python exception for a failed read or write, with the object, the
/// bytes and the attempts as attributes.
pub fn object_err(py: Python<'_>, e: &ObjectError) -> PyErr {
    let kind = match &e.failure {
        Failure::NotFound { .. } => "ObjectNotFoundError",
        Failure::Denied { .. } => "ObjectPermissionError",
        Failure::Io { .. } => "ObjectConnectionError",
        _ => "ObjectError",
    };
    let err = raise(py, kind, e.to_string());
    let v = err.value(py);
    let _ = v.setattr("bucket", &*e.bucket);
    let _ = v.setattr("key", &*e.key);
    let _ = v.setattr("range", e.range);
    let _ = v.setattr("attempts", e.attempts);
    let status = match &e.failure {
        Failure::Status { status, .. } => Some(*status),
        Failure::NotFound { .. } => Some(404),
        Failure::Denied { .. } => Some(403),
        Failure::Changed => Some(412),
        Failure::OutOfRange { .. } => Some(416),
        _ => None,
    };
    let _ = v.setattr("status", status);
    err
}

fn py_error(py: Python<'_>, e: Error) -> PyErr {
    match e {
        Error::Usage(m) => PyValueError::new_err(m),
        Error::Object(o) => object_err(py, &o),
    }
}

/// A borrowed Python buffer, held across threads but only ever dropped with
/// the GIL held (by `wait`, or by the ring's own drop, which runs under it).
struct Held(#[allow(dead_code)] Borrowed);

// SAFETY: `Held` is only created and dropped while the GIL is held; between
// the two, other threads use only the raw memory it keeps alive.
unsafe impl Send for Held {}

/// One read as Python gives it.
struct ReadArg {
    bucket: String,
    key: String,
    offset: u64,
    len: u64,
    buffer: Buffer,
    buffer_offset: u64,
    user: Option<Py<PyAny>>,
    etag: Option<String>,
    held: Held,
}

/// `(bucket, key, offset, length, buffer, buffer_offset[, user_data[, etag]])`.
fn parse_reads(reads: &Bound<'_, PyAny>) -> PyResult<Vec<ReadArg>> {
    let mut out = Vec::new();
    for (i, item) in reads.try_iter()?.enumerate() {
        let item = item?;
        let t = item.cast::<PyTuple>().map_err(|_| {
            PyTypeError::new_err(format!(
                "read {i}: expected a tuple (bucket, key, offset, length, buffer, buffer_offset[, user_data[, etag]])"
            ))
        })?;
        if !(6..=8).contains(&t.len()) {
            return Err(PyTypeError::new_err(format!(
                "read {i}: a tuple of 6 to 8 items, not {}",
                t.len()
            )));
        }
        let b = borrow(&t.get_item(4)?, true, i)?;
        // SAFETY: the view stays held (in `held`) until the read completes,
        // and the client writes only inside it.
        let buffer = unsafe { Buffer::from_raw(b.ptr, b.len, ()) };
        let user = if t.len() > 6 {
            Some(t.get_item(6)?.unbind())
        } else {
            None
        };
        let etag = if t.len() > 7 {
            t.get_item(7)?.extract::<Option<String>>()?
        } else {
            None
        };
        out.push(ReadArg {
            bucket: t.get_item(0)?.extract()?,
            key: t.get_item(1)?.extract()?,
            offset: t.get_item(2)?.extract()?,
            len: t.get_item(3)?.extract()?,
            buffer,
            buffer_offset: t.get_item(5)?.extract()?,
            user,
            etag,
            held: Held(b),
        });
    }
    Ok(out)
}

fn as_reads(args: &[ReadArg], tag: impl Fn(usize) -> u64) -> Vec<object::Read<'_>> {
    args.iter()
        .enumerate()
        .map(|(i, a)| object::Read {
            bucket: &a.bucket,
            key: &a.key,
            offset: a.offset,
            len: a.len,
            buffer: &a.buffer,
            buffer_offset: a.buffer_offset,
            user_data: tag(i),
            etag: a.etag.as_deref(),
        })
        .collect()
}

fn secs(v: Option<f64>, name: &str) -> PyResult<Option<Duration>> {
    match v {
        None => Ok(None),
        Some(s) if s.is_finite() && s > 0.0 => Ok(Some(Duration::from_secs_f64(s))),
        Some(s) => Err(PyValueError::new_err(format!(
            "{name} must be a positive number of seconds, not {s}"
        ))),
    }
}

/// A `wait`'s timeout: None waits for good, 0 polls.
fn wait_timeout(v: Option<f64>) -> PyResult<Option<Duration>> {
    match v {
        Some(t) if t >= 0.0 && t.is_finite() => Ok(Some(Duration::from_secs_f64(t))),
        Some(t) => Err(PyValueError::new_err(format!("timeout {t}"))),
        None => Ok(None),
    }
}

/// The native object client; `tarn.objects.Client` derives from it.
#[pyclass(subclass, frozen, module = "tarn._native", name = "ObjectClient")]
pub struct ObjectClient {
    inner: object::ObjectClient,
}

#[pymethods]
impl ObjectClient {
    #[new]
    // The Python constructor's keyword arguments, one parameter each.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (endpoint = None, *, access_key = None, secret_key = None,
        session_token = None, region = None, profile = None, addressing = None,
        connections = None, chunk_size = None, merge_gap = None, max_inflight = None,
        retries = None, hedge = None, part_size = None, io_timeout = None,
        connect_timeout = None, ca_bundle = None, local_reads = None))]
    fn new(
        endpoint: Option<&Bound<'_, PyAny>>,
        access_key: Option<String>,
        secret_key: Option<String>,
        session_token: Option<String>,
        region: Option<String>,
        profile: Option<String>,
        addressing: Option<String>,
        connections: Option<usize>,
        chunk_size: Option<u64>,
        merge_gap: Option<u64>,
        max_inflight: Option<u64>,
        retries: Option<u32>,
        hedge: Option<bool>,
        part_size: Option<u64>,
        io_timeout: Option<f64>,
        connect_timeout: Option<f64>,
        ca_bundle: Option<std::path::PathBuf>,
        local_reads: Option<bool>,
    ) -> PyResult<Self> {
        let env = |k: &str| -> Option<String> {
            if k == "AWS_PROFILE" {
                if let Some(p) = &profile {
                    return Some(p.clone());
                }
            }
            std::env::var(k).ok().filter(|v| !v.is_empty())
        };
        let mut cfg = ClientConfig::from_sources(&env).map_err(|e| match e {
            Error::Usage(m) => PyValueError::new_err(m),
            Error::Object(o) => PyValueError::new_err(o.to_string()),
        })?;
        if let Some(e) = endpoint {
            cfg.endpoints = if let Ok(s) = e.extract::<String>() {
                s.split(',').map(|p| p.trim().to_string()).collect()
            } else {
                e.extract::<Vec<String>>()
                    .map_err(|_| PyTypeError::new_err("endpoint must be a URL or a list of URLs"))?
            };
        }
        match (access_key, secret_key) {
            (Some(a), Some(s)) => {
                cfg.credentials = Some(S3Credentials {
                    access_key: a,
                    secret_key: s,
                    session_token,
                })
            }
            (None, None) => {}
            _ => {
                return Err(PyValueError::new_err(
                    "give both access_key and secret_key, or neither",
                ))
            }
        }
        if let Some(r) = region {
            cfg.region = r;
        }
        if let Some(a) = addressing {
            cfg.addressing = match a.as_str() {
                "path" => Addressing::Path,
                "virtual" => Addressing::Virtual,
                other => {
                    return Err(PyValueError::new_err(format!(
                        "addressing {other:?}: expected 'path' or 'virtual'"
                    )))
                }
            };
        }
        if let Some(v) = connections {
            cfg.connections = v;
        }
        if let Some(v) = chunk_size {
            cfg.chunk_bytes = v;
        }
        if let Some(v) = merge_gap {
            cfg.merge_gap_bytes = v;
        }
        if let Some(v) = max_inflight {
            cfg.max_inflight_bytes = v;
        }
        if let Some(v) = retries {
            cfg.retries = v;
        }
        if let Some(v) = hedge {
            cfg.hedge = v;
        }
        if let Some(v) = part_size {
            cfg.part_bytes = v;
        }
        if let Some(v) = secs(io_timeout, "io_timeout")? {
            cfg.io_timeout = v;
        }
        if let Some(v) = secs(connect_timeout, "connect_timeout")? {
            cfg.connect_timeout = v;
        }
        if let Some(v) = ca_bundle {
            cfg.ca_bundle = Some(v);
        }
        if let Some(v) = local_reads {
            cfg.local_reads = v;
        }
        let inner = object::ObjectClient::new(cfg).map_err(|e| match e {
            Error::Usage(m) => PyValueError::new_err(m),
            Error::Object(o) => PyValueError::new_err(o.to_string()),
        })?;
        Ok(ObjectClient { inner })
    }

    /// The endpoints, as configured.
    #[getter]
    fn endpoints(&self) -> Vec<String> {
        self.inner.config().endpoints.clone()
    }

    #[getter]
    fn region(&self) -> String {
        self.inner.config().region.clone()
    }

    #[getter]
    fn chunk_size(&self) -> u64 {
        self.inner.config().chunk_bytes
    }

    #[getter]
    fn connections(&self) -> usize {
        self.inner.config().connections
    }

    /// `(size, etag)` of an object.
    fn head(&self, py: Python<'_>, bucket: &str, key: &str) -> PyResult<(u64, String)> {
        let c = self.inner.clone();
        let (b, k) = (bucket.to_string(), key.to_string());
        py.detach(move || c.head(&b, &k))
            .map(|i| (i.size, i.etag))
            .map_err(|e| py_error(py, e))
    }

    /// `(bytes, size, etag)`: the first `length` bytes of an object (fewer if
    /// it is shorter), its size and its ETag, in one request.
    fn read_prefix<'py>(
        &self,
        py: Python<'py>,
        bucket: &str,
        key: &str,
        length: u64,
    ) -> PyResult<(Bound<'py, pyo3::types::PyBytes>, u64, String)> {
        let c = self.inner.clone();
        let (b, k) = (bucket.to_string(), key.to_string());
        let (data, info) = py
            .detach(move || c.read_prefix(&b, &k, length))
            .map_err(|e| py_error(py, e))?;
        Ok((pyo3::types::PyBytes::new(py, &data), info.size, info.etag))
    }

    /// Creates a bucket (one this account already owns is not an error).
    fn create_bucket(&self, py: Python<'_>, bucket: &str) -> PyResult<()> {
        let c = self.inner.clone();
        let b = bucket.to_string();
        py.detach(move || c.create_bucket(&b))
            .map_err(|e| py_error(py, e))
    }

    /// `[(key, size, etag, last_modified)]` of every object under `prefix`.
    #[pyo3(signature = (bucket, prefix = ""))]
    fn list(
        &self,
        py: Python<'_>,
        bucket: &str,
        prefix: &str,
    ) -> PyResult<Vec<(String, u64, String, String)>> {
        let c = self.inner.clone();
        let (b, p) = (bucket.to_string(), prefix.to_string());
        py.detach(move || c.list(&b, &p))
            .map(|v| {
                v.into_iter()
                    .map(|l| (l.key, l.size, l.etag, l.last_modified))
                    .collect()
            })
            .map_err(|e| py_error(py, e))
    }

    /// Deletes an object (one that is not there is not an error).
    fn delete(&self, py: Python<'_>, bucket: &str, key: &str) -> PyResult<()> {
        let c = self.inner.clone();
        let (b, k) = (bucket.to_string(), key.to_string());
        py.detach(move || c.delete(&b, &k))
            .map_err(|e| py_error(py, e))
    }

    /// `[(key, upload_id, initiated)]` of the multipart uploads in progress
    /// under `prefix`.
    #[pyo3(signature = (bucket, prefix = ""))]
    fn list_uploads(
        &self,
        py: Python<'_>,
        bucket: &str,
        prefix: &str,
    ) -> PyResult<Vec<(String, String, String)>> {
        let c = self.inner.clone();
        let (b, p) = (bucket.to_string(), prefix.to_string());
        py.detach(move || c.list_uploads(&b, &p))
            .map(|v| {
                v.into_iter()
                    .map(|u| (u.key, u.upload_id, u.initiated))
                    .collect()
            })
            .map_err(|e| py_error(py, e))
    }

    /// Aborts a multipart upload (one already gone is not an error).
    fn abort_upload(
        &self,
        py: Python<'_>,
        bucket: &str,
        key: &str,
        upload_id: &str,
    ) -> PyResult<()> {
        let c = self.inner.clone();
        let (b, k, u) = (bucket.to_string(), key.to_string(), upload_id.to_string());
        py.detach(move || c.abort_upload(&b, &k, &u))
            .map_err(|e| py_error(py, e))
    }

    /// Starts a multipart upload whose parts are sent one at a time.
    #[pyo3(signature = (bucket, key, *, content_type = None, if_none_match = false,
        if_match = None))]
    fn multipart(
        &self,
        py: Python<'_>,
        bucket: &str,
        key: &str,
        content_type: Option<String>,
        if_none_match: bool,
        if_match: Option<String>,
    ) -> PyResult<Multipart> {
        let opts = PutOptions {
            part_bytes: None,
            content_type,
            if_none_match,
            if_match,
        };
        let c = self.inner.clone();
        let (b, k) = (bucket.to_string(), key.to_string());
        let mp = py
            .detach(move || c.multipart(&b, &k, &opts))
            .map_err(|e| py_error(py, e))?;
        Ok(Multipart {
            mp,
            held: Mutex::new(HashMap::new()),
        })
    }

    /// Reads a batch and waits for all of it. Returns the bytes read per
    /// read; raises the first failure (in the batch's order) once every
    /// read has finished.
    fn read(&self, py: Python<'_>, reads: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        let args = parse_reads(reads)?;
        let c = self.inner.clone();
        let rs = as_reads(&args, |i| i as u64);
        let results = py.detach(|| c.read(&rs)).map_err(|e| py_error(py, e))?;
        drop(rs);
        let mut out = Vec::with_capacity(results.len());
        for r in results {
            match r {
                Ok(n) => out.push(n),
                Err(e) => return Err(object_err(py, &e)),
            }
        }
        drop(args);
        Ok(out)
    }

    /// Writes `buffer` (bytes-like, numpy, torch CPU tensor) as one object:
    /// a PUT, or a multipart upload with parallel parts. Returns the ETag.
    #[pyo3(signature = (bucket, key, buffer, *, part_size = None, content_type = None,
        if_none_match = false, if_match = None))]
    #[allow(clippy::too_many_arguments)]
    fn put(
        &self,
        py: Python<'_>,
        bucket: &str,
        key: &str,
        buffer: &Bound<'_, PyAny>,
        part_size: Option<u64>,
        content_type: Option<String>,
        if_none_match: bool,
        if_match: Option<String>,
    ) -> PyResult<String> {
        let b = borrow(buffer, false, 0)?;
        // SAFETY: the view is held (`b`) for the whole call.
        let buf = unsafe { Buffer::from_raw(b.ptr, b.len, ()) };
        let opts = PutOptions {
            part_bytes: part_size,
            content_type,
            if_none_match,
            if_match,
        };
        let c = self.inner.clone();
        let (bk, k) = (bucket.to_string(), key.to_string());
        let len = b.len as u64;
        let r = py.detach(|| c.put(&bk, &k, &buf, 0, len, &opts));
        drop(buf);
        drop(b);
        r.map_err(|e| py_error(py, e))
    }

    /// A submission and completion queue.
    fn ring(&self) -> Ring {
        Ring {
            ring: self.inner.ring(),
            pending: Mutex::new(HashMap::new()),
            next: AtomicU64::new(0),
        }
    }

    /// Counters since the client was made.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("requests", s.requests)?;
        d.set_item("bytes_received", s.bytes_received)?;
        d.set_item("bytes_sent", s.bytes_sent)?;
        d.set_item("retries", s.retries)?;
        d.set_item("hedges", s.hedges)?;
        d.set_item("hedges_won", s.hedges_won)?;
        d.set_item("connections_opened", s.connections_opened)?;
        d.set_item("local_bytes", s.local_bytes)?;
        d.set_item("local_fallback_bytes", s.local_fallback_bytes)?;
        d.set_item("local_mapped_bytes", s.local_mapped_bytes)?;
        d.set_item("local_grants", s.local_grants)?;
        Ok(d)
    }
}

/// A multipart upload sent part by part (`tarn.objects.Multipart` wraps
/// it). Each part's buffer is held until `wait` has returned the part (or
/// the upload has ended).
#[pyclass(frozen, module = "tarn._native", name = "Multipart")]
pub struct Multipart {
    // Dropped first: waits until no part is in flight, so the views below
    // may be released after.
    mp: object::Multipart,
    held: Mutex<HashMap<u32, Held>>,
}

#[pymethods]
impl Multipart {
    /// Queues part `number` (1 to 10000): the bytes of `buffer`, which are
    /// the object's bytes from `object_offset` (named in errors). Returns at
    /// once; the buffer must not change until `wait` returns the part.
    #[pyo3(signature = (number, buffer, object_offset = 0))]
    fn send(
        &self,
        py: Python<'_>,
        number: u32,
        buffer: &Bound<'_, PyAny>,
        object_offset: u64,
    ) -> PyResult<()> {
        let b = borrow(buffer, false, 0)?;
        // SAFETY: the view is held (in `held`) until the part is done.
        let buf = unsafe { Buffer::from_raw(b.ptr, b.len, ()) };
        let len = b.len as u64;
        self.mp
            .send_part(number, object_offset, &buf, 0, len)
            .map_err(|e| py_error(py, e))?;
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(number, Held(b));
        Ok(())
    }

    /// Waits until `min` parts have finished (fewer if fewer are in flight)
    /// or `timeout` seconds pass; returns `[(number, None or exception)]`.
    #[pyo3(signature = (min = 1, timeout = None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        min: usize,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let timeout = wait_timeout(timeout)?;
        let done = py.detach(|| self.mp.wait_parts(min, timeout));
        let out = PyList::empty(py);
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        for (n, r) in done {
            drop(held.remove(&n));
            let value = match r {
                Ok(()) => py.None().into_bound(py),
                Err(e) => object_err(py, &e).into_value(py).into_bound(py).into_any(),
            };
            out.append((n, value))?;
        }
        Ok(out)
    }

    /// Parts queued or being sent.
    #[getter]
    fn outstanding(&self) -> usize {
        self.mp.outstanding()
    }

    #[getter]
    fn upload_id(&self) -> String {
        self.mp.upload_id().to_string()
    }

    /// Waits for every part and completes the upload: the object appears
    /// now (under the upload's conditions). A failed part, or a failed
    /// completion, aborts it and raises. Returns the ETag.
    fn complete(&self, py: Python<'_>) -> PyResult<String> {
        let r = py.detach(|| self.mp.complete());
        self.held.lock().unwrap_or_else(|e| e.into_inner()).clear();
        r.map_err(|e| py_error(py, e))
    }

    /// Drops what is queued, waits for what is being sent, and aborts the
    /// upload: the object does not change.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        let r = py.detach(|| self.mp.abort());
        self.held.lock().unwrap_or_else(|e| e.into_inner()).clear();
        r.map_err(|e| py_error(py, e))
    }
}

/// A read in flight: what to hand back, and the memory it holds.
struct Pending {
    user: Option<Py<PyAny>>,
    _held: Held,
}

/// Submission and completion queue; `tarn.objects.Ring` wraps it.
#[pyclass(frozen, module = "tarn._native", name = "Ring")]
pub struct Ring {
    // Dropped first: waits until no I/O is in flight, so the views below
    // may be released after.
    ring: object::Ring,
    pending: Mutex<HashMap<u64, Pending>>,
    next: AtomicU64,
}

#[pymethods]
impl Ring {
    /// Queues reads `(bucket, key, offset, length, buffer, buffer_offset,
    /// user_data[, etag])`; returns at once.
    fn submit(&self, py: Python<'_>, reads: &Bound<'_, PyAny>) -> PyResult<()> {
        let args = parse_reads(reads)?;
        let base = self.next.fetch_add(args.len() as u64, Ordering::Relaxed);
        self.ring
            .submit(&as_reads(&args, |i| base + i as u64))
            .map_err(|e| py_error(py, e))?;
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        for (i, a) in args.into_iter().enumerate() {
            p.insert(
                base + i as u64,
                Pending {
                    user: a.user,
                    _held: a.held,
                },
            );
        }
        Ok(())
    }

    /// Waits for at least `min` completions (fewer if fewer are pending) or
    /// `timeout` seconds; returns `[(user_data, nbytes or exception)]`.
    #[pyo3(signature = (min = 1, timeout = None))]
    fn wait<'py>(
        &self,
        py: Python<'py>,
        min: usize,
        timeout: Option<f64>,
    ) -> PyResult<Bound<'py, PyList>> {
        let timeout = wait_timeout(timeout)?;
        let done: Vec<Completion> = py.detach(|| self.ring.wait(min, timeout));
        let out = PyList::empty(py);
        let mut p = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        for c in done {
            let entry = p.remove(&c.user_data);
            let user = entry
                .as_ref()
                .and_then(|e| e.user.as_ref())
                .map(|u| u.clone_ref(py).into_bound(py))
                .unwrap_or_else(|| py.None().into_bound(py));
            let value = match c.result {
                Ok(n) => n.into_pyobject(py)?.into_any(),
                Err(e) => object_err(py, &e).into_value(py).into_bound(py).into_any(),
            };
            out.append((user, value))?;
            drop(entry);
        }
        Ok(out)
    }

    /// Reads submitted whose completion `wait` has not returned yet.
    #[getter]
    fn pending(&self) -> usize {
        self.ring.pending()
    }

    /// Stops what is queued and cuts what runs: each such read completes
    /// with an error.
    fn cancel(&self) {
        self.ring.cancel();
    }
}

/// Host memory that short-circuit reads may fill by mapping the shard files'
/// verified, locked page-cache pages (copy-on-write) instead of copying:
/// `torch.frombuffer(HostMemory(n), ...)` makes a tensor of it (the loader's
/// CPU tensors). Zeroed; freed with the last reference to it.
#[pyclass(frozen, module = "tarn._native", name = "HostMemory")]
pub struct HostMemory(object::HostMemory);

#[pymethods]
impl HostMemory {
    #[new]
    fn new(nbytes: usize) -> PyResult<HostMemory> {
        object::HostMemory::new(nbytes)
            .map(HostMemory)
            .map_err(|e| pyo3::exceptions::PyMemoryError::new_err(format!("{nbytes} bytes: {e}")))
    }

    fn __len__(&self) -> usize {
        self.0.len()
    }

    /// The address of its first byte.
    #[getter]
    fn address(&self) -> usize {
        self.0.as_ptr() as usize
    }

    /// Runs of shard-file pages mapped into it.
    #[getter]
    fn mapped_runs(&self) -> usize {
        self.0.mapped_runs()
    }

    /// # Safety
    /// Called by Python with a view to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let (ptr, len) = (slf.get().0.as_ptr(), slf.get().0.len());
        // SAFETY: the memory lives as long as the object, which the view
        // holds a reference to (PyBuffer_FillInfo takes one).
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr.cast(),
                len as pyo3::ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// # Safety
    /// Called by Python for a view `__getbuffer__` filled.
    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
}
