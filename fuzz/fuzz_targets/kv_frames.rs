//! Arbitrary bytes on an authenticated KV server connection: the server must
//! answer with well-formed frames or close, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tarn_kv::fuzz::frames(data);
});
