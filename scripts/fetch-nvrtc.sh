#!/usr/bin/env bash
# Fetch NVRTC (CUDA 13) from PyPI into target/nvrtc, so the kernel sources are compiled by the tests
# on machines without a CUDA toolkit or GPU. Prints the library folder; exits non-zero (and the
# NVRTC tests print SKIPPED) if pip or the registry is unavailable.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=target/nvrtc
if [ ! -f "$dir/nvidia/cu13/lib/libnvrtc.so.13" ]; then
    mkdir -p "$dir"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$dir" 'nvidia-cuda-nvrtc>=13,<14' >&2
    python3 -m zipfile -e "$dir"/nvidia_cuda_nvrtc-*.whl "$dir" >&2
fi
echo "$PWD/$dir/nvidia/cu13/lib"
