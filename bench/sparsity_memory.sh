#!/usr/bin/env bash
# KV memory actually in use over a generation (issue 4): `kvserve generate
# --json` reports the KV bytes in use after every forward pass. Full
# attention grows with the text; evicting policies level off at their budget
# (plus at most one block of evicted slots awaiting compaction); sinks keeps
# going past the model's 512-token context.
# usage: bench/sparsity_memory.sh OUT_DIR [BUDGET]
# Writes OUT_DIR/sparsity_memory.md and OUT_DIR/sparsity_memory.png.
set -euo pipefail
out=${1:?output dir}; budget=${2:-64}
root=$(cd "$(dirname "$0")/.." && pwd)
kvserve=$root/build/kvserve
model=$root/models/stories260K.gguf
mkdir -p "$out"
runs=(
  "full|512|--kv-policy full"
  "window $budget|512|--kv-policy window --kv-budget $budget"
  "h2o $budget|512|--kv-policy h2o --kv-budget $budget"
  "snapkv $budget|512|--kv-policy snapkv --kv-budget $budget"
  "h2o $budget, int4 KV|512|--kv-policy h2o --kv-budget $budget --kv-preset int4"
  "sinks $budget|2048|--kv-policy sinks --kv-budget $budget"
)
dat=$out/sparsity_memory.dat
: > "$dat"
echo "| run | forward passes | KV bytes in use: peak | at pass 100 | at pass 500 | at the end | tokens evicted |" > "$out/sparsity_memory.md"
echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |" >> "$out/sparsity_memory.md"
for r in "${runs[@]}"; do
  IFS='|' read -r name tokens flags <<< "$r"
  # shellcheck disable=SC2086
  "$kvserve" generate --model "$model" --prompt "Once upon a time" --max-tokens "$tokens" --temperature 0 \
      --ignore-eos --threads 1 $flags --json |
    python3 -c '
import json, sys
j = json.load(sys.stdin); h = j["kv_bytes_used_history"]; name = sys.argv[1]
with open(sys.argv[2], "a") as dat:
    dat.write(f"# {name}\n" + "".join(f"{i + 1} {b}\n" for i, b in enumerate(h)) + "\n\n")
at = lambda i: str(h[i - 1]) if len(h) >= i else "—"
peak, evicted = j["kv_bytes_used_peak"], j["kv_tokens_evicted"]
print(f"| {name} | {len(h)} | {peak} | {at(100)} | {at(500)} | {h[-1]} | {evicted} |")
' "$name" "$dat" >> "$out/sparsity_memory.md"
done
plots=""
for ((i = 0; i < ${#runs[@]}; ++i)); do
  plots+="${plots:+, }\"$dat\" index $i using 1:(\$2/1024) with steps lw 2 title \"${runs[$i]%%|*}\""
done
gnuplot <<GP
set terminal pngcairo size 1000,600 font ",10" noenhanced
set output "$out/sparsity_memory.png"
set title "KV bytes in use during generation (stories260K, greedy, budget $budget)"
set xlabel "forward pass (prompt prefill, then one per generated token)"
set ylabel "KV bytes in use (KiB)"
set grid
set key top left
set arrow from 512, graph 0 to 512, graph 1 nohead dt 2
set label "model context length" at 520, graph 0.95
plot $plots
GP
cat "$out/sparsity_memory.md"
