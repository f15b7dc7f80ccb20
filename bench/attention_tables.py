#!/usr/bin/env python3
"""Markdown tables from `kvserve bench --attention-only --json` results.

usage: bench/attention_tables.py detail|detail-gqa N_KEYS HEAD_DIM RESULTS.json[:NAME]...
       bench/attention_tables.py targets RESULTS.json[:NAME]...

detail:  every configuration at one context and head dim, per workload.
Times are µs per step, "wall / CPU" when the run recorded the thread's CPU
time; speedups likewise.
targets: per workload, context and head dim, the fastest ann setting with
         recall@k >= 0.9 while attending <= 10% of keys and comparing the
         queries against <= 10% (graph neighbours, PQ codes) (the issue's
         target), the fastest that also keeps the output error <= 5%, and the
         fastest topk setting with output error <= 5%, with their speedup over
         full attention timed beside them (CPU time when recorded).
"""
import json
import sys


WORKLOADS = ["real", "fit", "synthetic"]


def load(files):
    """Rows of every file; FILE:NAME renames that file's "real" workload to
    NAME (e.g. a dump of another text), listed after the others."""
    rows = []
    for f in files:
        path, _, name = f.partition(":")
        for r in json.load(open(path))["rows"]:
            if "skipped" in r:
                continue
            if name and r["workload"] == "real":
                r["workload"] = name
                if name not in WORKLOADS:
                    WORKLOADS.append(name)
            rows.append(r)
    return rows


def speedup(r):
    """Wall-clock speedup, and the CPU-time one when the run recorded it."""
    if "speedup_vs_full_cpu" in r:
        return f'{r["speedup_vs_full"]:.1f}× / {r["speedup_vs_full_cpu"]:.1f}×'
    return f'{r["speedup_vs_full"]:.1f}×'


def step(r):
    if "step_cpu_us" in r:
        return f'{r["step_us"]:.0f} / {r["step_cpu_us"]:.0f}'
    return f'{r["step_us"]:.0f}'


def full_step(r):
    if "full_step_cpu_us" in r:
        return f'{r["full_step_us"]:.0f} / {r["full_step_cpu_us"]:.0f}'
    return f'{r["full_step_us"]:.0f}'


def fmt_row(r):
    idx = f'{r["index_recall_at_k"]:.3f}' if "index_recall_at_k" in r else "—"
    build = f'{r["build_s"]:.2f}' if "build_s" in r else "—"
    append = f'{r["append_us_per_key"]:.1f}' if "append_us_per_key" in r else "—"
    scanned = f'{r["index_scanned_fraction"]:.4f}' if "index_scanned_fraction" in r else "—"
    cand = f' → {r["candidates"]}' if r["method"] == "ivfpq" else ""
    return (f'| {r["method"]} | `{r["config"]}`{cand} | {r["recall_at_k"]:.3f} | {idx} | {r["output_rel_error_mean"]:.2e} | '
            f'{r["keys_scored_fraction"]:.4f} | {scanned} | {step(r)} | {full_step(r)} | '
            f'{speedup(r)} | {build} | {append} |')


def detail(n_keys, head_dim, rows, group=1):
    for w in WORKLOADS:
        sel = [r for r in rows if r["workload"] == w and r["n_keys"] == n_keys and r["head_dim"] == head_dim
               and r["group"] == group]
        if not sel:
            continue
        print(f"\n{w}, {n_keys} keys, head dim {head_dim}, GQA group {group}:\n")
        print("| method | config | recall@32 | index recall@32 | output rel. error | keys attended | index scanned "
              "| µs/step | full µs/step | speedup | build s | append µs/key |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in sel:
            print(fmt_row(r))


def short(r):
    """A compact name for a setting: "hnsw ef=128", "ivfpq np=8→256", "quest 128 blk"."""
    c = r["config"]
    if r["method"] == "hnsw":
        return "hnsw ef=" + c.split("ef=")[1].split(")")[0] + ("" if r.get("transform") == "l2aug" else " ip")
    if r["method"] == "ivfpq":
        return "ivfpq np=" + c.split("nprobe=")[1].split(",")[0] + f'→{r["candidates"]}'
    if r["method"] == "topk":
        return "quest " + c.split("blocks=")[1].split(",")[0] + " blk" + ("" if c.endswith("max)") else " sum")
    return c


def targets(rows):
    print("| workload | keys | head dim | full µs/step | ann: recall@32 ≥ 0.9, ≤ 10% keys attended and scanned "
          "| recall / error / speedup | ann: also error ≤ 5% | recall / error / speedup "
          "| topk: error ≤ 5% | recall / error / speedup |")
    print("| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- | --- |")
    keys = sorted({(r["workload"], r["n_keys"], r["head_dim"]) for r in rows if r["group"] == 1},
                  key=lambda k: (WORKLOADS.index(k[0]), k[2], k[1]))
    for w, n, d in keys:
        sel = [r for r in rows if (r["workload"], r["n_keys"], r["head_dim"]) == (w, n, d) and r["group"] == 1]
        full = next(r for r in sel if r["method"] == "full")
        ann = [r for r in sel if r["method"] in ("hnsw", "ivfpq") and r["recall_at_k"] >= 0.9
               and r["keys_scored_fraction"] <= 0.10 and r["index_scanned_fraction"] <= 0.10]
        accurate = [r for r in ann if r["output_rel_error_mean"] <= 0.05]
        topk = [r for r in sel if r["method"] == "topk" and r["output_rel_error_mean"] <= 0.05]
        cells = [w, str(n), str(d), step(full)]
        for group in (ann, accurate, topk):
            best = max(group, key=lambda r: r.get("speedup_vs_full_cpu", r["speedup_vs_full"]), default=None)
            if best is None:
                cells += ["none", "—"]
            else:
                cells += [short(best),
                          f'{best["recall_at_k"]:.3f} / {best["output_rel_error_mean"]:.0e} / {speedup(best)}']
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    if len(sys.argv) >= 5 and sys.argv[1] == "detail":
        detail(int(sys.argv[2]), int(sys.argv[3]), load(sys.argv[4:]))
    elif len(sys.argv) >= 5 and sys.argv[1] == "detail-gqa":
        detail(int(sys.argv[2]), int(sys.argv[3]), load(sys.argv[4:]), group=2)
    elif len(sys.argv) >= 3 and sys.argv[1] == "targets":
        targets(load(sys.argv[2:]))
    else:
        sys.exit(__doc__)
