"""The builtin Jinja2 prompt templates, shipped as package data (``ragline.prompts``)."""
