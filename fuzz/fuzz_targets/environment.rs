//! The launcher environment: `NAME=value` lines, read as ringzero reads its variables.
#![no_main]
use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use ringzero_collectives::Config;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let vars: HashMap<String, String> = text
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let _ = Config::from_lookup(&|k| vars.get(k).cloned());
});
