"""The CPU vLLM's dtype: bfloat16 against float32 for the packaged SmolLM2-135M-Instruct, on this
machine's CPU, same server script (deploy/vllm/serve.sh), same requests, interleaved.

CPUs without native bf16 arithmetic (no AVX-512 BF16 / AMX: most AVX2 machines) convert every bf16
weight and activation on the fly; float32 costs twice the memory (0.5 GB for this model) and may run
several times faster. This bench decides the serve.sh default from a measurement, not a guess.

Per dtype, one server (each started with serve.sh's own environment, e.g. VLLM_CPU_OMP_THREADS_BIND);
then ``--rounds`` rounds, each sending both servers the same request in alternating order: a fresh
~800-token prompt (a unique prefix defeats the prefix cache) with ``max_tokens`` 1 (prefill) and one
with 64 forced tokens (``ignore_eos``: decode). Prints medians, the ratio, and the CPU flags.

Usage: .venv/bin/python bench/vllm_dtype.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import time
import urllib.request
from pathlib import Path

from common import REPO, save

DTYPES = {"bfloat16": 8131, "float32": 8132}
FILLER = "The mitochondrion produces ATP through oxidative phosphorylation in the inner membrane. " * 50


def start(dtype: str, port: int, log: Path) -> subprocess.Popen:
    env = dict(os.environ, VLLM_PORT=str(port), VLLM_EXTRA_ARGS=f"--dtype {dtype} --enforce-eager")
    return subprocess.Popen(["bash", str(REPO / "deploy" / "vllm" / "serve.sh")], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(port: int, process: subprocess.Popen, limit: float = 900) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server on port {port} exited with {process.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5)
            return
        except OSError:
            time.sleep(3)
    raise RuntimeError(f"the server on port {port} was not ready in {limit} s")


def timed(port: int, prompt: str, tokens: int) -> float:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": tokens > 1}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=900) as response:
        usage = json.load(response)["usage"]
    assert usage["completion_tokens"] == tokens, usage
    return time.perf_counter() - started


def cpu_flags() -> list[str]:
    flags = next((ln.split(":", 1)[1].split() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("flags")), [])
    return sorted(f for f in flags if f in {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    logs = REPO / "bench" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    servers = {d: start(d, port, logs / f"vllm_{d}.log") for d, port in DTYPES.items()}
    try:
        for dtype, port in DTYPES.items():
            wait_ready(port, servers[dtype])
        times: dict[str, dict[str, list[float]]] = {d: {"prefill": [], "decode": []} for d in DTYPES}
        for n in range(args.rounds):
            order = list(DTYPES) if n % 2 == 0 else list(reversed(DTYPES))
            for kind, tokens in (("prefill", 1), ("decode", 64)):
                prompt = f"Note {n}-{kind}: {FILLER}\nSummarise the text above."
                for dtype in order:
                    times[dtype][kind].append(timed(DTYPES[dtype], prompt, tokens))
    finally:
        for process in servers.values():
            os.killpg(process.pid, signal.SIGTERM)
        for process in servers.values():
            process.wait(timeout=60)
    result = {"rounds": args.rounds, "cpu_flags": cpu_flags(), "load_average": os.getloadavg()[0],
              "median_s": {d: {k: round(statistics.median(v), 3) for k, v in t.items()} for d, t in times.items()}}
    for kind in ("prefill", "decode"):
        result[f"{kind}_bf16_over_fp32"] = round(result["median_s"]["bfloat16"][kind]
                                                 / result["median_s"]["float32"][kind], 2)
    save("vllm_dtype", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
