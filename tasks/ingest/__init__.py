"""Ingestion stages: list and read sources (``load``), convert, chunk, embed, enrich and write the
index (``index``, the sink), plus pseudo-queries generated per chunk at ingestion."""
