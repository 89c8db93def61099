//! A checkpoint's `meta.json`: parsed, its fields checked and its layout rebuilt.
#![no_main]
use libfuzzer_sys::fuzz_target;
use ringzero_zero::checkpoint::Meta;

fuzz_target!(|data: &[u8]| {
    if let Ok(meta) = serde_json::from_slice::<Meta>(data) {
        let _ = meta.partition();
    }
});
