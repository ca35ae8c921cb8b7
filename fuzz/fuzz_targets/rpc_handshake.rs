//! Arbitrary bytes opening a cluster RPC connection: never accepted without
//! the secret, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    tarn_cluster::rpc::fuzz::handshake(data);
});
