#!/usr/bin/env bash
# Tier throughput and latency (bench/store_bench.cpp) with a real Redis: starts
# redis-server on a free loopback port (no persistence), runs
# build/store_bench against it and the host and disk tiers, and stops it.
# usage: bench/store_bench.sh [store_bench flags...]   (from the project root, after building store_bench)
set -euo pipefail
bench=${STORE_BENCH:-build/store_bench}
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
dir=$(mktemp -d)
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no --dir "$dir" \
  --logfile "$dir/redis.log" &
redis_pid=$!
trap 'kill $redis_pid 2>/dev/null; wait $redis_pid 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do redis-cli -p "$port" ping > /dev/null 2>&1 && break; sleep 0.05; done
"$bench" --redis="127.0.0.1:$port" "$@"
