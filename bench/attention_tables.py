#!/usr/bin/env python3
"""Markdown tables from `kvserve bench --attention-only --json` results.

usage: bench/attention_tables.py detail N_KEYS HEAD_DIM RESULTS.json...
       bench/attention_tables.py targets RESULTS.json...

detail:  every configuration at one context and head dim, per workload.
targets: per workload, context and head dim, the fastest ann setting with
         recall@k >= 0.9 while attending <= 10% of keys and comparing the
         queries against <= 10% (graph neighbours, PQ codes), and the fastest topk
         setting with output error <= 5% (the issue's targets), with their
         speedup over full attention timed beside them.
"""
import json
import sys


def load(files):
    rows = []
    for f in files:
        rows += [r for r in json.load(open(f))["rows"] if "skipped" not in r]
    return rows


def fmt_row(r):
    idx = f'{r["index_recall_at_k"]:.3f}' if "index_recall_at_k" in r else "—"
    build = f'{r["build_s"]:.2f}' if "build_s" in r else "—"
    append = f'{r["append_us_per_key"]:.1f}' if "append_us_per_key" in r else "—"
    scanned = f'{r["index_scanned_fraction"]:.4f}' if "index_scanned_fraction" in r else "—"
    cand = f' → {r["candidates"]}' if r["method"] == "ivfpq" else ""
    return (f'| {r["method"]} | `{r["config"]}`{cand} | {r["recall_at_k"]:.3f} | {idx} | {r["output_rel_error_mean"]:.2e} | '
            f'{r["keys_scored_fraction"]:.4f} | {scanned} | {r["step_us"]:.0f} | {r["full_step_us"]:.0f} | '
            f'{r["speedup_vs_full"]:.1f}× | {build} | {append} |')


def detail(n_keys, head_dim, rows):
    for w in ("real", "fit", "synthetic"):
        sel = [r for r in rows if r["workload"] == w and r["n_keys"] == n_keys and r["head_dim"] == head_dim
               and r["group"] == 1]
        if not sel:
            continue
        print(f"\n{w}, {n_keys} keys, head dim {head_dim}:\n")
        print("| method | config | recall@32 | index recall@32 | output rel. error | keys attended | index scanned "
              "| µs/step | full µs/step | speedup | build s | append µs/key |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in sel:
            print(fmt_row(r))


def targets(rows):
    print("| workload | keys | head dim | full µs/step | ann: best setting (recall ≥ 0.9, ≤ 10% attended and ≤ 10% scanned) | recall@32 "
          "| error | speedup | topk: best setting (error ≤ 5%) | recall@32 | error | speedup |")
    print("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |")
    keys = sorted({(r["workload"], r["n_keys"], r["head_dim"]) for r in rows if r["group"] == 1},
                  key=lambda k: (("real", "fit", "synthetic").index(k[0]), k[2], k[1]))
    for w, n, d in keys:
        sel = [r for r in rows if (r["workload"], r["n_keys"], r["head_dim"]) == (w, n, d) and r["group"] == 1]
        full = next(r for r in sel if r["method"] == "full")
        ann = [r for r in sel if r["method"] in ("hnsw", "ivfpq") and r["recall_at_k"] >= 0.9
               and r["keys_scored_fraction"] <= 0.10 and r["index_scanned_fraction"] <= 0.10]
        topk = [r for r in sel if r["method"] == "topk" and r["output_rel_error_mean"] <= 0.05]
        cells = [w, str(n), str(d), f'{full["step_us"]:.0f}']
        for best in (max(ann, key=lambda r: r["speedup_vs_full"], default=None),
                     max(topk, key=lambda r: r["speedup_vs_full"], default=None)):
            if best is None:
                cells += ["none", "—", "—", "—"]
            else:
                cand = f' → {best["candidates"]}' if best["method"] == "ivfpq" else ""
                cells += [f'`{best["config"]}`{cand}', f'{best["recall_at_k"]:.3f}',
                          f'{best["output_rel_error_mean"]:.1e}', f'{best["speedup_vs_full"]:.1f}×']
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "detail":
        detail(int(sys.argv[2]), int(sys.argv[3]), load(sys.argv[4:]))
    elif len(sys.argv) >= 3 and sys.argv[1] == "targets":
        targets(load(sys.argv[2:]))
    else:
        sys.exit(__doc__)
