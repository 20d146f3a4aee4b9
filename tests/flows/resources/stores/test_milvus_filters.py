"""Chroma-style filters as Milvus expressions (flows.resources.milvus.expression): the translation, its
escaping (a quote in a key or value must not change the expression) and the access clause ANDed in.
The same expressions run against the real engine in tests/integration/test_milvus_store.py."""
from __future__ import annotations

import pytest

from ragline.flows.access import PUBLIC_KEY, group_key
from ragline.flows.resources.stores.filters import FilterError
from ragline.flows.errors import InputError
from ragline.flows.resources.stores.milvus import (ACCESS_COLUMN, MilvusSpec, _access_elements, collection_name,
                                            expression, literal)
from ragline.tasks.retrieve.dense import combined_filter


@pytest.mark.parametrize("where, expected", [
    (None, ""),
    ({}, ""),
    ({"lang": "en"}, 'metadata["lang"] == "en"'),
    ({"year": {"$gte": 2020}}, 'metadata["year"] >= 2020'),
    ({"score": {"$lt": 0.25}}, 'metadata["score"] < 0.25'),
    ({"draft": False}, 'metadata["draft"] == false'),
    ({"lang": {"$ne": "en"}}, 'metadata["lang"] != "en"'),
    ({"lang": {"$in": ["en", "de"]}}, 'metadata["lang"] in ["en", "de"]'),
    ({"lang": {"$nin": ["en"]}}, 'metadata["lang"] not in ["en"]'),
    ({"lang": {"$in": []}}, 'key == ""'),  # matches nothing (Milvus cannot parse `in []`)
    ({"lang": {"$nin": []}}, 'key != ""'),  # matches everything
    ({"year": {"$gt": 2000, "$lt": 2020}}, '(metadata["year"] > 2000) and (metadata["year"] < 2020)'),
    ({"lang": "en", "year": 2020}, '(metadata["lang"] == "en") and (metadata["year"] == 2020)'),
    ({"$or": [{"lang": "en"}, {"$and": [{"year": 1}, {"tag": "a"}]}]},
     '(metadata["lang"] == "en") or ((metadata["year"] == 1) and (metadata["tag"] == "a"))'),
])
def test_translation(where, expected):
    assert expression(where) == expected


@pytest.mark.parametrize("value", ['x" or metadata["lang"] != "', "it's", 'a\\" or true or \\"', "\\", 'é"😀'])
def test_a_quoted_value_stays_one_literal(value):
    """Escaped so that Milvus's grammar (only \\\\ and \\" are escapes) reads the value back whole."""
    got = expression({"lang": value})
    assert got.startswith('metadata["lang"] == "') and got.endswith('"')
    body = got.removeprefix('metadata["lang"] == "').removesuffix('"')
    assert '"' not in body.replace("\\\\", "").replace('\\"', "")  # every quote inside is escaped
    assert _unescape(body) == value


def _unescape(body: str) -> str:
    """What Milvus's grammar reads from a literal's body: a backslash takes the next character as is."""
    out, i = [], 0
    while i < len(body):
        i += body[i] == "\\"
        out.append(body[i])
        i += 1
    return "".join(out)


def test_a_quoted_key_stays_one_literal():
    assert expression({'a"] == 1 or metadata["b': 1}) == 'metadata["a\\"] == 1 or metadata[\\"b"] == 1'


@pytest.mark.parametrize("value", ["two\nlines", "carriage\rreturn"])
def test_a_line_break_is_refused(value):
    """Milvus string literals cannot hold one (no \\n escape): refused, never sent half-parsed."""
    with pytest.raises(FilterError, match="line break"):
        expression({"lang": value})


def test_non_finite_and_unknown_values_are_refused():
    with pytest.raises(FilterError):
        literal(float("nan"))
    with pytest.raises(FilterError):
        literal([1])
    with pytest.raises(FilterError, match="unknown filter operator"):
        expression({"lang": {"$regex": "x"}})


def test_access_clause_is_anded_with_the_request():
    where = combined_filter({"lang": "en"}, {"year": {"$gt": 2000}}, frozenset({"staff"}))
    assert expression(where) == (
        f'((metadata["lang"] == "en") and (metadata["year"] > 2000)) and '
        f'((metadata["{PUBLIC_KEY}"] == true) or (metadata["{group_key("staff")}"] == true))')


COLUMNS = frozenset({"file_name", "lang"})


