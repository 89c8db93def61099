//! A frame header as it arrives from a peer: decoded, and checked against an expectation.
#![no_main]
use libfuzzer_sys::fuzz_target;
use ringzero_collectives::internals::wire::{FrameHeader, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    let mut h = [0u8; HEADER_LEN];
    let n = data.len().min(HEADER_LEN);
    h[..n].copy_from_slice(&data[..n]);
    if let Ok(header) = FrameHeader::decode(&h) {
        let _ = header.is_abort();
    }
});
