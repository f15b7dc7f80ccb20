#!/usr/bin/env bash
# Installs the Debian packages kvserve builds against, when any is missing.
set -euo pipefail
packages=(cmake g++ make pkg-config libgtest-dev libbenchmark-dev nlohmann-json3-dev libcli11-dev
          libfmt-dev libicu-dev libxxhash-dev libssl-dev libcpp-httplib-dev libhiredis-dev redis-server
          libhnswlib-dev libfaiss-dev libopenblas-dev liblapack-dev ccache)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}"
fi