@pytest.mark.parametrize("where, expected", [
    ({"file_name": "a.md"}, 'm_file_name == "a.md"'),
    ({"file_name": {"$in": ["a.md", 'b".md']}}, 'm_file_name in ["a.md", "b\\".md"]'),
    ({"file_name": {"$nin": ["a.md"]}}, 'm_file_name not in ["a.md"]'),
    ({"file_name": {"$ne": "a.md"}}, 'm_file_name != "a.md"'),
    # the column holds "" for a chunk without the key or with another type: these read the JSON
    ({"file_name": ""}, 'metadata["file_name"] == ""'),
    ({"file_name": {"$in": ["a.md", ""]}}, 'metadata["file_name"] in ["a.md", ""]'),
    ({"file_name": 3}, 'metadata["file_name"] == 3'),
    ({"file_name": {"$gt": "a"}}, 'metadata["file_name"] > "a"'),
    ({"file_name": "x" * 70_000}, f'metadata["file_name"] == "{"x" * 70_000}"'),  # over a column's bytes
    ({"format": "pdf"}, 'metadata["format"] == "pdf"'),  # no column of that key
    ({"$or": [{"lang": "en"}, {"year": 1}]}, '(m_lang == "en") or (metadata["year"] == 1)'),
])
def test_a_key_kept_as_a_column_is_read_there_when_it_reads_the_same(where, expected):
    assert expression(where, COLUMNS) == expected


WITH_ACCESS = COLUMNS | {ACCESS_COLUMN}


@pytest.mark.parametrize("access, expected", [
    (frozenset(), 'array_contains(access, "*")'),
    (frozenset({"staff", "g:x-1"}), 'array_contains_any(access, ["*", "g:x-1", "staff"])'),
])
def test_the_access_clause_reads_the_access_field(access, expected):
    assert expression(combined_filter(None, None, access), WITH_ACCESS) == expected
    assert expression(combined_filter({"lang": "en"}, None, access), WITH_ACCESS) == f'(m_lang == "en") and ({expected})'
    assert "metadata[" in expression(combined_filter(None, None, access), COLUMNS)  # a collection without the field


@pytest.mark.parametrize("where", [
    {PUBLIC_KEY: False}, {PUBLIC_KEY: {"$ne": True}}, {group_key("staff"): 1}, {"ragline_acl.bad name": True},
])
def test_other_comparisons_of_access_keys_read_the_json(where):
    """Only ``<access key> == true`` reads the field: it holds exactly the keys that are true."""
    assert expression(where, WITH_ACCESS) == expression(where)


def test_access_comparisons_mixed_with_others_read_the_field_one_by_one():
    assert expression({"$or": [{PUBLIC_KEY: True}, {"lang": "en"}]}, WITH_ACCESS) == \
        '(array_contains(access, "*")) or (m_lang == "en")'
    assert expression({"$or": [{PUBLIC_KEY: True, group_key("a"): True}]}, WITH_ACCESS) == \
        '(array_contains(access, "*")) and (array_contains(access, "a"))'


def test_a_chunks_access_field_holds_its_true_groups_and_star_when_public():
    assert _access_elements({PUBLIC_KEY: True, "lang": "en"}, "c") == ["*"]
    assert _access_elements({group_key("b"): True, group_key("a"): True, group_key("c"): False}, "c") == ["a", "b"]
    assert _access_elements({"ragline_acl.bad name": True, group_key("ok"): "yes"}, "c") == []
    with pytest.raises(InputError, match="chunk 'c' may be read by 4097 groups"):
        _access_elements({group_key(f"g{i}"): True for i in range(4097)}, "c")


def test_filter_fields_are_identifiers():
    assert MilvusSpec(type="milvus").filter_fields == ["source", "root", "file_name", "format"]
    for bad in (["a b"], ['x"]'], ["1st"], ["dup", "dup"], ["ragline_acl_public"]):
        with pytest.raises(ValueError, match="filter field|access"):
            MilvusSpec(type="milvus", filter_fields=bad)


def test_spec_rejects_an_unknown_uri_and_collection_name():
    with pytest.raises(ValueError, match="neither a milvus-lite file"):
        MilvusSpec(type="milvus", uri="/data/milvus")
    with pytest.raises(ValueError, match="collection"):
        MilvusSpec(type="milvus", collection="my docs")
    assert MilvusSpec(type="milvus", uri="http://milvus:19530").host == "http://milvus:19530"
    assert MilvusSpec(type="milvus").host is None


def test_collection_names_are_valid_and_distinct():
    """A ragline collection name (letters, digits, '_', '-') is kept in the spec (access grants name it) and
    stored under a name Milvus takes."""
    assert collection_name("papers") == "papers"
    assert collection_name("a-b") != collection_name("a_b")
    assert collection_name("2024-docs").startswith("c_2024_docs_")
