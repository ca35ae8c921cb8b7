//! The local-read protocol's frames (short-circuit reads): any bytes decode
//! to a message or an error, and a decoded message encodes to the same
//! bytes. The same property runs in the test suite
//! (`tarn_wire::local` tests, with proptest).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tarn_wire::local::Msg;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = Msg::decode(data) {
        assert_eq!(&m.encode()[4..], data);
    }
});
