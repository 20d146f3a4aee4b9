"""Query pipelines for test projects, built from the steps they share instead of copied YAML: a
test says what differs (depths, the steps after retrieval) and the shape stays one definition.
Each returns the pipeline's lines as they stand under ``pipelines:``."""
from __future__ import annotations


def pipeline(name: str, *steps: str, kind: str = "query", head: str = "") -> str:
    """A pipeline of ``kind``: ``steps`` are flow mappings without their braces, in order; ``head``:
    lines between its kind and its steps (a schedule, a batch size)."""
    return f"  {name}:\n    kind: {kind}\n{head}    steps:\n" + "".join(f"      - {{{step}}}\n" for step in steps)


def hybrid(k: int = 20, top_k: int = 20) -> tuple[str, str, str]:
    """Dense and BM25 retrieval side by side (``k`` each), fused to ``top_k``: how most queries start."""
    return (f"id: dense,  task: retrieve_dense,  with: {{k: {k}}}",
            f"id: sparse, task: retrieve_sparse, with: {{k: {k}}}, after: []",
            f"id: fuse,   task: fuse, after: [dense, sparse], with: {{top_k: {top_k}}}")


def search(name: str = "search", k: int = 20, top_k: int = 20) -> str:
    """Hybrid retrieval alone: passages, no answer."""
    return pipeline(name, *hybrid(k, top_k))


def ask(name: str = "ask", k: int = 10, top_k: int = 4, max_tokens: int = 1500, answer: str = "") -> str:
    """Hybrid retrieval, the passages inserted up to ``max_tokens``, and the LLM's answer (``generate``
    unless ``answer`` names another step mapping)."""
    return pipeline(name, *hybrid(k, top_k), f"id: insert, task: insert, with: {{max_tokens: {max_tokens}}}",
                 answer or "id: answer, task: generate")


# Served projects name every step's resources (`uses`), as a project with several indexes must.
EMBEDDER = "  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}\n"


def index_resources(prefix: str = "", collection: str = "main") -> str:
    """One index's store, BM25 index and state, named ``<prefix>store`` and so on, under ``idx/``."""
    return (f"  {prefix}store:    {{type: chroma, path: idx/{prefix}chroma, collection: {collection}}}\n"
            f"  {prefix}sparse:   {{type: bm25, path: idx/{prefix}bm25}}\n"
            f"  {prefix}state:    {{type: index_state, path: idx/{prefix}state.sqlite}}\n")


def ingestion_steps(paths: str = "[docs]", chunk_size: int = 128, overlap: int = 8, prefix: str | None = None,
                    write: str = "") -> tuple[str, ...]:
    """load ``paths`` (a YAML list), convert, chunk, embed, index; ``prefix``: the steps name their
    resources (the embedder and the ``prefix`` index), as a served project's do; ``write``: the index
    step's ``with`` mapping, no braces."""
    uses = "" if prefix is None else ", uses: [embedder]"
    sink = "" if prefix is None else f", uses: {{store: {prefix}store, sparse: {prefix}sparse, state: {prefix}state}}"
    return (f"id: load,    task: load, with: {{paths: {paths}}}", "id: convert, task: convert",
            f"id: chunk,   task: chunk{uses}, with: {{size: {chunk_size}, overlap: {overlap}}}",
            f"id: embed,   task: embed{uses}",
            f"id: write,   task: index{sink}" + (f", with: {{{write}}}" if write else ""))


def ingestion(name: str, paths: str, prefix: str = "", head: str = "") -> str:
    """A served project's ingestion pipeline of ``paths`` (a YAML list) into the ``prefix`` index;
    ``head``: lines between its kind and its steps (a schedule, a batch size)."""
    return pipeline(name, *ingestion_steps(paths, prefix=prefix), kind="ingestion", head=head)


def served_search(k: int, top_k: int, name: str = "search") -> str:
    """``search`` over the main index, naming its resources."""
    return pipeline(name, f"id: dense,  task: retrieve_dense, uses: {{store: store, embedder: embedder}}, with: {{k: {k}}}",
                 f"id: sparse, task: retrieve_sparse, uses: {{sparse: sparse, state: state}}, with: {{k: {k}}}, after: []",
                 f"id: fuse,   task: fuse, after: [dense, sparse], with: {{top_k: {top_k}}}")


def index(chunk_size: int = 128, overlap: int = 8, write: str = "", name: str = "index") -> str:
    """The plain ingestion pipeline of docs/ over the default resources (``data.BASE_RESOURCES``):
    load, convert, chunk, embed, index (``write``: the index step's ``with`` mapping, no braces)."""
    return pipeline(name, *ingestion_steps("[docs]", chunk_size, overlap, write=write), kind="ingestion")
