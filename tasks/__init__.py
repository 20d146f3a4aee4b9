"""Builtin stages, one per module. Importing this package registers them (explicitly, here)."""
from ragline.tasks import (adapt_embedder, answerable, chunk, convert, embed, expand_context,  # noqa: F401
                   expand_prf, fuse, generate, generate_flare, index, insert, load, pseudo_queries,
                   refine_abstractive, refine_extract, refine_notes, refine_sentences, rerank, rerank_llm,
                   retrieve_dense, retrieve_examples, retrieve_sparse, rewrite, self_query, tune_retrieval, verify)
from ragline.tasks import expand_terms, generate_map_reduce  # noqa: F401
from ragline.tasks import enrich  # noqa: F401
from ragline.tasks import recall_history  # noqa: F401
from ragline.tasks import answer_direct, classify  # noqa: F401
from ragline.tasks import retrieve_summaries, summarize_communities  # noqa: F401

__all__ = ["adapt_embedder", "answerable", "chunk", "convert", "embed", "expand_context", "expand_prf", "fuse",
           "generate", "generate_flare", "index", "insert", "load", "pseudo_queries", "refine_abstractive",
           "refine_extract", "refine_notes", "refine_sentences", "rerank", "rerank_llm", "retrieve_dense",
           "retrieve_examples", "retrieve_sparse", "rewrite", "self_query", "tune_retrieval", "verify",
           "expand_terms", "generate_map_reduce", "enrich", "recall_history", "answer_direct", "classify",
           "retrieve_summaries", "summarize_communities"]
