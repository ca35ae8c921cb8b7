//! The park/doorbell handshake of a mailbox (`mailbox.rs`): how one side
//! publishes a sequence word and how the other goes to sleep waiting for it
//! without missing it. Client and daemon both use these functions, and the
//! model-checking test (`tests/loom_park.rs`) compiles this very file against
//! loom's atomics and explores every interleaving of the two sides.
//!
//! It is an event count. The waiter stores its `parked` flag, issues a
//! sequentially consistent fence, then looks at the sequence once more; the
//! publisher stores the sequence, issues the same fence, then looks at the
//! flag. The two fences are ordered one way or the other, so at least one
//! side sees the other's store: either the waiter finds the new sequence and
//! does not sleep, or the publisher finds the flag and rings the doorbell.
//! A doorbell that arrives after its sleeper woke anyway is a spurious
//! wakeup, which the waiting loops tolerate by looking again.

use crate::sync::{fence, AtomicU32, AtomicU64, Ordering};

/// Publishes `value` in `seq`; true when the other side has parked (or is
/// about to) and must be woken with a doorbell.
pub fn publish(seq: &AtomicU64, value: u64, peer_parked: &AtomicU32) -> bool {
    seq.store(value, Ordering::Release);
    fence(Ordering::SeqCst);
    peer_parked.load(Ordering::Relaxed) != 0
}

/// Announces that this side is about to sleep, then checks `ready` once
/// more. True: still not ready, sleep until a doorbell (then call
/// [`unpark`]); false: ready after all, the flag is down again.
pub fn prepare_park(parked: &AtomicU32, ready: impl Fn() -> bool) -> bool {
    parked.store(1, Ordering::Relaxed);
    fence(Ordering::SeqCst);
    if ready() {
        parked.store(0, Ordering::Relaxed);
        return false;
    }
    true
}

/// Lowers the flag after a sleep (woken by a doorbell or not).
pub fn unpark(parked: &AtomicU32) {
    parked.store(0, Ordering::Relaxed);
}
