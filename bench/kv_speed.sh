#!/usr/bin/env bash
# Decode speed at long context per KV configuration on a (random-weight) model:
# the context is filled with random K/V (--fill-context; speed does not depend
# on the values), then a short prompt is prefilled and tokens decoded. Reports
# decode tok/s (from the median step time), the speed ratio to the first
# preset, and the fraction of the measured memory bandwidth the whole decode
# step (weights + KV) reaches at that rate.
# The ratio comes from one process that decodes both configurations with their
# steps alternating (kvserve bench --compare-preset): the median step times'
# ratio, which the host's load swings between separate runs do not reach.
# "bytes bound" is the ratio the two steps' bytes allow (weights + KV read per
# token, baseline over this): the speedup if both read at the same bandwidth.
# Contexts above the model's own need a model built for them, e.g.
#   build/kvserve synth --out /tmp/m400_64k.gguf --dim 1536 --layers 12 --heads 24 --kv-heads 8 \
#     --ffn 4096 --vocab 32000 --ctx 65600 --weights q8_0
# usage: bench/kv_speed.sh MODEL [THREADS]   (from the project root, after scripts/build.sh)
#   PRESETS="fp16 int4" and CONTEXTS="16384" narrow the grid (the first preset is the baseline);
#   GEN_TOKENS (default 32) sets the decode steps per configuration.
set -euo pipefail
kvserve=${KVSERVE:-build/kvserve}
model=${1:?model}; threads=${2:-2}
gen=${GEN_TOKENS:-32}
presets=(${PRESETS:-fp16 int8 int4 int4-small int2 int2-small})
baseline=${presets[0]}
echo "| context | KV | KV bytes/token | decode tok/s (median step) | vs $baseline (same run) | bytes bound | $baseline tok/s (same run) | bytes read/token (MB) | bandwidth fraction |"
echo "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
for ctx in ${CONTEXTS:-512 4096 16384}; do
  fill=$((ctx - 16 - gen))
  [ "$fill" -ge 0 ] || { echo "context $ctx is shorter than 16 prompt + $gen decoded tokens" >&2; exit 1; }
  for preset in "${presets[@]}"; do
    compare=()
    [ "$preset" != "$baseline" ] && compare=(--compare-preset "$baseline")
    "$kvserve" bench --model "$model" --threads "$threads" --kv-preset "$preset" "${compare[@]}" \
      --fill-context "$fill" --prompt-tokens 16 --gen-tokens "$gen" --json |
      python3 -c 'import json,sys
j=json.load(sys.stdin); ctx, preset = sys.argv[1], sys.argv[2]
rate = 1e3 / j["decode_step_ms_median"]
ratio = "%.2f×" % j["decode_speedup"] if "decode_speedup" in j else "1.00×"
bound = "%.2f×" % j["bytes_bound_speedup"] if "bytes_bound_speedup" in j else "1.00×"
base = 1e3 / j["compare_decode_step_ms_median"] if "compare_decode_step_ms_median" in j else rate
# the bandwidth fraction at the median step rate (the JSON field uses the mean)
fraction = j["bandwidth_fraction"] * rate / j["decode_tok_s"]
print("| %s | %s | %d | %.2f | %s | %s | %.2f | %.0f | %.0f%% |" % (ctx, preset, j["kv_bytes_per_token"], rate, ratio, bound, base,
      j["decode_bytes_per_token"] / 1e6, 100 * fraction))' "$ctx" "$preset"
  done
done
