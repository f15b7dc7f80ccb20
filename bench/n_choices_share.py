#!/usr/bin/env python3
# One completion request with n = 8 choices over a 363-token prompt against a
# running `kvserve serve` on PORT: prints the usage, the wall time and the
# server's KV peak and prefill counters (run once with --prefix-cache on,
# once off, each on a fresh server).
# usage: bench/n_choices_share.py PORT
import json, os, sys, time, urllib.request
port = int(sys.argv[1])
text = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), '..', '..', 'shared', 'data', 'tinystories_train_head.txt')).read()[:800]
def post(body):
    r = urllib.request.Request(f'http://127.0.0.1:{port}/v1/completions', data=json.dumps(body).encode())
    return json.load(urllib.request.urlopen(r))
def metric(name):
    m = urllib.request.urlopen(f'http://127.0.0.1:{port}/metrics').read().decode()
    return [l for l in m.splitlines() if l.startswith(name)]
t = time.time()
r = post({"model": "stories260K", "prompt": text, "max_tokens": 32, "n": 8, "seed": 1, "ignore_eos": True})
dt = time.time() - t
print("usage", r["usage"], "seconds %.2f" % dt)
print(metric("kvserve_kv_bytes_peak"), metric("kvserve_prompt_tokens_total"), metric("kvserve_prompt_tokens_cached_total"), metric("kvserve_prefill_tokens"))
