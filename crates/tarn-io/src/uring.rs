//! One io_uring per runtime thread.
//!
//! Operations own their resources (file handle, buffer) for as long as the kernel
//! may touch them: an operation whose future is dropped early parks its resources
//! in the ring's table until the completion arrives, so cancellation can never free
//! memory the kernel is still writing into.
//!
//! Completions are reaped by a small task per thread woken through an eventfd
//! registered with the ring; no thread ever blocks in `io_uring_enter`.

use std::any::Any;
use std::cell::RefCell;
use std::future::Future;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::thread::ThreadId;

use io_uring::{squeue, IoUring};
use tokio::io::unix::AsyncFd;

/// Submission queue depth of each ring; also bounds in-flight disk I/O per core
/// before submissions start to wait for the kernel to take entries.
const RING_ENTRIES: u32 = 256;

enum Slot {
    Waiting(Option<Waker>),
    Done(i32),
    /// The future was dropped; the resources wait here for the completion.
    /// When the operation returns a new descriptor (open), it is closed then.
    Orphaned(#[allow(dead_code)] Box<dyn Any>, bool),
}

struct Driver {
    ring: IoUring,
    slots: Vec<Option<Slot>>,
    free: Vec<usize>,
}

thread_local! {
    static DRIVER: RefCell<Option<Driver>> = const { RefCell::new(None) };
}

/// Creates this thread's ring and spawns its reaper on the current runtime.
pub(crate) fn install() -> std::io::Result<()> {
    let ring = IoUring::new(RING_ENTRIES)?;
    // SAFETY: plain syscall; the fd is owned below.
    let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: raw is a fresh fd we own.
    let eventfd = unsafe { OwnedFd::from_raw_fd(raw) };
    ring.submitter().register_eventfd(eventfd.as_raw_fd())?;
    // SAFETY: the eventfd is owned by the AsyncFd and closed only when it drops,
    // after deregistration.
    let notify = unsafe { AsyncFd::register(eventfd) }.map_err(|e| e.into_parts().1)?;
    DRIVER.with(|d| {
        *d.borrow_mut() = Some(Driver {
            ring,
            slots: Vec::new(),
            free: Vec::new(),
        })
    });
    tokio::spawn(async move {
        loop {
            let Ok(mut guard) = notify.readable().await else {
                return;
            };
            let mut counter = 0u64;
            // SAFETY: reading 8 bytes into a u64 from a nonblocking eventfd.
            unsafe { libc::read(notify.as_raw_fd(), (&raw mut counter).cast(), 8) };
            guard.clear_ready();
            reap();
        }
    });
    Ok(())
}

/// Whether the calling thread has a ring.
pub(crate) fn available() -> bool {
    DRIVER.with(|d| d.borrow().is_some())
}

fn reap() {
    DRIVER.with(|d| {
        let mut guard = d.borrow_mut();
        let Some(driver) = guard.as_mut() else { return };
        let mut wake = Vec::new();
        for cqe in driver.ring.completion() {
            let key = cqe.user_data() as usize;
            match driver.slots.get_mut(key).and_then(Option::take) {
                Some(Slot::Waiting(waker)) => {
                    driver.slots[key] = Some(Slot::Done(cqe.result()));
                    if let Some(w) = waker {
                        wake.push(w);
                    }
                }
                Some(Slot::Orphaned(_resources, close_result)) => {
                    if close_result && cqe.result() >= 0 {
                        // SAFETY: the kernel opened this descriptor for a caller that
                        // is gone; nobody else holds it.
                        unsafe { libc::close(cqe.result()) };
                    }
                    driver.free.push(key);
                }
                Some(Slot::Done(_)) | None => {
                    tracing::error!(key, "io_uring completion for an unknown operation");
                }
            }
        }
        drop(guard);
        for w in wake {
            w.wake();
        }
    });
}

/// An operation in flight on this thread's ring, holding `T` until it completes.
pub(crate) struct Op<T: 'static> {
    key: usize,
    resources: Option<T>,
    thread: ThreadId,
    /// The result is a new file descriptor to close if the future is dropped.
    returns_fd: bool,
}

