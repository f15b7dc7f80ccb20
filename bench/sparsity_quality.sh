#!/usr/bin/env bash
# Quality vs KV budget for every sparsity policy (issue 4): streaming
# perplexity (token by token, so early evictions affect later predictions)
# on stories260K, ctx 512, against full attention over the same chunks, with
# FP32 KV and with the INT4 preset.
# usage: bench/sparsity_quality.sh TEXT CHUNKS OUT_DIR [JOBS]
# Writes OUT_DIR/sparsity_quality.tsv (kv, config, budget, ppl, delta %,
# tokens kept, read fraction), OUT_DIR/sparsity_quality.md (tables) and
# OUT_DIR/sparsity_quality.png.
set -euo pipefail
text=${1:?text file}; chunks=${2:?chunks}; out=${3:?output dir}; jobs=${4:-2}
root=$(cd "$(dirname "$0")/.." && pwd)
kvserve=$root/build/kvserve
model=$root/models/stories260K.gguf
mkdir -p "$out"
budgets="16 32 64 128"
# name|flags, with B = the budget, H = 3B/2 (horizon), W = B/2, O = min(8, B/2)
configs=(
  "window|--kv-policy window --kv-budget B"
  "sinks|--kv-policy sinks --kv-budget B"
  "h2o|--kv-policy h2o --kv-budget B"
  "h2o tuned|--kv-policy h2o --kv-budget B --kv-score mean --kv-value-norm --kv-horizon H"
  "snapkv|--kv-policy snapkv --kv-budget B"
  "snapkv tuned|--kv-policy snapkv --kv-budget B --kv-window W --kv-observe O --kv-value-norm --kv-horizon H"
  "topk|--kv-policy topk --kv-budget B"
  "ann|--kv-policy ann --kv-budget B"
)
jobfile=$(mktemp)
trap 'rm -f "$jobfile"' EXIT
for kv in fp32 int4; do
  echo "$kv|full|0|--kv-policy full" >> "$jobfile"
  for b in $budgets; do
    for c in "${configs[@]}"; do
      name=${c%%|*}; flags=${c#*|}
      o=$((b / 2 < 8 ? b / 2 : 8))
      flags=${flags//B/$b}; flags=${flags//H/$((3 * b / 2))}; flags=${flags//W/$((b / 2))}; flags=${flags//O/$o}
      echo "$kv|$name|$b|$flags" >> "$jobfile"
    done
  done
done
run_one() {
  IFS='|' read -r kv name budget flags <<< "$1"
  # shellcheck disable=SC2086
  "$kvserve" perplexity --model "$model" --file "$text" --ctx 512 --chunks "$chunks" --threads 1 \
      --kv-preset "$kv" --streaming $flags --json 2>/dev/null |
    python3 -c 'import json,sys; j=json.load(sys.stdin); print("\t".join([sys.argv[1], sys.argv[2], sys.argv[3], "%.5f" % j["ppl"], "%.2f" % j["kv_tokens_kept_mean"], "%.4f" % j["kv_read_fraction"]]))' \
      "$kv" "$name" "$budget"
}
export -f run_one
export kvserve model text chunks
raw=$(mktemp)
tr '\n' '\0' < "$jobfile" | xargs -0 -P "$jobs" -I{} bash -c 'run_one "$@"' _ {} > "$raw"
# Add ΔPPL vs full of the same KV type; write the TSV, the tables and the plot.
python3 - "$raw" "$out" "$budgets" <<'PY'
import sys, collections
raw, out, budgets = sys.argv[1], sys.argv[2], [int(b) for b in sys.argv[3].split()]
rows = [l.rstrip('\n').split('\t') for l in open(raw) if l.strip()]
full = {r[0]: float(r[3]) for r in rows if r[1] == 'full'}
order = ['window', 'sinks', 'h2o', 'h2o tuned', 'snapkv', 'snapkv tuned', 'topk', 'ann']
cell = collections.defaultdict(dict)
with open(f'{out}/sparsity_quality.tsv', 'w') as tsv:
    tsv.write('kv\tconfig\tbudget\tppl\tdelta_pct\tkept_mean\tread_fraction\n')
    for kv, name, b, ppl, kept, read in sorted(rows, key=lambda r: (r[0], r[1], int(r[2]))):
        d = (float(ppl) / full[kv] - 1) * 100
        tsv.write(f'{kv}\t{name}\t{b}\t{ppl}\t{d:.3f}\t{kept}\t{read}\n')
        if name != 'full':
            cell[kv][(name, int(b))] = (d, float(ppl), float(read))
with open(f'{out}/sparsity_quality.md', 'w') as md:
    for kv in ['fp32', 'int4']:
        md.write(f'\n{kv.upper()} KV (full attention, streaming: PPL {full[kv]:.4f}); ΔPPL vs full, PPL in brackets'
                 ' (read-time policies: fraction of kept keys read)\n\n')
        md.write('| policy | ' + ' | '.join(f'budget {b}' for b in budgets) + ' |\n')
        md.write('| --- |' + ' ---: |' * len(budgets) + '\n')
        for name in order:
            cells = []
            for b in budgets:
                d, ppl, read = cell[kv][(name, b)]
                extra = f', read {read:.2f}' if name in ('topk', 'ann') else ''
                cells.append(f'{d:+.2f}% ({ppl:.3f}{extra})')
            md.write(f'| {name} | ' + ' | '.join(cells) + ' |\n')
with open(f'{out}/sparsity_quality.dat', 'w') as dat:
    for kv in ['fp32', 'int4']:
        for name in order:
            dat.write(f'# {kv} {name}\n')
            for b in budgets:
                dat.write(f'{b} {cell[kv][(name, b)][0]:.4f}\n')
            dat.write('\n\n')
PY
gnuplot <<GP
set terminal pngcairo size 1200,650 font ",10" noenhanced
set output "$out/sparsity_quality.png"
set multiplot layout 1,2 title "stories260K, ctx 512, streaming perplexity: ΔPPL vs full attention"
set logscale x 2
set xtics (16, 32, 64, 128)
set xrange [14:146]
set xlabel "KV budget (tokens per layer and KV head)"
set ylabel "ΔPPL vs full (%)"
set grid
set yrange [-6:30]
set key top right font ",8"
names = "window sinks h2o h2o-tuned snapkv snapkv-tuned topk ann"
set title "FP32 KV"
plot for [i=0:7] "$out/sparsity_quality.dat" index i using 1:2 with linespoints lw 2 pt 7 title word(names, i + 1)
set title "INT4 KV (preset int4)"
plot for [i=8:15] "$out/sparsity_quality.dat" index i using 1:2 with linespoints lw 2 pt 7 title word(names, i - 7)
unset multiplot
GP
cat "$out/sparsity_quality.md"
