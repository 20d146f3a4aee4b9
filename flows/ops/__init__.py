"""The child processes ragline starts and supervises: the local Prefect server
(``prefect_server``), the packaged vLLM (``llm_server``), a ``chroma run`` per embedded store
(``chroma_server``), and the parent-death prelude that keeps each from outliving ragline.

May import ``resources`` and the base modules; never ``run`` or ``serve``.
"""
