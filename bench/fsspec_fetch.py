"""The first load of an S3 prefix (moto's S3 server, in its own process on loopback): wall time of
`load` over 1,002 small objects, downloading one at a time (`concurrency: 1`, the fetch path as it
was before the option) against several at once, in the same run.

Each load starts from an empty project folder (no item cache, no index state): every object is
listed and downloaded. A store on loopback answers in about no time, so each setting is also
measured through a proxy that holds every request `--latency-ms` before passing it on (a remote
store's round trip). Runs alternate between the settings, `--repeat` times each; the table shows
the median.

    python bench/fsspec_fetch.py [--objects 1002] [--concurrency 1,16] [--latency-ms 0,20] [--repeat 2]
                                 [--no-readme]
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import publish, save

from ragline.flows.context import StepContext
from ragline.tasks.ingest.load import Params, load

KEY_ID, SECRET = "AKIABENCHFETCHKEY01", "bench-secret-value"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_moto() -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = Path(sys.executable).with_name("moto_server")
    process = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"{url}/moto-api/", timeout=2).close()
            return process, url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise SystemExit("moto_server did not start") from None
            time.sleep(0.1)


class Delay:
    """A loopback TCP proxy that holds each request ``seconds`` before passing it on."""

    def __init__(self, target: tuple[str, int], seconds: float):
        self.target, self.seconds = target, seconds
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, server, self.seconds), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, 0.0), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, seconds: float) -> None:
        try:
            while data := src.recv(65536):
                if seconds:
                    time.sleep(seconds)
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    def close(self) -> None:
        self.listener.close()


def fill(url: str, objects: int) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=url, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
                          region_name="us-east-1")
    client.create_bucket(Bucket="docs")
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda n: client.put_object(Bucket="docs", Key=f"bulk/{n:04d}.txt",
                                                  Body=f"Note {n}: the quarterly review of item {n}.\n".encode()),
                      range(objects)))
    client.put_object(Bucket="docs", Key="warm/0.txt", Body=b"Warm-up.\n")


def first_load(url: str, concurrency: int, prefix: str = "bulk") -> tuple[float, int, int]:
    spec = {"type": "fsspec", "url": f"s3://docs/{prefix}/", "concurrency": concurrency,
            "options": {"endpoint_url": url}, "secrets": {"key": "BENCH_S3_KEY_ID", "secret": "BENCH_S3_SECRET"}}
    with tempfile.TemporaryDirectory() as base:
        ctx = StepContext(pipeline="bench", step_id="load", base_dir=base)
        started = time.perf_counter()
        documents = load.fn(params=Params(paths=[spec]), ctx=ctx)
        return time.perf_counter() - started, len(documents), len(ctx.failures)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objects", type=int, default=1002)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--latency-ms", default="0,20")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    settings = [int(c) for c in args.concurrency.split(",")]
    latencies = [float(ms) for ms in args.latency_ms.split(",")]
    os.environ.update(BENCH_S3_KEY_ID=KEY_ID, BENCH_S3_SECRET=SECRET, AWS_DEFAULT_REGION="us-east-1")
    process, url = start_moto()
    host, port = url.rsplit("//", 1)[1].split(":")
    proxies = {ms: Delay((host, int(port)), ms / 1000) for ms in latencies if ms}
    try:
        fill(url, args.objects)
        first_load(url, 1, "warm")  # imports and the first connection, outside the timings
        times: dict[tuple[float, int], list[float]] = {(ms, c): [] for ms in latencies for c in settings}
        for _ in range(args.repeat):
            for ms, concurrency in times:
                through = f"http://127.0.0.1:{proxies[ms].port}" if ms else url
                seconds, documents, failures = first_load(through, concurrency)
                if (documents, failures) != (args.objects, 0):
                    raise SystemExit(f"concurrency {concurrency}: {documents} documents, {failures} failures")
                times[ms, concurrency].append(seconds)
                print(f"latency {ms:g} ms, concurrency {concurrency}: {seconds:.2f} s", file=sys.stderr)
    finally:
        for proxy in proxies.values():
            proxy.close()
        process.kill()
        process.wait()
    rows, payload = [], {"objects": args.objects, "repeat": args.repeat, "cores": os.cpu_count(), "runs": []}
    for (ms, concurrency), seconds in times.items():
        median, base = statistics.median(seconds), statistics.median(times[ms, settings[0]])
        payload["runs"].append({"latency_ms": ms, "concurrency": concurrency, "seconds": [round(t, 3) for t in seconds],
                                "median": round(median, 3)})
        rows.append(f"| {ms:g} ms | {concurrency} | {median:.2f} s | {args.objects / median:.0f} | "
                    f"{base / median:.1f}x |")
    save("fsspec_fetch", payload)
    publish("fsspec_fetch", [f"{args.objects} objects on moto's S3 server (loopback, its own process), "
                             f"{os.cpu_count()} cores; median of {args.repeat} first loads each.", "",
                             f"| added latency per request | concurrency | first load | objects/s | "
                             f"speed-up over {settings[0]} |", "|---|---|---|---|---|", *rows],
            readme=not args.no_readme)


if __name__ == "__main__":
    main()
