#!/usr/bin/env bash
# Plots the quality/bytes frontier (KL divergence vs KV bytes per token, one
# point per configuration) from a table written by bench/kv_quality.sh.
# usage: bench/plot_frontier.sh TABLE.md OUT.png "title"
set -euo pipefail
table=${1:?table}; out=${2:?png}; title=${3:-KV quality vs bytes}
data=$(mktemp)
trap 'rm -f "$data"' EXIT
# columns: bytes/token, KL, label (rows with KL 0 are drawn at 1e-7 on the log axis)
python3 - "$table" > "$data" <<'PY'
import sys
for line in open(sys.argv[1]):
    cells = [c.strip() for c in line.strip().strip('|').split('|')]
    if len(cells) != 6 or not cells[5].isdigit():
        continue
    kl = max(float(cells[3]), 1e-7)
    print(f'{cells[5]} {kl} "{cells[0]}"')
PY
gnuplot <<GP
set terminal pngcairo size 1100,700 font ",10" noenhanced
set output "$out"
set title "$title"
set xlabel "KV bytes per token (metadata included)"
set ylabel "mean KL divergence from FP32 KV (nats, log scale)"
set logscale y
set grid
set key off
plot "$data" using 1:2 with points pt 7 ps 1.3, \
     "$data" using 1:2:3 with labels offset char 1,0.5 left font ",8"
GP
echo "wrote $out"
