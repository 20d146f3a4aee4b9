"""A project that takes uploads (its pipelines.yaml, the token, one file of each kind), shared by the
upload API tests, the served upload flow and the chat page's documents."""
from __future__ import annotations

import io
from pathlib import Path

from ragline.flows.run import engine
from ragline.flows.spec.compile import load_project
from tests.helpers.documents import make_pdf


TOKEN = "doc-api-token"


MAX_BYTES = 200_000


PIPELINES = f"""
resources:
  embedder: {{type: sentence_transformer, model: all-MiniLM-L6-v2}}
  store:    {{type: chroma, path: idx/chroma, collection: docs}}
  sparse:   {{type: bm25, path: idx/bm25}}
  state:    {{type: index_state, path: idx/state.sqlite}}
pipelines:
  index:
    kind: ingestion
    steps:
      - {{id: load,    task: load, with: {{paths: [docs, {{type: uploads}}], max_bytes: {MAX_BYTES}}}}}
      - {{id: convert, task: convert}}
      - {{id: chunk,   task: chunk, with: {{size: 128, overlap: 8}}}}
      - {{id: embed,   task: embed}}
      - {{id: write,   task: index}}
  search:
    kind: query
    steps:
      - {{id: dense,  task: retrieve_dense, with: {{k: 10}}}}
      - {{id: sparse, task: retrieve_sparse, with: {{k: 10}}, after: []}}
      - {{id: fuse,   task: fuse, after: [dense, sparse], with: {{top_k: 5}}}}
"""


def docx_bytes(heading: str, text: str) -> bytes:
    import docx

    document = docx.Document()
    document.add_heading(heading, level=1)
    document.add_paragraph(text)
    out = io.BytesIO()
    document.save(out)
    return out.getvalue()


MD = b"# Axolotl husbandry\n\nAxolotls regenerate limbs when kept in cold, clean water.\n"


PDF = make_pdf(["Quasar spectra show redshifted Lyman alpha forests.", "Second page about blazars."])


DOCX = docx_bytes("Tardigrade survival", "Tardigrades survive desiccation by producing trehalose glass.")


def ingest(project: Path):
    return engine.run(load_project(project).pipeline("index"), orchestrate=False)
