//! Caller memory for the GIL-free part of a call: anything with the buffer
//! protocol (bytearray, memoryview, numpy arrays), and torch CPU tensors
//! through `data_ptr()`.

use std::mem::MaybeUninit;

use pyo3::exceptions::{PyBufferError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::{ffi, intern};

/// Raises `tarn.errors.<kind>(message)`; the classes live in Python so they
/// can also derive from the built-in exception they resemble.
pub fn raise(py: Python<'_>, kind: &str, message: String) -> PyErr {
    let made = py
        .import("tarn.errors")
        .and_then(|m| m.getattr(kind))
        .and_then(|cls| cls.call1((message.clone(),)));
    match made {
        Ok(exc) => PyErr::from_value(exc),
        Err(e) => e,
    }
}

/// Caller memory borrowed for one call. Dropped with the GIL held (the
/// buffer view is released then).
pub struct Borrowed {
    pub ptr: *mut u8,
    pub len: usize,
    view: Option<Box<ffi::Py_buffer>>,
    _tensor: Option<Py<PyAny>>,
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        if let Some(v) = self.view.as_mut() {
            // SAFETY: the view was filled by PyObject_GetBuffer and is
            // released once, with the GIL held (Borrowed never leaves the
            // GIL-holding frame that made it).
            unsafe { ffi::PyBuffer_Release(&mut **v) };
        }
    }
}

/// Address and length, sendable to the GIL-free part of a call.
#[derive(Clone, Copy)]
pub struct Region(pub usize, pub usize);

impl Borrowed {
    pub fn region(&self) -> Region {
        Region(self.ptr as usize, self.len)
    }
}

pub fn borrow(obj: &Bound<'_, PyAny>, writable: bool, i: usize) -> PyResult<Borrowed> {
    let mut flags = ffi::PyBUF_ANY_CONTIGUOUS;
    if writable {
        flags |= ffi::PyBUF_WRITABLE;
    }
    let mut view: Box<MaybeUninit<ffi::Py_buffer>> = Box::new(MaybeUninit::zeroed());
    // SAFETY: obj is a live object; view is writable memory for one Py_buffer.
    let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), view.as_mut_ptr(), flags) };
    if rc == 0 {
        // SAFETY: filled by a successful PyObject_GetBuffer.
        let view: Box<ffi::Py_buffer> = unsafe { Box::from_raw(Box::into_raw(view).cast()) };
        let len = view.len as usize;
        return Ok(Borrowed {
            // An empty buffer may have no address; a slice needs one.
            ptr: if len == 0 {
                std::ptr::NonNull::<u8>::dangling().as_ptr()
            } else {
                view.buf.cast()
            },
            len,
            view: Some(view),
            _tensor: None,
        });
    }
    let err = PyErr::fetch(obj.py());
    let py = obj.py();
    if err.is_instance_of::<PyTypeError>(py) && obj.hasattr(intern!(py, "data_ptr"))? {
        return borrow_tensor(obj, i);
    }
    let what = if writable {
        "a writable, contiguous buffer"
    } else {
        "a contiguous buffer"
    };
    // Not a buffer at all: TypeError; a buffer that will not do (read-only,
    // not contiguous): BufferError.
    let cls = if err.is_instance_of::<PyTypeError>(py) {
        PyTypeError::new_err
    } else {
        PyBufferError::new_err
    };
    Err(cls(format!(
        "buffer {i}: expected {what} (bytearray, memoryview, numpy array, CPU torch tensor): {}",
        err.value(py)
    )))
}

/// torch tensors do not export the buffer protocol; a contiguous CPU tensor
/// is one run of memory at `data_ptr()`.
fn borrow_tensor(obj: &Bound<'_, PyAny>, i: usize) -> PyResult<Borrowed> {
    let py = obj.py();
    let device: String = obj
        .getattr(intern!(py, "device"))?
        .getattr(intern!(py, "type"))?
        .extract()?;
    if device != "cpu" {
        return Err(PyTypeError::new_err(format!(
            "buffer {i}: a tensor on {device}; Tarn reads and writes host memory \
             (copy through a CPU staging tensor)"
        )));
    }
    if !obj
        .call_method0(intern!(py, "is_contiguous"))?
        .extract::<bool>()?
    {
        return Err(PyBufferError::new_err(format!(
            "buffer {i}: tensor is not contiguous"
        )));
    }
    let ptr: usize = obj.call_method0(intern!(py, "data_ptr"))?.extract()?;
    let numel: usize = obj.call_method0(intern!(py, "numel"))?.extract()?;
    let size: usize = obj.call_method0(intern!(py, "element_size"))?.extract()?;
    let len = numel
        .checked_mul(size)
        .ok_or_else(|| PyValueError::new_err(format!("buffer {i}: tensor size overflows")))?;
    Ok(Borrowed {
        ptr: if len == 0 {
            std::ptr::NonNull::<u8>::dangling().as_ptr()
        } else {
            ptr as *mut u8
        },
        len,
        view: None,
        _tensor: Some(obj.clone().unbind()),
    })
}
