"""Evaluation of a project: retrieval on BEIR-format data with pytrec_eval (``retrieval``) and
answers on RGB-format data (``answers``).

May import ``run``, ``spec``, ``resources`` and the base modules.
"""
