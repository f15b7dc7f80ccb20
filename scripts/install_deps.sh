#!/usr/bin/env bash
# Installs the Debian packages kvserve builds against, when any is missing,
# and the npm package of the server's OpenAI client test.
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

# The official OpenAI Node.js client for the server's end-to-end test
# (tests/server, CTest server.openai_node), pinned by its package-lock.json.
node_tests="$(cd "$(dirname "$0")/.." && pwd)/tests/server"
if command -v npm > /dev/null; then
  if [ ! -f "$node_tests/node_modules/openai/package.json" ] ||
     [ "$node_tests/package-lock.json" -nt "$node_tests/node_modules/.package-lock.json" ]; then
    echo "installing the openai npm package into tests/server/node_modules"
    npm ci --prefix "$node_tests" --no-audit --no-fund --loglevel=error
  fi
else
  echo "npm not found: the OpenAI client test (server.openai_node) needs Node.js and npm" >&2
fi
