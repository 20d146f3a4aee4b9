"""A project with a template ingestion pipeline and the `handbook` and `papers` collections it compiles
into (its pipelines.yaml text), shared by the collection tests of the spec, the server, the job runs
and the answerability gate."""
from __future__ import annotations

import textwrap


RESOURCES = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store:    {type: chroma, path: idx/chroma, collection: test}
  sparse:   {type: bm25, path: idx/bm25}
  state:    {type: index_state, path: idx/state.sqlite}
"""


PIPELINES = """
pipelines:
  index:
    kind: ingestion
    schedule: {cron: "0 * * * *"}
    steps:
      - {id: load,    task: load, with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, with: {size: 64, overlap: 8}}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
  search:
    kind: query
    steps:
      - {id: dense,  task: retrieve_dense, with: {k: 10}}
      - {id: sparse, task: retrieve_sparse, with: {k: 10}, after: []}
      - {id: fuse,   task: fuse, after: [dense, sparse]}
"""


HANDBOOK = """
  handbook:
    paths: [handbook]
    schedule: {interval_seconds: 600}
"""


PAPERS = """
  papers:
    description: Research papers
    paths: [papers]
    resources: {sparse: {k1: 0.9}}
    steps: {chunk: {overlap: 16}}
"""


def write(tmp_path, collections: str | None, name: str = "pipelines.yaml"):
    text = RESOURCES + (f"collections:{collections}" if collections is not None else "") + PIPELINES
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path