/// Submits `entry`, which must reference only memory owned by `resources`.
///
/// # Safety
/// Every pointer in `entry` must stay valid while `resources` lives.
pub(crate) unsafe fn submit<T: 'static>(
    entry: squeue::Entry,
    resources: T,
) -> std::io::Result<Op<T>> {
    // SAFETY: forwarded from the caller.
    unsafe { submit_inner(entry, resources, false) }
}

/// Like `submit`, for operations whose result is a new descriptor (openat): a
/// descriptor whose future was dropped is closed when it arrives.
///
/// # Safety
/// As for `submit`.
pub(crate) unsafe fn submit_open<T: 'static>(
    entry: squeue::Entry,
    resources: T,
) -> std::io::Result<Op<T>> {
    // SAFETY: forwarded from the caller.
    unsafe { submit_inner(entry, resources, true) }
}

unsafe fn submit_inner<T: 'static>(
    entry: squeue::Entry,
    resources: T,
    returns_fd: bool,
) -> std::io::Result<Op<T>> {
    DRIVER.with(|d| {
        let mut guard = d.borrow_mut();
        let driver = guard.as_mut().expect("submit on a thread without io_uring");
        let key = match driver.free.pop() {
            Some(key) => key,
            None => {
                driver.slots.push(None);
                driver.slots.len() - 1
            }
        };
        driver.slots[key] = Some(Slot::Waiting(None));
        let entry = entry.user_data(key as u64);
        loop {
            // SAFETY: caller guarantees the entry's memory outlives the operation.
            let pushed = unsafe { driver.ring.submission().push(&entry) };
            if pushed.is_ok() {
                break;
            }
            // Queue full: hand what we have to the kernel and retry.
            if let Err(e) = driver.ring.submit() {
                driver.slots[key] = None;
                driver.free.push(key);
                return Err(e);
            }
        }
        if let Err(e) = driver.ring.submit() {
            // The entry may already be queued; keep the slot and resources as an orphan.
            driver.slots[key] = Some(Slot::Orphaned(Box::new(resources), returns_fd));
            return Err(e);
        }
        Ok(Op {
            key,
            resources: Some(resources),
            thread: std::thread::current().id(),
            returns_fd,
        })
    })
}

impl<T: 'static + Unpin> Future for Op<T> {
    type Output = (i32, T);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        assert_eq!(
            self.thread,
            std::thread::current().id(),
            "io_uring op polled on another thread"
        );
        let key = self.key;
        let done = DRIVER.with(|d| {
            let mut guard = d.borrow_mut();
            let driver = guard.as_mut().expect("driver");
            match &mut driver.slots[key] {
                Some(Slot::Done(res)) => {
                    let res = *res;
                    driver.slots[key] = None;
                    driver.free.push(key);
                    Some(res)
                }
                Some(Slot::Waiting(waker)) => {
                    *waker = Some(cx.waker().clone());
                    None
                }
                _ => unreachable!("op slot in a bad state"),
            }
        });
        match done {
            Some(res) => Poll::Ready((res, self.resources.take().expect("op resources"))),
            None => Poll::Pending,
        }
    }
}

impl<T: 'static> Drop for Op<T> {
    fn drop(&mut self) {
        let Some(resources) = self.resources.take() else {
            return;
        };
        let key = self.key;
        DRIVER.with(|d| {
            let mut guard = d.borrow_mut();
            let Some(driver) = guard.as_mut() else { return };
            match driver.slots[key].take() {
                Some(Slot::Done(res)) => {
                    if self.returns_fd && res >= 0 {
                        // Completed but never collected: close the descriptor.
                        // SAFETY: nobody else holds this freshly opened descriptor.
                        unsafe { libc::close(res) };
                    }
                    driver.free.push(key);
                }
                _ => driver.slots[key] = Some(Slot::Orphaned(Box::new(resources), self.returns_fd)),
            }
        });
    }
}

// SAFETY: an Op only touches its thread's ring, checked by the assert in poll; the
// value itself is an index plus owned resources.
unsafe impl<T: Send + 'static> Send for Op<T> {}
