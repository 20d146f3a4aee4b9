"""Builtin stages, one per module. Importing this package registers them (explicitly, here)."""
from tasks import chunk, convert, embed, fuse, index, load, retrieve_dense, retrieve_sparse  # noqa: F401

__all__ = ["chunk", "convert", "embed", "fuse", "index", "load", "retrieve_dense", "retrieve_sparse"]
