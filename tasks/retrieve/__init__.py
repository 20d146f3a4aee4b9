"""Retrievers (dense, sparse, community summaries, few-shot examples) and their fusion (RRF)."""
