#!/usr/bin/env bash
# Builds what the GPU machine runs (it has no Rust toolchain): the `ringzero` binary with candle's
# CUDA backend (`ringzero train --device cuda`), and the kernels' CUDA test binary, stripped into
# .gpubin/ (an ignored folder to carry; `ringzero` compressed as ringzero.xz, see below).
#
#     bash scripts/build-gpu.sh
#
# candle-kernels compiles its CUDA sources to PTX with `nvcc` at build time: CUDA 13.0's compiler
# and headers come from PyPI (nvidia-cuda-nvcc and friends, into target/cu13), so the PTX is one
# the GPU machines' driver (580, CUDA 13.0) loads. candle-core asks cudarc to link the CUDA
# libraries at build time (`dynamic-linking`), which needs them here and cannot be combined with
# ringzero's `dynamic-loading` (cudarc refuses both); the build therefore patches a copy of
# candle-core whose manifest asks for dynamic loading of CUDA 13.0 instead, through
# `--config patch.crates-io...`, leaving the repository's manifests and lock file as they are.
# At run time cuBLAS and cuRAND load from the machine's CUDA (PyTorch's wheels carry them:
# scripts/nvrtc-path.sh puts them on LD_LIBRARY_PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
CANDLE_VERSION=0.11.1
cu=target/cu13
if [ ! -x "$cu/nvidia/cu13/bin/nvcc" ]; then
    python3 -m pip install -q --target "$cu" nvidia-cuda-nvcc==13.0.88 nvidia-cuda-runtime==13.0.96 \
        nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 'nvidia-cuda-cccl==13.0.*'
fi
export CUDA_ROOT=$PWD/$cu/nvidia/cu13 CUDA_PATH=$PWD/$cu/nvidia/cu13
export PATH=$CUDA_ROOT/bin:$PATH CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
# candle-kernels links its quantized-matmul library against libcudart.so (loaded at run time
# from the machine's CUDA): the wheel has only the versioned name.
ln -sf libcudart.so.13 "$CUDA_ROOT/lib/libcudart.so"
export LIBRARY_PATH=$CUDA_ROOT/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
# candle-core's source, from cargo's registry (fetched if need be), its cudarc features matched.
cargo fetch -q
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-core-$CANDLE_VERSION | head -1)
patched=target/candle-cuda/candle-core
rm -rf "$patched" && mkdir -p "$(dirname "$patched")" && cp -r "$src" "$patched"
python3 - "$patched/Cargo.toml" <<'PY'
import sys, re
p = sys.argv[1]; s = open(p).read()
s2 = s.replace('"cuda-version-from-build-system",\n', '"cuda-13000",\n').replace('"dynamic-linking",', '"dynamic-loading",')
assert s2 != s and '"dynamic-linking"' not in s2, "candle-core's cudarc features are not as expected"
open(p, "w").write(s2)
PY
# Without fat LTO: the GPU runs measure the device's work, and LTO over candle's crates would add
# minutes to a build on a 2-core machine (a session's time); the host path's own figures come
# from the ordinary release build.
export CARGO_PROFILE_RELEASE_LTO=${CARGO_PROFILE_RELEASE_LTO:-off}
export CARGO_PROFILE_RELEASE_CODEGEN_UNITS=${CARGO_PROFILE_RELEASE_CODEGEN_UNITS:-16}
# Its own target folder: the binary needs CUDA's runtime library to start, so the ordinary
# release build (target/release) stays the one that runs anywhere.
export CARGO_TARGET_DIR=$PWD/target/gpu
cp Cargo.lock target/candle-cuda/Cargo.lock.keep
trap 'cp target/candle-cuda/Cargo.lock.keep Cargo.lock' EXIT
cargo build --release -p ringzero-tools --features cuda \
    --config "patch.crates-io.candle-core.path=\"$patched\""
cargo test --release --no-run -p ringzero-kernels --test cuda
rm -rf .gpubin && mkdir -p .gpubin
cp "$CARGO_TARGET_DIR/release/ringzero" .gpubin/
for t in "$CARGO_TARGET_DIR"/release/deps/cuda-*; do
    [ -x "$t" ] && [ -f "$t" ] && cp "$t" .gpubin/
done
strip .gpubin/*
# candle's kernels (PTX and the quantized matmuls' sm_90 code) make the binary about 60 MB,
# near the device tool's 64 MiB for what travels: it goes compressed (about 8 MB), and
# `xz -d .gpubin/ringzero.xz` (or Python's lzma) restores it there.
xz -T0 -f .gpubin/ringzero
ls -l .gpubin
