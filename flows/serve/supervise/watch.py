"""The folder watchers of ``ragline serve``: one per folder root that its ingestion pipelines list,
each keeping those pipelines' change journals (flows/sources/journal.py), so a scheduled run reads
what changed instead of listing the whole corpus. Without ``ragline serve`` (a cron'd ``ragline
index``), nothing watches and runs list in full, as they always did."""
from __future__ import annotations

import os
from collections.abc import Callable

from ragline.flows.contracts import PipelineKind
from ragline.flows.serve.layout import data_dir_of
from ragline.flows.sources.journal import FolderWatcher, Journal, journal_file
from ragline.flows.spec.compile import Project
from ragline.tasks.ingest.load import watched_folders


def folder_watchers(project: Project) -> list[FolderWatcher]:
    """A watcher per watched folder (by its real path), with a journal per pipeline that lists it."""
    data_dir = data_dir_of(project)
    journals: dict[str, list[Journal]] = {}
    for name, pipeline in project.pipelines.items():
        if pipeline.kind is not PipelineKind.INGESTION:
            continue
        load = pipeline.load_step
        if load is None:
            continue
        for folder in watched_folders(load.params, str(project.base_dir)):
            journals.setdefault(os.path.realpath(folder), []).append(Journal(journal_file(data_dir, name, folder)))
    return [FolderWatcher(root, found) for root, found in sorted(journals.items())]


def start_watchers(project: Project, log: Callable[[str], None]) -> list[FolderWatcher]:
    watchers = [watcher.start() for watcher in folder_watchers(project)]
    if watchers:
        log(f"ragline serve: watching {len(watchers)} source folder(s) for changes ("
            + ", ".join(w.root for w in watchers) + "): scheduled runs read what changed, with a full listing "
            "after a restart and at least daily")
    return watchers
