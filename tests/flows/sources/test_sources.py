"""The source protocol: the registry, specs checked with located errors, and the item cache that
lets an unchanged item skip its download."""
from __future__ import annotations

import threading
import time
from typing import Literal

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from ragline.flows.sources import (
    DocumentSource,
    Fetched,
    Item,
    ItemCache,
    Listing,
    SourceError,
    SourceSpec,
    source_types,
)
from ragline.flows.spec.compile import validate_file

from tests.helpers.data import BASE_RESOURCES


def pipelines(paths_yaml: str) -> str:
    return BASE_RESOURCES + f"""
pipelines:
  index:
    kind: ingestion
    steps:
      - id: load
        task: load
        with:
          paths:
{paths_yaml}
      - {{id: chunk, task: chunk}}
      - {{id: embed, task: embed, uses: [embedder]}}
      - {{id: write, task: index, uses: [store, sparse, state]}}
"""


def test_types_come_from_the_entry_point_group():
    types = source_types()
    assert {"local", "fsspec"} <= set(types)
    assert all(issubclass(cls, DocumentSource) and cls.type_name() == name for name, cls in types.items())


def test_a_credential_in_pipelines_yaml_is_refused_at_its_line_and_never_echoed(make_project):
    text = pipelines("""            - docs
            - type: fsspec
              url: s3://bucket/docs/
              options: {endpoint_url: "http://127.0.0.1:9", aws_secret_access_key: "wJalrXUtnFEMI-SECRET"}""")
    [error] = validate_file(make_project(text))
    assert (error.pipeline, error.step, error.field) == ("index", "load", "with.paths.1.options")
    assert error.line == next(i for i, line in enumerate(text.splitlines(), 1) if "options:" in line)
    assert "aws_secret_access_key" in error.message and "secrets" in error.message
    assert "wJalrXUtnFEMI" not in str(error)


def test_a_password_in_the_url_is_refused_and_never_echoed(make_project):
    text = pipelines("""            - {type: fsspec, url: "sftp://alice:hunter2-pw@files.example/docs"}""")
    [error] = validate_file(make_project(text))
    assert error.field == "with.paths.0.url" and "password" in error.message
    assert "hunter2" not in str(error)


def test_an_unknown_type_names_the_registered_ones(make_project):
    [error] = validate_file(make_project(pipelines("            - {type: gopher, url: gopher://x}")))
    assert error.field == "with.paths.0" and "unknown type 'gopher'" in error.message and "'fsspec'" in error.message


def test_plain_and_local_roots_still_validate(make_project):
    assert validate_file(make_project(pipelines("            - docs\n            - {path: notes, name: n}"))) == []


def test_the_cache_serves_bytes_only_for_the_signal_they_were_fetched_with(tmp_path):
    cache = ItemCache(tmp_path)
    item = Item("a.md", signal="etag:1")
    assert cache.hit(item) is None
    cache.keep(item, Fetched(b"# A", 1.0), item.signal)
    cache.save(complete=True)
    again = ItemCache(tmp_path)
    assert again.hit(Item("a.md", signal="etag:1")).data == b"# A"
    assert again.hit(Item("a.md", signal="etag:2")) is None  # changed: downloaded again
    assert again.hit(Item("a.md", signal=None)) is None  # no signal: always downloaded


def test_a_damaged_blob_is_a_miss_not_content(tmp_path):
    cache = ItemCache(tmp_path)
    cache.keep(Item("a.md", "v1"), Fetched(b"original"), "v1")
    cache.save(complete=True)
    next((tmp_path / "blobs").iterdir()).write_bytes(b"garbled")
    assert ItemCache(tmp_path).hit(Item("a.md", "v1")) is None


def test_an_incomplete_listing_keeps_every_entry_and_a_complete_one_prunes(tmp_path):
    cache = ItemCache(tmp_path)
    for key in ("a", "b"):
        cache.keep(Item(key, "v1"), Fetched(key.encode()), "v1")
    cache.save(complete=True)
    partial = ItemCache(tmp_path)
    partial.hit(Item("a", "v1"))
    partial.save(complete=False)
    assert ItemCache(tmp_path).hit(Item("b", "v1")) is not None
    full = ItemCache(tmp_path)
    full.hit(Item("a", "v1"))
    full.save(complete=True)
    assert ItemCache(tmp_path).hit(Item("b", "v1")) is None
    assert len(list((tmp_path / "blobs").iterdir())) == 1


def test_a_cache_that_cannot_be_written_costs_downloads_not_the_run(tmp_path):
    (tmp_path / "file").write_text("a file where the cache folder would be")
    cache = ItemCache(tmp_path / "file" / "sources")
    cache.keep(Item("a.md", "v1"), Fetched(b"# A"), "v1")
    cache.save(complete=True)
    assert ItemCache(tmp_path / "file" / "sources").hit(Item("a.md", "v1")) is None


