#!/usr/bin/env python3
"""Prefix caching, tenant isolation, pinning, KV-budget concurrency and tiers,
measured through the engine (`kvserve bench --workload`), each comparison made
of runs in one invocation so its ratios share the machine's conditions.

usage: bench/serving_workloads.py SMALL_MODEL BIG_MODEL [PART ...]
  parts: shared (issue 5: 64 requests sharing a 384-token prompt, cache off/on,
         on both models), tenants (issue 5: cross-tenant hits by scope),
         hotburst (issue 5: pinned vs unpinned hot prompt), aware (issue 6:
         prefix-aware scheduling on/off), budget (issue 6:
         sequences running in 256 MiB, FP16 without sharing vs INT4 with it),
         returning (issue 7: returning conversations, memory only vs tiers),
         replay (what a preemption costs: recomputed tokens with the prefix
         cache off, on, and on over a host tier)
  (from the project root, after scripts/build.sh). Prints markdown tables and
  the JSON of every run to stderr.
"""
import json
import subprocess
import sys
import tempfile

KVSERVE = "build/kvserve"


def run(model, *args):
    cmd = [KVSERVE, "bench", "--model", model, "--json", *map(str, args)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    j = json.loads(out)
    print(" ".join(cmd[1:]), "->", out.strip(), file=sys.stderr)
    return j


def shared(small, big):
    print("\n#### 64 requests sharing a 384-token prompt (+32 own tokens, 16 generated), cache off vs on\n")
    print("| model | in flight | cache | prefill tokens computed | of the no-cache run | TTFT p50 ms | TTFT p99 ms | "
          "p50 speed-up | peak KV MB | hit rate |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, model, extra in (("stories260K", small, ["--threads", 1, "--kv-memory", "64MiB"]),
                               ("400M", big, ["--threads", 2, "--kv-memory", "1GiB", "--kv-preset", "fp16"])):
      for concurrency in (1, 4):
        base = ["--workload", "shared-prefix", "--requests", 64, "--prefix-tokens", 384, "--suffix-tokens", 32,
                "--max-tokens", 16, "--concurrency", concurrency, *extra]
        off = run(model, *base, "--prefix-cache", "off")
        on = run(model, *base, "--prefix-cache", "on")
        for label, j in (("off", off), ("on", on)):
            print("| %s | %d | %s | %d | %.1f%% | %.1f | %.1f | %.1f× | %.2f | %.1f%% |" % (
                name, concurrency, label, j["prefill_tokens_computed"],
                100 * j["prefill_tokens_computed"] / off["prefill_tokens_computed"], j["ttft_p50_ms"],
                j["ttft_p99_ms"], off["ttft_p50_ms"] / j["ttft_p50_ms"], j["kv_bytes_peak"] / 1e6,
                100 * j["prefix_hit_rate"]))


def tenants(small, _big):
    print("\n#### 4 tenants sending the same 384-token system prompt (64 requests, concurrency 1)\n")
    print("| scope | cross-tenant cached tokens | hit rate within a tenant | overall hit rate | prefill computed |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for scope in ("global", "tenant"):
        j = run(small, "--workload", "shared-prefix", "--requests", 64, "--tenants", 4, "--same-prompt", "true",
                "--prefix-tokens", 384, "--suffix-tokens", 32, "--max-tokens", 16, "--concurrency", 1,
                "--threads", 1, "--kv-memory", "64MiB", "--prefix-scope", scope)
        print("| %s | %d | %.2f%% | %.2f%% | %d |" % (scope, j["cross_tenant_cached_tokens"],
                                                     100 * j["within_tenant_hit_rate"],
                                                     100 * j["prefix_hit_rate"], j["prefill_tokens_computed"]))


def hotburst(small, _big):
    print("\n#### A hot prompt among 10× more one-off tokens than the cache holds\n")
    print("| hot requests pin their prompt | hot prefix hit rate | blocks pinned | blocks evicted |")
    print("| --- | ---: | ---: | ---: |")
    for pin in ("false", "true"):
        j = run(small, "--workload", "hot-burst", "--requests", 400, "--hot-every", 10, "--prefix-tokens", 256,
                "--suffix-tokens", 16, "--max-tokens", 4, "--concurrency", 2, "--threads", 1, "--kv-blocks", 128,
                "--pin-hot", pin)
        print("| %s | %.1f%% | %d | %d |" % (pin, 100 * j["hot_hit_rate"], j["prefix_blocks_pinned"],
                                          j["prefix_blocks_evicted"]))


def aware(small, _big):
    print("\n#### Prefix-aware scheduling: 8 tenants' requests arriving 16 at a time (64 requests, 384-token "
          "prompts)\n")
    print("| prefix-aware | hit rate | prefill tokens computed | TTFT p50 ms | TTFT p99 ms | seconds |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for on in ("off", "on"):
        j = run(small, "--workload", "shared-prefix", "--requests", 64, "--tenants", 8, "--prefix-tokens", 384,
                "--suffix-tokens", 32, "--max-tokens", 16, "--concurrency", 16, "--threads", 1,
                "--kv-memory", "64MiB", "--prefix-aware", on)
        print("| %s | %.1f%% | %d | %.1f | %.1f | %.2f |" % (on, 100 * j["prefix_hit_rate"],
                                                           j["prefill_tokens_computed"], j["ttft_p50_ms"],
                                                           j["ttft_p99_ms"], j["seconds"]))


def budget(_small, big):
    print("\n#### Sequences running at once in a 256 MiB KV budget (400M, 128 requests sharing a 384-token "
          "prompt, all submitted at once)\n")
    print("| KV | sharing | KV bytes/token | most sequences running | vs FP16 without sharing | preemptions | "
          "failed | TTFT p99 ms | output tok/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    base = ["--workload", "shared-prefix", "--requests", 128, "--prefix-tokens", 384, "--suffix-tokens", 32,
            "--max-tokens", 16, "--concurrency", 128, "--max-num-seqs", 256, "--max-batch-prefill-tokens", 2048,
            "--kv-memory", "256MiB", "--threads", 2]
    first = None
    for preset, cache in (("fp16", "off"), ("fp16", "on"), ("int4", "off"), ("int4", "on")):
        j = run(big, *base, "--kv-preset", preset, "--prefix-cache", cache)
        first = first or j["max_running"]
        print("| %s | %s | %d | %d | %.1f× | %d | %d | %.0f | %.1f |" % (
            preset, cache, j["kv_bytes_per_token"], j["max_running"], j["max_running"] / first, j["preemptions"],
            j["failed"], j["ttft_p99_ms"], j["output_tok_s"]))


def returning(small, _big):
    print("\n#### Returning conversations: 8 conversations × 3 turns that come back after the others evicted them\n")
    print("| tiers | returning-turn hit rate | blocks loaded from tiers | prefill computed | TTFT p50 ms |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for spec in ("", "host:256MiB", "host:64KiB,disk:{}:256MiB", "disk:{}:256MiB"):
        with tempfile.TemporaryDirectory() as disk:  # each run starts with an empty disk tier
            tiers = spec.format(disk)
            extra = ["--kv-tiers", tiers] if tiers else []
            j = run(small, "--workload", "returning", "--requests", 24, "--turns", 3, "--prefix-tokens", 384,
                    "--suffix-tokens", 16, "--max-tokens", 16, "--concurrency", 2, "--threads", 1,
                    "--kv-memory", "1536KiB", *extra)
            label = (tiers or "memory only").replace(disk, "DIR")
            print("| %s | %.1f%% | %d | %d | %.1f |" % (label, 100 * j["returning_hit_rate"],
                                                       j.get("tier_blocks_loaded", 0),
                                                       j["prefill_tokens_computed"], j["ttft_p50_ms"]))


def replay(_small, big):
    print("\n#### Preemption replay: 16 requests with their own 256-token prompts, 128 generated, 40 MiB of FP16 KV\n")
    print("| prefix cache | tiers | preemptions | tokens recomputed after preemptions | blocks loaded from tiers | "
          "seconds | output tok/s | TTFT p50 s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for cache, tiers in (("off", ""), ("on", ""), ("on", "host:256MiB")):
        extra = ["--kv-tiers", tiers] if tiers else []
        # 16 tenants: every request has its own system prompt, so the only
        # hits are a preempted request finding its own blocks again.
        j = run(big, "--workload", "shared-prefix", "--requests", 16, "--tenants", 16, "--prefix-tokens", 192,
                "--suffix-tokens", 64, "--max-tokens", 128, "--concurrency", 16, "--max-num-seqs", 16,
                "--kv-memory", "40MiB", "--kv-preset", "fp16", "--threads", 2, "--prefix-cache", cache, *extra)
        recomputed = j["prefill_tokens_computed"] - (j["prompt_tokens"] - j["cached_tokens"])
        print("| %s | %s | %d | %d | %d | %.1f | %.1f | %.1f |" % (
            cache, tiers or "none", j["preemptions"], recomputed, j.get("tier_blocks_loaded", 0), j["seconds"],
            j["output_tok_s"], j["ttft_p50_ms"] / 1e3))


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    small, big = sys.argv[1], sys.argv[2]
    parts = sys.argv[3:] or ["shared", "tenants", "hotburst", "aware", "budget", "returning", "replay"]
    for p in parts:
        {"shared": shared, "tenants": tenants, "hotburst": hotburst, "aware": aware, "budget": budget,
         "returning": returning, "replay": replay}[p](small, big)
        sys.stdout.flush()


if __name__ == "__main__":
    main()
