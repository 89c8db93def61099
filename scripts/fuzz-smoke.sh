#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for SECONDS each (default 15): the parsers of what
# arrives from outside (a frame header, a handshake, store requests, meta.json, the launcher
# environment) must not crash. A crash fails the script and leaves its input under
# fuzz/artifacts/. Needs a nightly toolchain and cargo-fuzz (installed from crates.io if
# missing); without them it prints SKIPPED and succeeds (tests/no_panic.rs runs the same inputs'
# kinds as property tests in every `cargo test`).
# Usage: scripts/fuzz-smoke.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs=${1:-15}
if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "fuzz-smoke: SKIPPED (no nightly toolchain: rustup toolchain install nightly)"
    exit 0
fi
if ! cargo fuzz --version >/dev/null 2>&1 && ! cargo install cargo-fuzz --locked >/dev/null 2>&1; then
    echo "fuzz-smoke: SKIPPED (cargo-fuzz could not be installed)"
    exit 0
fi
cargo +nightly fuzz build -O
for t in $(cargo +nightly fuzz list); do
    echo "fuzz-smoke: $t for ${secs}s"
    cargo +nightly fuzz run -O "$t" -- -max_total_time="$secs" 2>&1 | grep -E "^Done|ERROR|panicked" || true
    if [ -n "$(ls -A "artifacts/$t" 2>/dev/null)" ]; then
        echo "fuzz-smoke: $t crashed; inputs in fuzz/artifacts/$t"
        exit 1
    fi
done
echo "fuzz-smoke: every target ran ${secs}s without a crash"
