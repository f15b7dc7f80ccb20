#!/usr/bin/env bash
# Builds kvserve for AVX2 machines (-march=haswell: no AVX-512, so the AVX2 and
# portable kernels are compiled instead of the AVX-512 ones) into build-avx2/
# and runs every test against that build. Where this CPU has AVX-VNNI (Intel
# since Alder Lake, AMD since Zen 4), it does the same for AVX2 with AVX-VNNI
# (build-avx2-vnni/: the 256-bit vpdpbusd/vpdpwssd kernels that native builds
# on such AVX2 machines compile). Last, AVX-512 without VNNI (Skylake-SP:
# build-avx512-novnni/), whose integer paths and 256-bit interleaved matmul
# no other build compiles. CI runs it after scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install_deps.sh
# Whether binary $1's disassembly matches $2. grep reads a file, not a pipe:
# `objdump | grep -q` stops reading at the first match, objdump dies of
# SIGPIPE, and pipefail makes a match look like a failure.
disassembly=$(mktemp)
trap 'rm -f "$disassembly"' EXIT
disassembly_has() {
  objdump -d "$1" > "$disassembly"
  grep -q "$2" "$disassembly"
}
cmake -S . -B build-avx2 -DCMAKE_BUILD_TYPE=Release -DKVSERVE_NATIVE=OFF -DCMAKE_CXX_FLAGS="-march=haswell" > /dev/null
cmake --build build-avx2 -j"$(nproc)"
if disassembly_has build-avx2/kvserve zmm; then
  echo "build-avx2/kvserve uses AVX-512 registers" >&2
  exit 1
fi
ctest --test-dir build-avx2 --output-on-failure -j"$(nproc)"

if grep -qw avx_vnni /proc/cpuinfo; then
  cmake -S . -B build-avx2-vnni -DCMAKE_BUILD_TYPE=Release -DKVSERVE_NATIVE=OFF \
    -DCMAKE_CXX_FLAGS="-march=haswell -mavxvnni" > /dev/null
  cmake --build build-avx2-vnni -j"$(nproc)"
  if disassembly_has build-avx2-vnni/kvserve zmm || ! disassembly_has build-avx2-vnni/kvserve vpdpbusd; then
    echo "build-avx2-vnni/kvserve: expected AVX-VNNI on 256-bit registers and no AVX-512" >&2
    exit 1
  fi
  ctest --test-dir build-avx2-vnni --output-on-failure -j"$(nproc)"
else
  echo "no AVX-VNNI on this CPU: build-avx2-vnni skipped"
fi

if grep -qw avx512bw /proc/cpuinfo; then
  cmake -S . -B build-avx512-novnni -DCMAKE_BUILD_TYPE=Release -DKVSERVE_NATIVE=OFF \
    -DCMAKE_CXX_FLAGS="-march=skylake-avx512" > /dev/null
  cmake --build build-avx512-novnni -j"$(nproc)"
  if ! disassembly_has build-avx512-novnni/kvserve zmm || disassembly_has build-avx512-novnni/kvserve vpdpbusd; then
    echo "build-avx512-novnni/kvserve: expected AVX-512 registers and no VNNI" >&2
    exit 1
  fi
  ctest --test-dir build-avx512-novnni --output-on-failure -j"$(nproc)"
else
  echo "no AVX-512 on this CPU: build-avx512-novnni skipped"
fi
