//! Thread-per-core runtimes: one single-threaded tokio runtime per core, pinned,
//! each with its own io_uring.

use std::cell::Cell;

thread_local! {
    static CORE_ID: Cell<Option<usize>> = const { Cell::new(None) };
}

/// The core this thread serves, if it is a runtime thread.
pub fn core_id() -> Option<usize> {
    CORE_ID.with(|c| c.get())
}

/// Pins the calling thread to `core` (best effort) and records it for pools.
pub fn enter_core(core: usize, pin: bool) {
    CORE_ID.with(|c| c.set(Some(core)));
    if pin {
        // SAFETY: plain syscall on a zero-initialised cpu_set_t.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(core, &mut set);
            let rc = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
            if rc != 0 {
                tracing::warn!(core, error = %std::io::Error::last_os_error(), "could not pin runtime thread");
            }
        }
    }
}

/// Builds the current thread's runtime and installs its io_uring (when the kernel
/// allows it). Must be called on the thread that will run the runtime.
pub fn build_core_runtime(
    core: usize,
    pin: bool,
    use_uring: bool,
) -> std::io::Result<tokio::runtime::Runtime> {
    enter_core(core, pin);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .thread_name(format!("tarn-core-{core}"))
        .max_blocking_threads(64)
        .build()?;
    if use_uring {
        let _guard = rt.enter();
        if let Err(error) = crate::uring::install() {
            tracing::warn!(core, %error, "io_uring unavailable, using blocking-thread file I/O");
        }
    }
    Ok(rt)
}
