"""The settings fingerprint covers what shapes indexed content, not step ids or branch order."""
from __future__ import annotations

from ragline.flows.spec.compile import load_project
from tests.helpers.data import BASE_RESOURCES

INDEX = BASE_RESOURCES + """
pipelines:
  index:
    kind: ingestion
    steps:
      - {id: load,    task: load, with: {paths: [docs]}}
      - {id: convert, task: convert}
      - {id: chunk,   task: chunk, with: {size: 128, overlap: 8}}
      - {id: embed,   task: embed}
      - {id: write,   task: index}
"""
RENAMED = (INDEX.replace("id: load,   ", "id: source, ").replace("id: convert", "id: clean")
           .replace("id: chunk,  ", "id: split,  ").replace("id: embed,  ", "id: vectors,")
           .replace("id: write", "id: sink"))

BRANCHES = BASE_RESOURCES + """
pipelines:
  index:
    kind: ingestion
    steps:
      - {id: load,  task: load, with: {paths: [docs]}}
      - {id: html,  task: convert, with: {min_chars: 5}}
      - {id: plain, task: convert, with: {min_chars: 9}, after: [load]}
      - {id: chunk, task: chunk, after: [html, plain]}
      - {id: embed, task: embed}
      - {id: write, task: index}
"""
SWAPPED = BRANCHES.replace("id: html,  task: convert, with: {min_chars: 5}}",
                           "id: plain, task: convert, with: {min_chars: 9}}") \
                  .replace("id: plain, task: convert, with: {min_chars: 9}, after: [load]}",
                           "id: html,  task: convert, with: {min_chars: 5}, after: [load]}")


def fingerprint(make_project, text: str, name: str = "pipelines.yaml") -> str:
    """What the engine hashes for an ingestion run: every step but the source and the sink."""
    pipeline = load_project(make_project(text, name=name)).pipeline("index")
    middle = [s for s in pipeline.steps if s.stage.inputs and s.stage.plan is None]
    return pipeline.fingerprint(middle)


def test_renaming_steps_keeps_the_fingerprint(make_project):
    assert RENAMED != INDEX
    assert fingerprint(make_project, INDEX) == fingerprint(make_project, RENAMED, name="renamed.yaml")


def test_changing_a_chunk_parameter_changes_it(make_project):
    changed = INDEX.replace("overlap: 8", "overlap: 16")
    assert fingerprint(make_project, INDEX) != fingerprint(make_project, changed, name="changed.yaml")


def test_resource_settings_change_it(make_project):
    prefixed = INDEX.replace("model: all-MiniLM-L6-v2}", "model: all-MiniLM-L6-v2, document_prefix: 'p: '}")
    assert fingerprint(make_project, INDEX) != fingerprint(make_project, prefixed, name="prefixed.yaml")


def test_independent_branches_in_any_order_give_the_same_fingerprint(make_project):
    assert SWAPPED != BRANCHES
    assert fingerprint(make_project, BRANCHES) == fingerprint(make_project, SWAPPED, name="swapped.yaml")


def test_order_along_the_data_path_counts(make_project):
    chained = BRANCHES.replace("after: [load]}", "}").replace("after: [html, plain]}", "}")
    reversed_chain = chained.replace("with: {min_chars: 5}", "with: {min_chars: X}") \
                            .replace("with: {min_chars: 9}", "with: {min_chars: 5}") \
                            .replace("with: {min_chars: X}", "with: {min_chars: 9}")
    assert fingerprint(make_project, chained) != fingerprint(make_project, reversed_chain, name="reversed.yaml")
