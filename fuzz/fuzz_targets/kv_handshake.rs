//! Arbitrary bytes on a KV connection that has not authenticated: the server
//! must answer only HELLO replies and error frames, well formed, and never
//! serve an operation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tarn_kv::fuzz::handshake(data);
});
