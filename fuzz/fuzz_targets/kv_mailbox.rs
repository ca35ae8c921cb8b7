//! Arbitrary bytes in a shared-memory mailbox's request area: the server must
//! answer with one well-formed response frame, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tarn_kv::fuzz::mailbox(data);
});
