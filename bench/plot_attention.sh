#!/usr/bin/env bash
# Plots `kvserve bench --attention-only --json` results:
#   OUT_recall.png   recall@k against speedup over full attention, one panel
#                    per workload, at one context and head dim
#   OUT_context.png  time per decode step against context, full attention and
#                    one setting of each method, per workload
# Times and speedups are the thread's CPU time when the run recorded it, else
# wall clock (the titles say "CPU or wall").
# usage: bench/plot_attention.sh OUT_PREFIX N_KEYS HEAD_DIM RESULTS.json...
set -euo pipefail
out=${1:?out prefix}; n_keys=${2:?n_keys}; head_dim=${3:?head dim}; shift 3
data=$(mktemp -d)
trap 'rm -rf "$data"' EXIT
python3 - "$data" "$n_keys" "$head_dim" "$@" <<'PY'
import json, sys, collections
data, n_keys, head_dim, files = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
rows = []
for f in files:
    rows += [r for r in json.load(open(f))["rows"] if "skipped" not in r and r["group"] == 1]
# One setting per method for the context plot: the settings named here.
pick = {"full": "full", "topk": "quest(block=16,blocks=128,max)",
        "hnsw": "hnsw(M=16,efC=100,ef=128)/l2aug", "ivfpq": "ivfpq(nlist=256,nprobe=8,pq="}
for w in ("real", "fit", "synthetic"):
    with open(f"{data}/recall_{w}.tsv", "w") as o:
        for r in rows:
            if r["workload"] == w and r["n_keys"] == n_keys and r["head_dim"] == head_dim and r["method"] != "full" \
               and r.get("transform", "l2aug") == "l2aug" and "coarse" not in r["config"]:
                o.write(f'{r.get("speedup_vs_full_cpu", r["speedup_vs_full"])}\t{r["recall_at_k"]}\t{r["method"]}\n')
    for m, prefix in pick.items():
        pts = collections.OrderedDict()
        for r in sorted(rows, key=lambda r: r["n_keys"]):
            if r["workload"] == w and r["head_dim"] == head_dim and r["method"] == m and r["config"].startswith(prefix) \
               and (m != "ivfpq" or r["candidates"] == 256) and r["n_keys"] not in pts:
                pts[r["n_keys"]] = r.get("step_cpu_us", r["step_us"]) / 1000.0
        with open(f"{data}/ctx_{w}_{m}.tsv", "w") as o:
            for n, ms in pts.items():
                o.write(f"{n}\t{ms}\n")
PY
gnuplot <<GP
set terminal pngcairo size 1500,500 font ",10" noenhanced
set output "${out}_recall.png"
set multiplot layout 1,3 title "recall@32 vs speedup over full attention, ${n_keys} keys, head dim ${head_dim} (1 thread, caches flushed)"
set logscale x
set xlabel "speedup vs full attention (x, log; CPU time where recorded)"
set ylabel "recall@32 of the exact top-32 keys"
set yrange [0:1.05]
set grid
set key bottom left
do for [w in "real fit synthetic"] {
  set title w
  f = "$data/recall_".w.".tsv"
  plot f using 1:(stringcolumn(3) eq "topk" ? \$2 : 1/0) with points pt 7 ps 1.4 title "topk (Quest)", \
       f using 1:(stringcolumn(3) eq "hnsw" ? \$2 : 1/0) with points pt 5 ps 1.4 title "ann: HNSW", \
       f using 1:(stringcolumn(3) eq "ivfpq" ? \$2 : 1/0) with points pt 9 ps 1.6 title "ann: IVF-PQ"
}
unset multiplot
set output "${out}_context.png"
set multiplot layout 1,3 title "time per decode step (one KV head) vs context, head dim ${head_dim}"
set logscale xy
set xrange [12000:180000]
set xlabel "keys in context (log)"
set ylabel "ms per step (log; CPU time where recorded, else wall)"
set yrange [*:*]
set key top left
do for [w in "real fit synthetic"] {
  set title w
  plot "$data/ctx_".w."_full.tsv" using 1:2 with linespoints pt 7 title "full", \
       "$data/ctx_".w."_topk.tsv" using 1:2 with linespoints pt 7 title "topk 128 blocks", \
       "$data/ctx_".w."_hnsw.tsv" using 1:2 with linespoints pt 5 title "HNSW ef=128", \
       "$data/ctx_".w."_ivfpq.tsv" using 1:2 with linespoints pt 9 title "IVF-PQ nprobe 8, 256 cand."
}
unset multiplot
GP
echo "wrote ${out}_recall.png ${out}_context.png"
