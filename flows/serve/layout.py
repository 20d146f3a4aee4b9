"""Where a served project keeps things, and what its deployments are called: shared by
``ragline serve`` (``supervise.service``), the ingestion runs (``ingestion_runs``) and the redaction of paths (``redact``)."""
from __future__ import annotations

from pathlib import Path

from ragline.flows.spec.compile import Project

FLOW_NAME = "ragline"  # run_pipeline's flow name: deployments are "ragline/<pipeline>"
RESULTS_DIR = Path(".ragline") / "results"


def data_dir_of(project: Project) -> Path:
    """Where the project's indexes live: ``--data-dir``, else the pipelines file's folder."""
    return Path(project.data_dir or project.base_dir).resolve()


def results_dir(project: Project) -> Path:
    """The folder served runs persist their JSON results in."""
    return data_dir_of(project) / RESULTS_DIR


def deployment_name(project: Project, pipeline: str, full: bool = True) -> str:
    """The Prefect name of a pipeline's deployment, ``<prefix><pipeline>``; in full (what
    ``GET /api/deployments/name/...`` takes) with its flow: ``ragline/<prefix><pipeline>``."""
    name = f"{project.spec.settings.deployment_prefix}{pipeline}"
    return f"{FLOW_NAME}/{name}" if full else name
