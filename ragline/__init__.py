"""ragline: declarative RAG pipelines on Prefect.

The installed distribution claims only this name: the repository's ``flows/`` (the engine),
``tasks/`` (the builtin stages) and ``prompts/`` (their templates) install as ``ragline.flows``,
``ragline.tasks`` and ``ragline.prompts``, so a user's own ``tasks`` module never collides.
"""
__version__ = "0.2.0"
