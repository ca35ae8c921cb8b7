//! Arbitrary bytes from an authenticated cluster peer: the server answers
//! with well-formed frames or closes, and never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tarn_cluster::rpc::fuzz::frames(data);
});
