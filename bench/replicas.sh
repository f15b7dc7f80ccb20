#!/usr/bin/env bash
# N `kvserve serve` replicas sharing one Redis (issue 7): replica 0 computes a
# prompt of PREFIX+16 tokens; then every other replica serves the same prompt
# and loads the prefix's KV blocks from Redis instead of computing them.
# Prints one JSON line per replica (the load tool's report: TTFT, cached
# tokens) and the ratio of replica 0's TTFT to each other's.
# usage: bench/replicas.sh MODEL PREFIX_TOKENS REPLICAS [serve flags...]
#   e.g. bench/replicas.sh /tmp/m400.gguf 2048 3 --threads 2 --kv-dtype fp16
# (from the project root, after scripts/build.sh; needs redis-server)
set -euo pipefail
kvserve=${KVSERVE:-build/kvserve}
model=${1:?model}; prefix=${2:?prefix tokens}; replicas=${3:?replicas}; shift 3
work=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -TERM "$p" 2> /dev/null || true; done
  wait 2> /dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

redis_port=$(( 20000 + RANDOM % 10000 ))
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --dir "$work" \
  --logfile "$work/redis.log" --maxmemory 4gb --daemonize no &
pids+=($!)
for _ in $(seq 100); do redis-cli -p "$redis_port" ping > /dev/null 2>&1 && break; sleep 0.1; done
# Every replica salts tenant caches with the same secret, so one tenant's
# blocks have the same keys everywhere (and other tenants' never match).
head -c 32 /dev/urandom > "$work/secret"

urls=()
for i in $(seq 0 $((replicas - 1))); do
  "$kvserve" serve --model "$model" --port 0 --kv-tiers "redis://127.0.0.1:$redis_port" \
    --tenant-secret-file "$work/secret" "$@" 2> "$work/serve$i.log" &
  pids+=($!)
  for _ in $(seq 1200); do
    grep -q "listening on" "$work/serve$i.log" && break
    kill -0 "${pids[-1]}" 2> /dev/null || { cat "$work/serve$i.log" >&2; exit 1; }
    sleep 0.1
  done
  urls+=("$(grep -o 'http://[^ ]*' "$work/serve$i.log" | tail -1)")
done

run() {  # one request of PREFIX+16 tokens (the same tokens on every replica)
  "$kvserve" bench --server "$1" --requests 1 --concurrency 1 --prompt-tokens $((prefix + 16)) \
    --shared-prefix "$prefix" --max-tokens 4 --json
}
first=$(run "${urls[0]}")
echo "$first"
ttft0=$(echo "$first" | python3 -c 'import json,sys; print(json.load(sys.stdin)["ttft"]["p50_ms"])')
# Replica 0's blocks reach Redis off its engine thread: wait (up to 30 s)
# until its tier writer has none queued and has written some.
for _ in $(seq 300); do
  m=$(curl -s "${urls[0]}/metrics")
  queued=$(echo "$m" | awk '$1 == "kvserve_kv_store_queued_blocks" {print $2}')
  written=$(echo "$m" | awk '$1 == "kvserve_kv_store_written_total" {print $2}')
  [ "${queued:-1}" = 0 ] && [ "${written:-0}" != 0 ] && break
  sleep 0.1
done
for i in $(seq 1 $((replicas - 1))); do
  out=$(run "${urls[$i]}")
  echo "$out"
  echo "$out" | python3 -c "import json,sys; r=json.load(sys.stdin); t=r['ttft']['p50_ms']; \
print(f'replica $i: TTFT {t:.1f} ms vs {float($ttft0):.1f} ms computing it on replica 0: {float($ttft0)/t:.1f}x lower, \
{r[\"cached_tokens\"]} of {r[\"prompt_tokens\"]} prompt tokens loaded')"
done
for i in $(seq 0 $((replicas - 1))); do
  curl -s "${urls[$i]}/metrics" | grep -E '^kvserve_tier_blocks_(loaded|written)_total' | sed "s/^/replica $i: /"
done
