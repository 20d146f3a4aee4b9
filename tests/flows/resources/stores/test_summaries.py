"""The ``SummaryStore`` role (flows/resources/stores/summaries.py): the same cases against each
implementation a state hands out, a file beside a SQLite state and rows of a PostgreSQL one."""
from __future__ import annotations

import threading

import pytest

from ragline.flows.contracts import Community, SummaryReport
from ragline.flows.resources.stores.protocols import SummaryStore
from ragline.flows.resources.stores.summaries import DatabaseSummaries, FileSummaries


def report(generation: int, *summaries: str) -> SummaryReport:
    return SummaryReport(generation=generation, chunks=len(summaries), embedder="mini", communities=[
        Community(id=f"L1-{i}", level=1, chunk_ids=[f"chunk-{i}"], membership=f"hash-{i}", summary=title,
                  embedding=[1.0, float(i)]) for i, title in enumerate(summaries)])


def test_the_state_hands_out_the_role_for_its_kind(state):
    store = state.summaries()
    assert isinstance(store, SummaryStore)
    assert isinstance(store, DatabaseSummaries if state.spec.url else FileSummaries)
    if state.spec.url:
        assert "meta row" in store.location and state.spec.url not in store.location  # never the password
    else:
        assert store.location == str(state.path.with_name("s.summaries.json"))


def test_nothing_published_reads_as_none(state):
    assert state.summaries().load() is None


def test_a_publish_replaces_the_whole_set_and_says_where(state):
    store = state.summaries()
    first = store.publish(report(1, "Vacation", "Badges"))
    assert first.written and first.path == store.location
    assert [c.summary for c in store.load().communities] == ["Vacation", "Badges"]
    store.publish(report(2, "Expenses"))
    again = state.summaries().load()  # another handle reads what was published: nothing is kept per handle
    assert again.generation == 2 and [c.summary for c in again.communities] == ["Expenses"]


def test_a_reader_sees_the_old_set_or_the_new_one_never_a_mix(state):
    store = state.summaries()
    store.publish(report(1, *[f"old {i}" for i in range(50)]))
    seen, done = [], threading.Event()

    def read():
        while not done.is_set():
            loaded = state.summaries().load()
            seen.append({c.summary.split()[0] for c in loaded.communities})

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for generation in range(2, 8):
            word = "new" if generation % 2 == 0 else "old"
            store.publish(report(generation, *[f"{word} {i}" for i in range(50)]))
    finally:
        done.set()
        reader.join()
    assert seen and all(len(words) == 1 for words in seen), [w for w in seen if len(w) > 1][:3]


def test_a_damaged_set_names_where_it_is(state):
    store = state.summaries()
    if isinstance(store, FileSummaries):
        store.path.write_text("{not json")
    else:
        state.set_meta("summaries", "{not json")
        state.set_meta("summaries_version", "damaged")
    with pytest.raises(ValueError, match="not a summary index.*run the summarize job again") as raised:
        store.load()
    assert store.location in str(raised.value)
