#!/usr/bin/env bash
# Exact KV bytes per token (scales, zero points and layout included) per
# configuration, as the cache accounts them, and the ratio to FP16.
# usage: bench/kv_memory.sh MODEL [BLOCK_SIZE]   (from the project root, after scripts/build.sh)
#   BLOCK_SIZE (default 16) applies to the explicit configurations; the
#   preset rows are the presets as shipped, with their own block size.
set -euo pipefail
kvserve=${KVSERVE:-build/kvserve}
model=${1:?model}; bs=${2:-16}
bytes_of() {  # flags... -> kv_bytes_per_token; presets use their own block size (32 or 64)
  local block=(--block-size "$bs")
  [[ " $* " == *" --kv-preset "* ]] && block=()
  "$kvserve" inspect --model "$model" "${block[@]}" --json "$@" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["kv_bytes_per_token"])'
}
head_dim=$("$kvserve" inspect --model "$model" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["head_dim"])')
# Static scales need a calibration; its ranges do not change the byte count,
# so one short chunk is enough here.
calib=$(mktemp --suffix=.json)
trap 'rm -f "$calib"' EXIT
"$kvserve" calibrate --model "$model" --data ../shared/data/tinystories_train_head.txt --ctx 64 --chunks 1 \
  --out "$calib" > /dev/null 2>&1
configs=(
  "fp16|--kv-dtype fp16"
  "int8 per-token (g=head)|--kv-dtype int8"
  "int8 static|--kv-dtype int8 --kv-calibration $calib"
  "q4_0|--kv-dtype q4_0"
  "int4 per-token (g=head)|--kv-dtype int4"
  "int4 per-token (g=2 heads)|--kv-dtype int4 --kv-group $((2 * head_dim))"
  "int4 K-channel/V-token (KIVI)|--kv-dtype int4 --kv-k-grouping channel"
  "int4 static|--kv-dtype int4 --kv-calibration $calib"
  "int2 K-channel/V-token (KIVI)|--kv-dtype int2 --kv-k-grouping channel"
  "int2 static|--kv-dtype int2 --kv-calibration $calib"
  "preset int8|--kv-preset int8"
  "preset int4|--kv-preset int4"
  "preset int2|--kv-preset int2"
  "preset int4-small|--kv-preset int4-small"
  "preset int2-small|--kv-preset int2-small"
)
fp16=$(bytes_of --kv-dtype fp16)
echo "| configuration | KV bytes/token | vs FP16 |"
echo "| --- | ---: | ---: |"
for entry in "${configs[@]}"; do
  label=${entry%%|*}; flags=${entry#*|}
  # shellcheck disable=SC2086
  if bytes=$(bytes_of $flags 2>/dev/null); then
    python3 -c 'import sys; print("| %s | %s | %.3f× |" % (sys.argv[1], sys.argv[2], int(sys.argv[2]) / int(sys.argv[3])))' "$label" "$bytes" "$fp16"
  else
    echo "| $label | not valid for this shape | |"
  fi
done
