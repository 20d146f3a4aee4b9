"""Rerankers: a cross-encoder (``cross_encoder``, stage ``rerank``) and pairwise LLM ranking
(``llm``, stage ``rerank_llm``)."""
