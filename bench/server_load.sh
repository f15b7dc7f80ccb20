#!/usr/bin/env bash
# Load-tests `kvserve serve` with `kvserve bench --server`: for each
# concurrency, one JSON line of throughput, TTFT/TPOT percentiles, status
# counts and lost requests; then SIGTERM, which must exit 0.
# usage: bench/server_load.sh MODEL "CONCURRENCIES" REQUESTS_PER_CLIENT PROMPT_TOKENS MAX_TOKENS [serve flags...]
#   e.g. bench/server_load.sh models/stories260K.gguf "1 4 16" 8 64 128 --threads 2 --max-num-seqs 16
# SHARED_PREFIX=N: the first N prompt tokens are the same in every request.
# REQUEST_RATE=R: open loop, R requests/s offered (concurrency is then the
# most in flight); default: closed loop.
# (from the project root, after scripts/build.sh)
set -euo pipefail
kvserve=${KVSERVE:-build/kvserve}
model=${1:?model}; concurrencies=${2:?concurrencies}; per_client=${3:?requests per client}
prompt=${4:?prompt tokens}; max_tokens=${5:?max tokens}; shift 5
log=$(mktemp)
"$kvserve" serve --model "$model" --port 0 "$@" 2> "$log" &
server=$!
trap 'kill -TERM $server 2> /dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 600); do
  grep -q "listening on" "$log" && break
  kill -0 $server 2> /dev/null || { cat "$log" >&2; exit 1; }
  sleep 0.1
done
url=$(grep -o 'http://[^ ]*' "$log" | tail -1)
for c in $concurrencies; do
  "$kvserve" bench --server "$url" --concurrency "$c" --requests $((c * per_client)) \
    --prompt-tokens "$prompt" --max-tokens "$max_tokens" --shared-prefix "${SHARED_PREFIX:-0}" \
    --request-rate "${REQUEST_RATE:-0}" --json
done
kill -TERM $server
wait $server || { echo "kvserve serve exited $? after SIGTERM" >&2; cat "$log" >&2; exit 1; }
grep -o 'stopped after.*' "$log" >&2
