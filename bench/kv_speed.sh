#!/usr/bin/env bash
# Decode speed at long context per KV configuration on a (random-weight) model:
# the context is filled with random K/V (--fill-context; speed does not depend
# on the values), then a short prompt is prefilled and tokens decoded. Reports
# decode tok/s, the ratio to FP16 in the same run, and the fraction of the
# measured memory bandwidth the whole decode step (weights + KV) reaches.
# usage: bench/kv_speed.sh MODEL [THREADS]   (from the project root, after scripts/build.sh)
#   PRESETS="fp16 int4" and CONTEXTS="16384" narrow the grid (the first preset is the baseline).
set -euo pipefail
kvserve=${KVSERVE:-build/kvserve}
model=${1:?model}; threads=${2:-2}
echo "| context | KV | KV bytes/token | decode tok/s | vs FP16 | bytes read/token (MB) | bandwidth fraction |"
echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: |"
for ctx in ${CONTEXTS:-512 4096 16384}; do
  fp16_rate=""
  for preset in ${PRESETS:-fp16 int8 int4 int4-small int2 int2-small}; do
    json=$("$kvserve" bench --model "$model" --threads "$threads" --kv-preset $preset --fill-context $((ctx - 16)) \
      --prompt-tokens 16 --gen-tokens 16 --json 2>/dev/null)
    rate=$(echo "$json" | python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tok_s"])')
    [ -z "$fp16_rate" ] && fp16_rate=$rate
    echo "$json" | python3 -c 'import json,sys
j=json.load(sys.stdin); ctx, preset, base = sys.argv[1], sys.argv[2], float(sys.argv[3])
print("| %s | %s | %d | %.2f | %.2f× | %.0f | %.0f%% |" % (ctx, preset, j["kv_bytes_per_token"], j["decode_tok_s"],
      j["decode_tok_s"] / base, j["decode_bytes_per_token"] / 1e6, 100 * j["bandwidth_fraction"]))' "$ctx" "$preset" "$fp16_rate"
  done
done
