"""The pipelines file, from YAML to the compiled model: parsing with line numbers (``parse``),
whole-file checks (``checks``), the compiled projects, pipelines and steps (``model``,
``compile``), the stage registry (``registry``), the index fingerprint (``fingerprint``), the tuned
overlay (``overlay``) and prompt templates (``prompts``).

May import: ``resources`` and the base modules (``contracts``, ``errors``, ``settings``,
``context``). Never ``run``, ``serve``, ``ops`` or a stage module.
"""
