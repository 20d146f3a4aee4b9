"""Jobs that change what queries read: self-tuning of retrieval (``tune_retrieval``), embedder
adaptation (``adapt_embedder``) and community summaries (``summarize_communities``)."""
