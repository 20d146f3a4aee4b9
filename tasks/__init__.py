"""Builtin stages, one per module, registered explicitly here: ``STAGES`` maps each stage's name
to the module that declares it. The registry (``flows/spec/registry.py``, through the
``ragline.stages`` entry point that names this package) reads the map and imports a module only
when a pipeline names its stage, so a process that runs a search does not import the ingestion,
tuning and generation stages (a served flow run is a fresh process: that import was paid per run).
A new stage is one module here plus its line below; tests/flows/spec/test_registry.py checks that
every module is listed and registers the name it is listed under."""

STAGES: dict[str, str] = {name: f"ragline.tasks.{name}" for name in (
    "adapt_embedder", "answer_direct", "answerable", "chunk", "classify", "convert", "embed", "enrich",
    "expand_context", "expand_prf", "expand_terms", "extract_answer", "fuse", "generate", "generate_flare",
    "generate_map_reduce",
    "index", "insert", "load", "pseudo_queries", "recall_history", "refine_abstractive", "refine_extract",
    "refine_notes", "refine_sentences", "rerank", "rerank_llm", "retrieve_dense", "retrieve_examples",
    "retrieve_sparse", "retrieve_summaries", "rewrite", "self_query", "summarize_communities", "tune_retrieval",
    "verify",
)}

# modules of this package that declare no stage (helpers the stages share)
HELPERS = ("collection_index",)
