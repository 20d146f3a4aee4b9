"""The failpoints a crash-safety run is killed at: each kind of work an ingestion has in flight."""
from __future__ import annotations


FAILPOINTS = ["load.after_mark", "index.after_forget:2", "index.after_delete:2", "index.after_upsert:2", "index.after_record:2",
              "finalize.after_forget", "finalize.after_delete", "bm25.before_pointer", "finalize.after_publish"]
