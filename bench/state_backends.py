"""What the index state costs on each backend (issue 22 item 4): the SQLite file against PostgreSQL on
loopback, for the operations an ingestion run and BM25's update make, at one corpus size.

Per backend: record N documents of 4 chunks in batches of 256 (one transaction each, as the index sink
does), the change log after re-recording 1 % of them (what BM25's incremental update reads), a full
snapshot (tune, a BM25 rebuild), 1,000 single-id lookups (chunks_by_id, as context expansion does) and the
writer lease taken and given back. PostgreSQL: a cluster of its own from initdb (tests/helpers/postgres.py),
fsync on (as in production).

Usage: .venv/bin/python bench/state_backends.py [--documents 20000]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ragline.flows.contracts import Chunk, Document  # noqa: E402
from ragline.flows.resources.stores.state import IndexState, StateSpec  # noqa: E402
from tests.helpers.postgres import PostgresServer, new_schema, skip_reason  # noqa: E402


def corpus(n: int, version: str = "v1") -> tuple[list[Document], list[Chunk]]:
    docs = [Document(source_id=f"d{i}", text="t", path=f"d{i}", content_hash=f"{i}-{version}") for i in range(n)]
    chunks = [Chunk(chunk_id=f"d{i}#{j}-{version}", source_id=f"d{i}", ordinal=j, title="",
                    text=f"document {i} passage {j} {version} " * 20, metadata={"n": j}) for i in range(n) for j in range(4)]
    return docs, chunks


def timed(what: str, results: dict[str, float], fn) -> None:
    began = time.perf_counter()
    fn()
    results[what] = time.perf_counter() - began


def measure(state: IndexState, n: int) -> dict[str, float]:
    docs, chunks = corpus(n)
    out: dict[str, float] = {}

    def record_all() -> None:
        for start in range(0, n, 256):
            batch = docs[start:start + 256]
            state.forget([d.source_id for d in batch])
            state.record("o", "fp", batch, chunks[start * 4:(start + len(batch)) * 4])  # 4 chunks a document, in order

    timed("record (per document)", out, record_all)
    out["record (per document)"] /= n
    log_id, since = state.chunk_log_id(), state.generation
    changed_docs, changed_chunks = corpus(n // 100, "v2")
    state.forget([d.source_id for d in changed_docs])
    state.record("o", "fp", changed_docs, changed_chunks)
    timed("change log after 1 % changed", out, lambda: state.chunk_changes(since, log_id))
    # the same read without the chunk_changes(generation) index, then with it again (A/B in one run)
    with state.transaction() as tx:
        tx.execute("DROP INDEX chunk_changes_by_generation")
    timed("change log after 1 % changed, without the generation index", out,
          lambda: state.chunk_changes(since, log_id))
    with state.transaction() as tx:
        tx.execute("CREATE INDEX chunk_changes_by_generation ON chunk_changes(generation)")
    timed("change log after 1 % changed, with it again", out, lambda: state.chunk_changes(since, log_id))
    timed("snapshot of every chunk", out, state.snapshot)
    ids = [c.chunk_id for c in chunks[: 4 * n:4 * max(1, n // 1000)]][:1000]
    timed("chunks_by_id, 1,000 single lookups (per lookup)", out, lambda: [state.chunks_by_id([i]) for i in ids])
    out["chunks_by_id, 1,000 single lookups (per lookup)"] /= max(1, len(ids))

    def lease() -> None:
        with state.lease("bench"):
            pass

    timed("writer lease taken and given back", out, lease)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--documents", type=int, default=20000)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ragline-state-bench-"))
    results = {"sqlite": measure(IndexState(StateSpec(type="index_state", path="s.sqlite"), folder), args.documents)}
    if (reason := skip_reason()) is None:
        server = PostgresServer(fsync=True).start()
        try:
            spec = StateSpec(type="index_state", url=server.url, schema_name=new_schema())
            results["postgres"] = measure(IndexState(spec, folder), args.documents)
        finally:
            server.stop()
    else:
        print(f"postgres: skipped ({reason})")
    print(f"{args.documents} documents, {4 * args.documents} chunks")
    print(f"| operation | {' | '.join(results)} |\n|---|{'---|' * len(results)}")
    for what in results["sqlite"]:
        cells = [f"{r[what] * 1000:.2f} ms" for r in results.values()]
        print(f"| {what} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
