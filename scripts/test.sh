#!/usr/bin/env bash
# Builds kvserve and runs every test (unit tests and CLI end-to-end checks).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
ctest --test-dir build --output-on-failure -j"$(nproc)"
