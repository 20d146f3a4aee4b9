"""Builtin stages, one per module, in families (``ingest``, ``rewrite``, ``retrieve``, ``rerank``,
``refine``, ``generate``, ``jobs``: a subpackage each), registered explicitly here: ``STAGES`` maps
each stage's name (unchanged by where its module lives) to the module that declares it. The
registry (``flows/spec/registry.py``, through the ``ragline.stages`` entry point that names this
package) reads the map and imports a module only when a pipeline names its stage, so a process that runs a search does not import the ingestion,
tuning and generation stages (a served flow run is a fresh process: that import was paid per run).
A new stage is one module in its family plus its line below (a stage that is a subsystem is a
package of its parts, listed by its package: ``load``, ``tune_retrieval``); tests/flows/spec/test_registry.py
checks that every module is listed and registers the name it is listed under."""

STAGES: dict[str, str] = {
    # ingest
    "chunk": "ragline.tasks.ingest.chunk",
    "convert": "ragline.tasks.ingest.convert",
    "embed": "ragline.tasks.ingest.embed",
    "enrich": "ragline.tasks.ingest.enrich",
    "index": "ragline.tasks.ingest.index",
    "load": "ragline.tasks.ingest.load",
    "pseudo_queries": "ragline.tasks.ingest.pseudo_queries",
    # rewrite
    "classify": "ragline.tasks.rewrite.classify",
    "expand_prf": "ragline.tasks.rewrite.expand_prf",
    "expand_terms": "ragline.tasks.rewrite.expand_terms",
    "recall_history": "ragline.tasks.rewrite.recall_history",
    "rewrite": "ragline.tasks.rewrite.rewrite",
    "self_query": "ragline.tasks.rewrite.self_query",
    # retrieve
    "fuse": "ragline.tasks.retrieve.fuse",
    "retrieve_dense": "ragline.tasks.retrieve.dense",
    "retrieve_examples": "ragline.tasks.retrieve.examples",
    "retrieve_sparse": "ragline.tasks.retrieve.sparse",
    "retrieve_summaries": "ragline.tasks.retrieve.summaries",
    # rerank
    "rerank": "ragline.tasks.rerank.cross_encoder",
    "rerank_llm": "ragline.tasks.rerank.llm",
    # refine
    "expand_context": "ragline.tasks.refine.expand_context",
    "insert": "ragline.tasks.refine.insert",
    "refine_abstractive": "ragline.tasks.refine.abstractive",
    "refine_extract": "ragline.tasks.refine.extract",
    "refine_notes": "ragline.tasks.refine.notes",
    "refine_sentences": "ragline.tasks.refine.sentences",
    # generate
    "answer_direct": "ragline.tasks.generate.answer_direct",
    "answerable": "ragline.tasks.generate.answerable",
    "extract_answer": "ragline.tasks.generate.extract_answer",
    "generate": "ragline.tasks.generate.generate",
    "generate_flare": "ragline.tasks.generate.flare",
    "generate_map_reduce": "ragline.tasks.generate.map_reduce",
    "verify": "ragline.tasks.generate.verify",
    # jobs
    "adapt_embedder": "ragline.tasks.jobs.adapt_embedder",
    "summarize_communities": "ragline.tasks.jobs.summarize_communities",
    "tune_retrieval": "ragline.tasks.jobs.tune_retrieval",
}

# modules of this package that declare no stage (helpers the stages share)
HELPERS = ("ragline.tasks.ingest.collection_index",)
