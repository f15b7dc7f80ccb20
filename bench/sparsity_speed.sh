#!/usr/bin/env bash
# Decode speed with and without sparsity policies (issue 4). Runs alternate
# between a baseline kvserve binary (e.g. built from the commit before the
# policies) and this tree's, several rounds, so the shared machine's noise
# hits both alike; reports each configuration's median and best decode tok/s
# (the best is the run least disturbed by other work).
# usage: bench/sparsity_speed.sh MODEL.gguf BASELINE_KVSERVE [ROUNDS] [PROMPT] [GEN]
set -euo pipefail
model=${1:?model}; base=${2:?baseline kvserve}; rounds=${3:-5}; prompt=${4:-2048}; gen=${5:-64}
root=$(cd "$(dirname "$0")/.." && pwd)
new=$root/build/kvserve
common=(bench --model "$model" --prompt-tokens "$prompt" --gen-tokens "$gen" --bandwidth-mib 64 --json)
declare -A runs=(
  ["baseline full"]="$base"
  ["full"]="$new"
  ["window 256"]="$new --kv-policy window --kv-budget 256"
  ["h2o 256"]="$new --kv-policy h2o --kv-budget 256"
  ["topk 256"]="$new --kv-policy topk --kv-budget 256"
)
order=("baseline full" "full" "window 256" "h2o 256" "topk 256")
declare -A speeds
for ((r = 0; r < rounds; ++r)); do
  for name in "${order[@]}"; do
    read -r -a cmd <<< "${runs[$name]}"
    bin=${cmd[0]}
    s=$("$bin" "${common[@]}" "${cmd[@]:1}" | python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tok_s"])')
    speeds[$name]+="$s "
  done
done
echo "| configuration | decode tok/s, median of $rounds | best | runs |"
echo "| --- | ---: | ---: | --- |"
for name in "${order[@]}"; do
  python3 -c 'import sys, statistics; v=[float(x) for x in sys.argv[2].split()]; print("| %s | %.1f | %.1f | %s |" % (sys.argv[1], statistics.median(v), max(v), " ".join("%.1f" % x for x in v)))' \
    "$name" "${speeds[$name]}"
done
