"""One module per resource of the HTTP API, each an ``APIRouter`` the app (``flows/serve/app.py``)
mounts: collections (``catalog``), documents, feedback, metrics, the OpenAI surface (``openai_api``)
and ingestion runs (``runs``). Routers never import each other (an import-linter contract): what two
share lives beside them in ``flows/serve/`` (``ingestion_runs``, ``query_service``)."""