@pytest.mark.parametrize("root", [
    {"path": "docs"},
    {"type": "fsspec", "url": "s3://bucket/docs/"},
    {"type": "web", "start": ["https://docs.example.org/"]},
    {"type": "uploads"},
])
def test_every_root_type_checks_its_name_and_link_prefix_the_same_way(root):
    adapter = TypeAdapter(SourceSpec)
    assert adapter.validate_python({**root, "name": "/team/handbook/"}).name == "team/handbook"
    for bad in ("../outside", "a#b", "a\x07b"):
        with pytest.raises(ValidationError, match="must be a relative name without"):
            adapter.validate_python({**root, "name": bad})
    if root.get("type") in (None, "fsspec"):
        with pytest.raises(ValidationError, match="must be an http:// or https:// URL"):
            adapter.validate_python({**root, "url_prefix": "javascript:alert(1)"})


class Slow(DocumentSource):
    """A source whose fetch takes a while and records how many run at once and how many are done
    but not yet taken by the consumer (the bytes held)."""

    class Spec(BaseModel):
        type: Literal["slow"]

    def __init__(self, concurrency: int):
        super().__init__(None, 100)
        self.concurrency, self.running, self.most, self.held, self.most_held = concurrency, 0, 0, 0, 0
        self.lock = threading.Lock()

    @property
    def location(self) -> str:
        return "slow://"

    @property
    def fetch_concurrency(self) -> int:
        return self.concurrency

    def list(self, cache, wanted):
        return Listing([])

    def fetch(self, item: Item) -> Fetched:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.02)
        with self.lock:
            self.running -= 1
            self.held += 1
            self.most_held = max(self.most_held, self.held)
        if item.key == "gone":
            raise SourceError("object disappeared after it was listed")
        if item.key == "bug":
            raise KeyError("a programming error is not an item's failure")
        return Fetched(item.key.encode())


def test_fetch_all_downloads_a_bounded_window_at_once_in_order_and_reports_each_failure():
    source = Slow(4)
    items = [Item(f"k{n}") for n in range(20)] + [Item("gone"), Item("k20")]
    out = []
    for item, outcome in source.fetch_all(items):
        time.sleep(0.005)  # a consumer slower than the window: fetches wait for it, never run ahead
        out.append((item.key, outcome.data if isinstance(outcome, Fetched) else str(outcome)))
        source.held -= 1
    assert [key for key, _ in out] == [i.key for i in items]
    assert out[3] == ("k3", b"k3") and out[20] == ("gone", "object disappeared after it was listed")
    assert 1 < source.most <= 4 and source.most_held <= 4


def test_fetch_all_one_at_a_time_and_an_unexpected_error_reaches_the_consumer():
    sequential = Slow(1)
    assert [o.data for _, o in sequential.fetch_all([Item("a"), Item("b")])] == [b"a", b"b"]
    assert sequential.most == 1
    with pytest.raises(KeyError, match="programming error"):
        list(Slow(3).fetch_all([Item("a"), Item("bug"), Item("c"), Item("d")]))


def test_fetch_all_bounds_the_bytes_held_ahead_not_only_the_count(monkeypatch):
    """16 fetches of 40 MiB objects would hold 640 MiB: the window admits one at a time; 10 MiB objects
    run six at once (64 MiB); an unsized item counts at max_bytes; an oversize one weighs nothing."""
    monkeypatch.setattr(Slow, "fetch_window_bytes", 64)
    big = Slow(16)
    assert len(list(big.fetch_all([Item(f"b{n}", size=40) for n in range(6)]))) == 6
    assert big.most == 1
    medium = Slow(16)
    for _ in medium.fetch_all([Item(f"m{n}", size=10) for n in range(30)]):
        time.sleep(0.005)
        medium.held -= 1
    assert 1 < medium.most <= 6 and medium.most_held <= 6
    unsized = Slow(16)  # max_bytes 100 > the window: each runs alone
    list(unsized.fetch_all([Item(f"u{n}") for n in range(4)]))
    assert unsized.most == 1
    oversize = Slow(16)  # refused by fetch before any download: they do not block the window
    list(oversize.fetch_all([Item(f"o{n}", size=1000) for n in range(8)]))
    assert oversize.most > 1


@pytest.mark.parametrize(("option", "field", "said"), [
    ("concurrency: 0", "concurrency", "greater than or equal to 1"),
    ("concurrency: 100000", "concurrency", "less than or equal to 256"),
    ("page_size: 0", "page_size", "greater than or equal to 1"),
])
def test_the_fetch_and_listing_options_are_checked_at_their_line(make_project, option, field, said):
    text = pipelines(f"""            - type: fsspec
              url: s3://bucket/docs/
              {option}""")
    [error] = validate_file(make_project(text))
    assert error.field == f"with.paths.0.{field}" and said in error.message
    assert error.line == next(i for i, line in enumerate(text.splitlines(), 1) if option in line)


def test_page_size_is_refused_where_the_store_does_not_list_in_pages(make_project):
    [error] = validate_file(make_project(pipelines(
        """            - {type: fsspec, url: "sftp://files.example/docs/", page_size: 2}""")))
    assert error.field == "with.paths.0.page_size" and "not sftp://" in error.message
    assert validate_file(make_project(pipelines(
        """            - {type: fsspec, url: "gs://docs/x/", page_size: 2, concurrency: 4}"""))) == []
