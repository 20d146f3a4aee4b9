"""Running compiled pipelines: ``engine.run`` (directly or as a Prefect flow run),
``pipeline.execute_pipeline`` (one run on an executor), ``executors`` and ``steps`` (one step
in any process), ``ingest`` (the incremental protocol), ``query_runner``, ``jobs`` (publishing a
job's report: the tuned overlay), ``artifacts`` (a run's report on the dashboard), ``entrypoints``
and ``step_task`` (the importable Prefect flow and task), ``driver`` (what only the calling process gives a run), ``check`` and ``progress``.

May import: ``spec``, ``resources`` and the base modules; stages only through the registry.
"""
