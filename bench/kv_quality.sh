#!/usr/bin/env bash
# Quality of KV configurations on the real model (stories260K): perplexity,
# change vs FP32 KV, KL divergence and top-1 agreement against an FP32-KV pass
# over the same chunks, and exact KV bytes per token. Prints a markdown table.
# usage: bench/kv_quality.sh TEXT CHUNKS [THREADS]  (run from the project root, after scripts/build.sh)
set -euo pipefail
kvserve=${KVSERVE:-build/kvserve}
text=${1:?text file}; chunks=${2:-100}; threads=${3:-2}
model=models/stories260K.gguf
calib_dir=${CALIB_DIR:-build/calib}
mkdir -p "$calib_dir"
train=../shared/data/tinystories_train_head.txt
# Calibration on TinyStories chunks 100+ (held out from the scored chunks 0-99).
if [ ! -f "$calib_dir/static.json" ]; then
  "$kvserve" calibrate --model $model --data $train --skip-chunks 100 --chunks 16 --out "$calib_dir/static.json" >&2
  for bits in 3 2.5; do
    "$kvserve" calibrate --model $model --data $train --skip-chunks 100 --chunks 16 --kv-bits $bits \
      --kv-scales dynamic --kv-k-grouping channel --kv-k-pre-rope --kv-residual 32 \
      --out "$calib_dir/mixed_$bits.json" >&2
  done
fi
configs=(
  "fp16|--kv-dtype fp16"
  "bf16|--kv-dtype bf16"
  "fp8 (E4M3)|--kv-dtype fp8"
  "fp8 keys, fp16 values|--kv-k fp8 --kv-v fp16"
  "fp16 keys, fp8 values|--kv-k fp16 --kv-v fp8"
  "fp8_e5m2|--kv-dtype fp8_e5m2"
  "fp8_e5m2 keys, fp16 values|--kv-k fp8_e5m2 --kv-v fp16"
  "fp16 keys, fp8_e5m2 values|--kv-k fp16 --kv-v fp8_e5m2"
  "int8 keys, fp8_e5m2 values|--kv-k int8 --kv-v fp8_e5m2"
  "int8 per-token (g=head)|--kv-dtype int8 --kv-residual 0"
  "int8 static (calibrated)|--kv-dtype int8 --kv-calibration $calib_dir/static.json --kv-residual 0"
  "q4_0 (llama.cpp scheme)|--kv-dtype q4_0 --kv-residual 0"
  "int4 per-token (g=head), no residual|--kv-dtype int4 --kv-residual 0"
  "int4 per-token (g=head), residual 16|--kv-dtype int4"
  "int4 static (calibrated), residual 16|--kv-dtype int4 --kv-calibration $calib_dir/static.json"
  "int4 K-channel / V-token, residual 16 (KIVI)|--kv-dtype int4 --kv-k-grouping channel"
  "int4 KIVI + pre-RoPE keys, residual 16|--kv-dtype int4 --kv-k-grouping channel --kv-k-pre-rope"
  "int4 KIVI + pre-RoPE keys, residual 32|--kv-dtype int4 --kv-k-grouping channel --kv-k-pre-rope --kv-residual 32"
  "int2 KIVI, residual 16|--kv-dtype int2 --kv-k-grouping channel"
  "int2 KIVI + pre-RoPE, residual 16|--kv-dtype int2 --kv-k-grouping channel --kv-k-pre-rope"
  "int2 KIVI + pre-RoPE, residual 32|--kv-dtype int2 --kv-k-grouping channel --kv-k-pre-rope --kv-residual 32"
  "int2 per-token, no residual|--kv-dtype int2 --kv-residual 0"
  "mixed, 3 bits (calibrate --kv-bits 3)|--kv-calibration $calib_dir/mixed_3.json --kv-scales dynamic --kv-k-grouping channel --kv-k-pre-rope --kv-residual 32"
  "mixed, 2.5 bits (calibrate --kv-bits 2.5)|--kv-calibration $calib_dir/mixed_2.5.json --kv-scales dynamic --kv-k-grouping channel --kv-k-pre-rope --kv-residual 32"
  "preset int8|--kv-preset int8"
  "preset int4|--kv-preset int4"
  "preset int2|--kv-preset int2"
  "preset int4-small|--kv-preset int4-small"
  "preset int2-small|--kv-preset int2-small"
  "int4-small in 32-token blocks, residual 64 (the preset before the tenth session)|--kv-preset int4-small --block-size 32 --kv-residual 64"
  "int4-small in 32-token blocks, residual 128 (the preset's window)|--kv-preset int4-small --block-size 32 --kv-residual 128"
  "int2-small in 32-token blocks, residual 64 (the preset before the tenth session)|--kv-preset int2-small --block-size 32 --kv-residual 64"
  "preset int4-small + 1 key outlier|--kv-preset int4-small --kv-k-outliers 1"
  "preset int2 + 1 key outlier|--kv-preset int2 --kv-k-outliers 1"
  "preset int2-small + 1 key outlier|--kv-preset int2-small --kv-k-outliers 1"
)
echo "| configuration | PPL | ΔPPL vs FP32 | KL | top-1 | KV bytes/token |"
echo "| --- | ---: | ---: | ---: | ---: | ---: |"
for entry in "${configs[@]}"; do
  label=${entry%%|*}; flags=${entry#*|}
  # shellcheck disable=SC2086
  "$kvserve" perplexity --model $model --file "$text" --ctx 512 --chunks "$chunks" --threads "$threads" \
    --kl-divergence --json $flags 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin); print("| %s | %.4f | %+.3f%% | %.5f | %.4f | %d |" % (sys.argv[1], j["ppl"], j["delta_ppl_pct"], j["kl_divergence"], j["top1_agreement"], j["kv_bytes_per_token"]))' "$label"
done
