#!/usr/bin/env bash
# Builds kvserve for AVX2 machines (-march=haswell: no AVX-512, so the AVX2 and
# portable kernels are compiled instead of the AVX-512 ones) into build-avx2/
# and runs every test against that build. CI runs it after scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
cmake -S . -B build-avx2 -DCMAKE_BUILD_TYPE=Release -DKVSERVE_NATIVE=OFF -DCMAKE_CXX_FLAGS="-march=haswell" > /dev/null
cmake --build build-avx2 -j"$(nproc)"
if objdump -d build-avx2/kvserve | grep -q zmm; then
  echo "build-avx2/kvserve uses AVX-512 registers" >&2
  exit 1
fi
ctest --test-dir build-avx2 --output-on-failure -j"$(nproc)"
