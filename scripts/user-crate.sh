#!/usr/bin/env bash
# Builds the README's first program (a candle GPT), examples/zero_mlp.rs and
# candle/examples/llama2_c.rs (a candle-transformers model) as a crate of their own that depends on
# this checkout by path, as a user's crate does (so they may name only the public API of `ringzero`
# and `ringzero-candle`), then runs the README's program on 2 ranks, and the Llama at stages 0
# and 3 from the same initial weights. CI runs it after the tests; it needs
# `target/release/ringzero` (the README's main command builds it).
# Usage: scripts/user-crate.sh [DIR]   (DIR: where the crate is written; a temporary one if not)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$(mktemp -d)}
mkdir -p "$dir/src/bin"
cat > "$dir/Cargo.toml" <<TOML
[package]
name = "ringzero-user-check"
version = "0.0.0"
edition = "2021"
publish = false

[dependencies]
ringzero = { path = "$root" }
ringzero-candle = { path = "$root/candle" }
candle-core = "0.11.1"
candle-nn = "0.11.1"
candle-transformers = "0.11.1"

[workspace]
TOML
# The README's first Rust block is its trainer program.
awk '/^```rust/ { inside = 1; next } /^```/ { if (inside) exit } inside' "$root/README.md" \
    > "$dir/src/main.rs"
cp "$root/examples/zero_mlp.rs" "$dir/src/bin/zero_mlp.rs"
cp "$root/candle/examples/llama2_c.rs" "$dir/src/bin/llama2_c.rs"
cp "$root/Cargo.lock" "$dir/Cargo.lock"
# The checkout's target directory: the registry crates are built once for both.
export CARGO_TARGET_DIR="$root/target"
cargo build --release --manifest-path "$dir/Cargo.toml"
out=$("$root/target/release/ringzero" launch -n 2 -- "$root/target/release/ringzero-user-check")
echo "$out"
# The README's GPT learns: its last reported loss is well under the untrained ≈3.7.
echo "$out" | python3 -c '
import re, sys
losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", sys.stdin.read())]
ok = len(losses) == 4 and losses[-1] < 1.5
sys.exit(0 if ok else "user-crate: the README GPT did not learn (losses %s)" % losses)
'
# candle-transformers' Llama trains unchanged, and stages 0 and 3 print the same losses, bit for bit.
init="$dir/llama-init.safetensors"
rm -f "$init"
for stage in 0 3; do
    "$root/target/release/ringzero" launch -n 2 -- "$root/target/release/llama2_c" --stage $stage \
        --init "$init" | grep 'loss' > "$dir/llama-stage$stage.txt"
done
cat "$dir/llama-stage3.txt"
cmp "$dir/llama-stage0.txt" "$dir/llama-stage3.txt" ||
    { echo "user-crate: the Llama's losses differ between stages 0 and 3"; exit 1; }
python3 -c '
import re, sys
losses = [float(v) for v in re.findall(r"loss ([0-9.]+)", open(sys.argv[1]).read())]
ok = len(losses) == 20 and losses[-1] < min(3.0, losses[0] - 0.5)
sys.exit(0 if ok else "user-crate: the Llama did not learn (losses %s)" % losses)
' "$dir/llama-stage3.txt"
echo "user-crate: the README program, examples/zero_mlp.rs and the candle-transformers Llama build as a crate of their own"
