#!/usr/bin/env python3
"""`kvserve serve` and its shutdown signals, end to end on the real binary.

A first SIGTERM or SIGINT drains: the server prints that it drains, lets the
running request finish and exits 0. A second signal during the drain prints
"kvserve: second signal: exiting now" and exits 1 at once. The signal must
reach kvserve's handler whichever thread the kernel picks: OpenBLAS starts
its worker threads before main, and a second signal delivered to one of them
used to kill the process (status 143 or 130, no message). Each case runs a
few times, since the kernel's choice of thread varies.

SIGINT inherited as ignored (how a shell starts a background job) still
drains: a server is stopped with kill -INT as with kill -TERM.

usage: serve_signals_test.py KVSERVE WORKDIR
"""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

KVSERVE, WORKDIR = sys.argv[1], sys.argv[2]
ROUNDS = 5


def synth_model():
    # A model slow enough that a long request is still running when the
    # signals come (stories260K generates its whole context in milliseconds);
    # no vocabulary, so prompts are token ids.
    os.makedirs(WORKDIR, exist_ok=True)
    path = os.path.join(WORKDIR, "signals_model.gguf")
    if not os.path.exists(path):
        subprocess.run([KVSERVE, "synth", "--out", path, "--dim", "512", "--layers", "8", "--heads", "8",
                        "--kv-heads", "4", "--ffn", "1536", "--vocab", "512", "--ctx", "2048"],
                       check=True, capture_output=True)
    return path


class Server:
    def __init__(self, model, ignore_sigint=False):
        def ignore():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.proc = subprocess.Popen(
            [KVSERVE, "serve", "--model", model, "--port", "0", "--threads", "1", "--max-num-seqs", "2",
             "--kv-memory", "64MiB", "--drain-timeout", "60"],
            stderr=subprocess.PIPE, text=True, preexec_fn=ignore if ignore_sigint else None)
        self.lines = []
        self.cv = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        line = self.wait_for("listening on")
        self.port = int(re.search(r":(\d+)$", line.strip()).group(1))

    def _read(self):
        for line in self.proc.stderr:
            with self.cv:
                self.lines.append(line)
                self.cv.notify_all()

    def wait_for(self, text, timeout=30):
        with self.cv:
            ok = self.cv.wait_for(lambda: any(text in l for l in self.lines) or self.proc.poll() is not None,
                                  timeout)
            for l in self.lines:
                if text in l:
                    return l
        raise AssertionError(f"no '{text}' on stderr (ok={ok}): {''.join(self.lines)}")

    def stderr(self):
        with self.cv:
            return "".join(self.lines)

    def exit_status(self, timeout=20):
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError("the server did not exit: " + self.stderr())


def start_stream(port, max_tokens):
    """A streamed completion, once its first chunk has arrived (it runs)."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(30)
    body = json.dumps({"model": "signals_model", "prompt": [1], "max_tokens": max_tokens, "ignore_eos": True,
                       "temperature": 0, "stream": True})
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
    got = b""
    while b"data: " not in got:
        chunk = s.recv(4096)
        if not chunk:
            raise AssertionError("the stream ended before its first chunk: " + got.decode(errors="replace"))
        got += chunk
    return s


def read_all(s):
    out = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    s.close()
    return out


def second_signal_exits_1(model, sig):
    srv = Server(model)
    client = start_stream(srv.port, 2000)
    srv.proc.send_signal(sig)
    srv.wait_for("draining")
    srv.proc.send_signal(sig)
    rc = srv.exit_status()
    read_all(client)
    assert rc == 1, f"{signal.Signals(sig).name} twice: exit status {rc}, want 1; stderr:\n{srv.stderr()}"
    assert "kvserve: second signal: exiting now" in srv.stderr(), srv.stderr()


def one_signal_drains(model, sig, ignore_sigint=False):
    srv = Server(model, ignore_sigint)
    client = start_stream(srv.port, 40)
    srv.proc.send_signal(sig)
    rc = srv.exit_status()
    body = read_all(client)
    assert rc == 0, f"{signal.Signals(sig).name}: exit status {rc}, want 0; stderr:\n{srv.stderr()}"
    assert b"data: [DONE]" in body, body[-300:]
    assert "draining running requests" in srv.stderr() and "stopped after 1 requests" in srv.stderr(), srv.stderr()


def main():
    model = synth_model()
    for sig in (signal.SIGTERM, signal.SIGINT):
        one_signal_drains(model, sig)
        for _ in range(ROUNDS):
            second_signal_exits_1(model, sig)
    one_signal_drains(model, signal.SIGINT, ignore_sigint=True)
    print("ok")


if __name__ == "__main__":
    main()
