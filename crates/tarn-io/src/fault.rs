//! A fail point for crash-consistency tests: after N more operations every disk
//! operation that checks it fails, as if the process had died at that instant.
//! Off (and one relaxed atomic load per operation) unless a test arms it.

use std::io;
use std::sync::atomic::{AtomicI64, Ordering};

/// Operations left before failing; negative means disarmed.
static REMAINING: AtomicI64 = AtomicI64::new(-1);

/// Fails every checked operation after `n` more succeed.
pub fn arm(n: u64) {
    REMAINING.store(n as i64, Ordering::SeqCst);
}

pub fn disarm() {
    REMAINING.store(-1, Ordering::SeqCst);
}

/// Counts one operation; an error once the budget is spent.
pub fn check(what: &'static str) -> io::Result<()> {
    if REMAINING.load(Ordering::Relaxed) < 0 {
        return Ok(());
    }
    let prev = REMAINING.fetch_sub(1, Ordering::SeqCst);
    if prev <= 0 {
        REMAINING.store(0, Ordering::SeqCst);
        return Err(io::Error::other(format!("injected fault before {what}")));
    }
    Ok(())
}
