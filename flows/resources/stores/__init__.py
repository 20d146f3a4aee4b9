"""Where chunks and their records live, behind the roles stages annotate (``protocols``:
``DenseStore``, ``SparseIndex``): Chroma, Milvus and BM25, the index state (SQLite ``state``,
PostgreSQL ``state_pg``) with its writer lease, the community summaries (``summaries``), store
integrity and repairs (``integrity``), read-only snapshots (``read_snapshot``), the managed-server
record (``store_owner``), moving sources without re-embedding (``source_ids``) and the metadata
filter language every store speaks (``filters``)."""
