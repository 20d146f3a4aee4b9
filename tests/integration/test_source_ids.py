"""Source identity (issues 15 item 4, 16 items 3 and 9): sources are '<root name>/<path below the
root>', so a moved project is unchanged, an index from before (absolute ids) or a renamed root
migrates once, reported, without re-embedding, and nothing shows the server's paths. Real Chroma,
BM25, state record and MiniLM embeddings through the engine."""
from __future__ import annotations

import json
import shutil
import sqlite3

import pytest

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from ragline.flows.resources import clear_cache
from tests.helpers.harness import run_index, snapshot

pytestmark = pytest.mark.integration

NOTES = {"alpha.md": "# Alpha\n\nCapybaras are the largest living rodents.\n",
         "beta.txt": "Telomerase keeps stem cells dividing.\n",
         "sub/gamma.md": "# Gamma\n\nZebrafish regenerate their fins.\n"}


def write_docs(folder):
    for name, text in NOTES.items():
        (folder / "docs" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "docs" / name).write_text(text)
    (folder / "docs" / "corpus.jsonl").write_text(json.dumps({"_id": "r1", "title": "Record", "text": "Quokkas smile.",
                                                              "metadata": {"path": "https://evil.example/phish"}})
                                                  + "\n")


def search(project, text):
    return engine.run(load_project(project).pipeline("search"), {"query": text}, orchestrate=False)


@pytest.fixture
def project(tmp_path, index_project):
    path = index_project()
    write_docs(tmp_path)
    return path


def test_ids_and_paths_are_relative_to_the_root_and_a_moved_project_is_unchanged(project, tmp_path):
    first = run_index(project)
    assert first.added == 4
    ids = sorted(snapshot(project)["sources"])
    assert ids == ["docs/alpha.md", "docs/beta.txt", "docs/corpus.jsonl#r1", "docs/sub/gamma.md"]
    hit = search(project, "largest rodents")[0]
    assert hit.metadata["source"] == "docs/alpha.md" and str(tmp_path) not in json.dumps(hit.model_dump())
    clear_cache()
    moved = tmp_path.parent / (tmp_path.name + "-moved")
    shutil.copytree(tmp_path, moved, symlinks=True)
    shutil.move(str(tmp_path), str(tmp_path.parent / (tmp_path.name + "-away")))
    again = run_index(moved / project.name)
    assert (again.added, again.updated, again.deleted, again.unchanged, again.chunks_written) == (0, 0, 0, 4, 0)
    hits = search(moved / project.name, "largest rodents")
    assert len({h.chunk_id for h in hits}) == len(hits) and len({h.source_id for h in hits}) == len(hits)
    clear_cache()


def legacy(project, folder):
    """Rewrite the index as the version before root-relative ids wrote it: absolute source ids and
    an absolute 'source' path, in the state and in Chroma (the vectors left as they were)."""
    clear_cache()
    state = sqlite3.connect(project.parent / "idx" / "state.sqlite")
    with state:
        for (sid,) in state.execute("SELECT source_id FROM sources").fetchall():
            old = f"{folder}/{sid}"
            state.execute("UPDATE sources SET source_id=?, path=? WHERE source_id=?", (old, old.split("#")[0], sid))
        for cid, sid, meta in state.execute("SELECT chunk_id, source_id, metadata FROM chunks").fetchall():
            meta = {k: v for k, v in json.loads(meta).items() if k != "root"}
            meta["source"] = f"{folder}/{sid}".split("#")[0]
            state.execute("UPDATE chunks SET source_id=?, metadata=? WHERE chunk_id=?",
                          (f"{folder}/{sid}", json.dumps(meta), cid))
    state.close()
    store = load_project(project).resource("store")
    got = store.collection.get(include=["metadatas"])
    store.collection.update(ids=got["ids"], metadatas=[
        {**m, "source_id": f"{folder}/{m['source_id']}", "source": f"{folder}/{m['source']}"} for m in got["metadatas"]])
    clear_cache()


def test_an_index_with_absolute_ids_from_elsewhere_migrates_once_without_reembedding(project, tmp_path):
    run_index(project)
    before = {cid for cid, _, _ in snapshot(project)["chroma"]}
    legacy(project, "/srv/old-place/p1")  # built where the project was before it moved
    (tmp_path / "docs" / "beta.txt").unlink()  # and one file was deleted meanwhile
    report = run_index(project)
    assert (report.migrated, report.added, report.deleted, report.chunks_written) == (3, 0, 1, 0)
    assert "3 sources moved to root-relative ids without re-embedding" in report.summary()
    snap = snapshot(project)
    assert sorted(snap["sources"]) == ["docs/alpha.md", "docs/corpus.jsonl#r1", "docs/sub/gamma.md"]
    assert {cid for cid, _, _ in snap["chroma"]} <= before  # the same vectors, under the same chunk ids
    assert snap["bm25"] == snap["state_chunks"] == sorted(cid for cid, _, _ in snap["chroma"])
    assert all("/srv/old-place" not in meta for _, _, meta in snap["chroma"])
    sparse = load_project(project).resource("sparse")  # BM25 republished from the renamed state
    by_source = [sparse.count({"source_id": source}) for source in snap["sources"]]
    assert all(by_source) and sum(by_source) == sparse.count(None)
    clear_cache()
    again = run_index(project)
    assert (again.migrated, again.unchanged, again.added) == (0, 3, 0)


def test_a_renamed_root_is_a_reported_migration_not_a_duplicate(project):
    run_index(project)
    project.write_text(project.read_text().replace("paths: [docs]", "paths: [{path: docs, name: manual}]"))
    report = run_index(project)
    assert (report.migrated, report.added, report.chunks_written) == (4, 0, 0)
    assert sorted(snapshot(project)["sources"]) == ["manual/alpha.md", "manual/beta.txt", "manual/corpus.jsonl#r1",
                                                    "manual/sub/gamma.md"]
    hits = search(project, "largest rodents")
    assert len({h.source_id for h in hits}) == len(hits) and hits[0].source_id == "manual/alpha.md"


def test_a_records_metadata_cannot_set_its_link_and_a_url_prefix_can(project):
    project.write_text(project.read_text().replace(
        "paths: [docs]", "paths: [{path: docs, url_prefix: 'https://wiki.example.com/'}]"))
    run_index(project)
    hits = {h.source_id: h for h in search(project, "Quokkas smile")}
    record = hits["docs/corpus.jsonl#r1"]
    assert record.metadata["source"] == record.metadata["url"] == "https://wiki.example.com/corpus.jsonl"
    assert "evil.example" not in json.dumps(record.model_dump())
    assert hits.get("docs/sub/gamma.md") is None or \
        hits["docs/sub/gamma.md"].metadata["url"] == "https://wiki.example.com/sub/gamma.md"
