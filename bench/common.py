"""Shared helpers for benchmarks: data location, timing, writing result tables into their docs pages."""
from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import ragline.flows  # noqa: E402,F401 - offline defaults first

DATA = Path(os.environ.get("RAGLINE_DATA_DIR", REPO.parent / "shared" / "data"))
SCIFACT = DATA / "scifact"
OUT = REPO / "bench" / "out"


@contextmanager
def timer(results: dict, key: str):
    start = time.perf_counter()
    yield
    results[key] = time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def summary_ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(1000 * statistics.median(values), 2), "p95_ms": round(1000 * percentile(values, 95), 2)}


def subset_corpus(n: int, folder: Path) -> Path:
    """The first n SciFact records as a JSONL file in ``folder`` (n=0: the whole corpus, in place)."""
    if n <= 0:
        return SCIFACT / "corpus.jsonl"
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / "corpus.jsonl"
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as src, open(target, "w", encoding="utf-8") as dst:
        for i, line in enumerate(src):
            if i >= n:
                break
            dst.write(line)
    return target


def save(name: str, payload: dict) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path


def pages(root: Path = REPO) -> list[Path]:
    """The pages a result table may live in: README.md and every Markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def marker_pattern(marker: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- bench:{re.escape(marker)} -->\n).*?(<!-- /bench:{re.escape(marker)} -->)", re.S)


def write_section(marker: str, markdown: str, root: Path = REPO) -> Path | None:
    """Replace the text between <!-- bench:MARKER --> and <!-- /bench:MARKER --> in the one page
    that holds them (tables moved from the README to docs/; the script need not know which page)."""
    pattern = marker_pattern(marker)
    holders = [page for page in pages(root) if pattern.search(page.read_text(encoding="utf-8"))]
    if len(holders) != 1:
        where = ", ".join(str(page.relative_to(root)) for page in holders) or "no page"
        print(f"bench:{marker} markers in {where} (need exactly one page); table not written", file=sys.stderr)
        return None
    [page] = holders
    text = page.read_text(encoding="utf-8")
    page.write_text(pattern.sub(lambda m: m.group(1) + markdown.rstrip() + "\n" + m.group(2), text), encoding="utf-8")
    return page


def publish(marker: str, lines: list[str], readme: bool = True) -> None:
    """Print a result table and, unless told not to (``--no-readme``), put it into its docs page."""
    table = "\n".join(lines)
    if readme:
        write_section(marker, table)
    print(table)


@contextmanager
def indexed_workspace(docs: int, extra_pipelines: str = ""):
    """A temporary copy of the shipped pipelines (plus ``extra_pipelines`` YAML) with the first ``docs``
    SciFact abstracts indexed in-process; yields (pipelines file, project, the first SciFact queries)."""
    import tempfile

    from ragline.flows.run import engine
    from ragline.flows.spec.compile import load_project

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        text = (REPO / "pipelines.yaml").read_text().replace("\npipelines:\n", "\npipelines:\n" + extra_pipelines, 1)
        (work / "pipelines.yaml").write_text(text)
        (work / "prompts").symlink_to(REPO / "prompts")
        corpus = subset_corpus(docs, work / "corpus")
        project = load_project(work / "pipelines.yaml")
        engine.run(project.pipeline("index").with_overrides({"load": {"paths": [str(corpus)]}}), orchestrate=False)
        with open(SCIFACT / "queries.jsonl", encoding="utf-8") as handle:
            questions = [json.loads(line)["text"] for line in handle]
        yield work / "pipelines.yaml", project, questions


def index_more(pipelines_file: Path, docs: int, added: int) -> list[str]:
    """Append SciFact abstracts ``docs`` .. ``docs + added`` to the workspace's corpus and index them
    with `ragline index` in its own process (a user in another terminal); returns their titles."""
    import subprocess

    corpus = next(pipelines_file.parent.rglob("*.jsonl"))
    with open(SCIFACT / "corpus.jsonl", encoding="utf-8") as handle:
        records = [json.loads(line) for _, line in zip(range(docs + added), handle)][docs:]
    with open(corpus, "a", encoding="utf-8") as out:
        out.writelines(json.dumps(r) + "\n" for r in records)
    done = subprocess.run([str(REPO / ".venv" / "bin" / "ragline"), "index", str(corpus), "-f", str(pipelines_file),
                           "--no-prefect"], capture_output=True, text=True, cwd=pipelines_file.parent)
    if done.returncode != 0:
        raise RuntimeError(f"ragline index failed: {done.stderr[-2000:]}")
    return [r["title"] for r in records if r.get("title")]
