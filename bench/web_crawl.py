"""A `web` root crawling a local mirror twice: how many requests of the second, unchanged crawl were
answered 304, and its wall time against the first.

The mirror is a static HTML folder served by Python's own static file server on loopback (it answers
If-Modified-Since with 304; it sends no ETag). By default Debian's Node.js API docs
(/usr/share/doc/nodejs/api), else valgrind's HTML manual, else samples/docs.

    python bench/web_crawl.py [--mirror FOLDER] [--start index.html] [--no-readme]
"""
from __future__ import annotations

import argparse
import functools
import tempfile
import threading
import time
from collections import Counter
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from common import REPO, publish, save

from ragline.flows.context import StepContext
from ragline.tasks.ingest.load import Params, load

MIRRORS = [(Path("/usr/share/doc/nodejs/api"), "index.html"), (Path("/usr/share/doc/valgrind/html"), "index.html"),
           (REPO / "samples" / "docs", "pipelines.html")]


class Counted(SimpleHTTPRequestHandler):
    statuses: Counter = Counter()
    sent = 0

    def log_request(self, code="-", size="-"):
        Counted.statuses[int(code)] += 1

    def copyfile(self, source, outputfile):
        start = source.tell()
        super().copyfile(source, outputfile)
        Counted.sent += source.tell() - start


def crawl(url: str, base_dir: str) -> tuple[float, int, StepContext, Counter, int]:
    Counted.statuses, Counted.sent = Counter(), 0
    ctx = StepContext(pipeline="bench", step_id="load", base_dir=base_dir)
    spec = {"type": "web", "start": [url], "max_depth": 20, "max_pages": 100_000, "robots": True}
    started = time.perf_counter()
    documents = load.fn(params=Params(paths=[spec]), ctx=ctx)
    return time.perf_counter() - started, len(documents), ctx, Counter(Counted.statuses), Counted.sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mirror", type=Path)
    parser.add_argument("--start", default="index.html")
    parser.add_argument("--no-readme", action="store_true")
    args = parser.parse_args()
    mirror, start = (args.mirror, args.start) if args.mirror else next((m, s) for m, s in MIRRORS if (m / s).exists())
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Counted, directory=str(mirror)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/{start}"
    with tempfile.TemporaryDirectory() as base:
        first = crawl(url, base)
        second = crawl(url, base)
    server.shutdown()
    rows, payload = [], {"mirror": str(mirror)}
    for name, (seconds, docs, ctx, statuses, sent) in (("first", first), ("second, unchanged", second)):
        requests = sum(statuses.values())
        payload[name] = {"seconds": round(seconds, 3), "documents": docs, "requests": requests,
                         "statuses": dict(statuses), "bytes_sent": sent, "complete": bool(ctx.covered)}
        rows.append(f"| {name} | {docs} | {requests} | {statuses.get(304, 0)} | {statuses.get(200, 0)} | "
                    f"{sent / 1e6:.2f} MB | {seconds:.2f} s | {'yes' if ctx.covered else 'no'} |")
    ratio = second[0] / first[0] if first[0] else 0
    save("web_crawl", {**payload, "second_over_first": round(ratio, 3)})
    publish("web_crawl", [f"Mirror: `{mirror}` ({first[1]} pages); second crawl / first: **{ratio:.0%}** of the "
                          f"wall time.", "",
                          "| crawl | documents | requests | 304 | 200 | body bytes sent | wall time | complete |",
                          "|---|---|---|---|---|---|---|---|", *rows], readme=not args.no_readme)


if __name__ == "__main__":
    main()
