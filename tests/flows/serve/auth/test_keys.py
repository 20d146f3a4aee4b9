"""API keys at rest (issue 19 item 2): hashed, expiring, revocable, rotatable, never lost to a
concurrent writer, and seen by a running server without a restart."""
from __future__ import annotations

import datetime
import json
import os
import stat
import subprocess
import sys

import pytest

from ragline.flows.serve.auth.keys import MAX_LIFETIME, KeyStore, KeyStoreError, describe, keys_file, parse_lifetime


@pytest.fixture
def store(tmp_path) -> KeyStore:
    return KeyStore(keys_file(tmp_path))


def test_the_file_holds_a_hash_never_the_secret_and_only_its_owner_reads_it(store):
    record, key = store.create("ci", ["query"], ["alpha"], ["hr"])
    secret = key.split("_", 2)[2]
    text = store.path.read_text()
    assert key.startswith(f"rl_{record.id}_") and len(secret) >= 40
    assert secret not in text and key not in text
    assert json.loads(text)["keys"][0]["hash"] == record.hash
    assert stat.S_IMODE(os.stat(store.path).st_mode) == 0o600
    assert "hash" not in describe(record) and secret not in json.dumps(describe(record))
    assert store.authenticate(key).groups == ["hr"]


def test_a_wrong_or_malformed_key_is_refused_without_echoing_it(store):
    record, key = store.create("ci", ["query"], ["*"])
    wrong = key[:-4] + ("AAAA" if not key.endswith("AAAA") else "BBBB")
    assert store.authenticate(wrong) == "unknown API key"
    assert store.authenticate(f"rl_{'0' * 12}_{key.split('_', 2)[2]}") == "unknown API key"
    assert store.authenticate("not-a-key") == "not a ragline API key"


def test_every_key_expires(store):
    record, key = store.create("ci", ["query"], ["*"], lifetime=parse_lifetime("2d"))
    assert record.expires - record.created == datetime.timedelta(days=2)
    assert not isinstance(store.authenticate(key, now=record.expires - datetime.timedelta(seconds=1)), str)
    assert "expired" in store.authenticate(key, now=record.expires)
    assert store.create("d", ["query"], ["*"])[0].expires - record.created >= datetime.timedelta(days=89)
    with pytest.raises(KeyStoreError, match="365d"):
        parse_lifetime("400d")
    with pytest.raises(KeyStoreError):
        store.create("x", ["query"], ["*"], lifetime=MAX_LIFETIME + datetime.timedelta(days=1))
    with pytest.raises(KeyStoreError, match="e.g. 90d"):
        parse_lifetime("forever")


def test_a_revoked_key_is_refused_and_others_still_work(store):
    first, first_key = store.create("a", ["query"], ["*"])
    _, second_key = store.create("b", ["query"], ["*"])
    store.revoke(first.id)
    assert store.authenticate(first_key) == f"API key {first.id} was revoked"
    assert not isinstance(store.authenticate(second_key), str)
    assert store.configured()  # only revoked keys would still ask every caller for a credential
    with pytest.raises(KeyStoreError, match="no key 'nope'"):
        store.revoke("nope")


def test_rotation_gives_a_new_secret_with_the_same_rights_and_refuses_the_old(store):
    record, old = store.create("ci", ["query", "upload"], ["alpha"], ["hr"], parse_lifetime("10d"))
    rotated, new = store.rotate(record.id)
    assert new != old and rotated.id == record.id
    assert store.authenticate(old) == "unknown API key"
    got = store.authenticate(new)
    assert (got.scopes, got.collections, got.groups) == (["query", "upload"], ["alpha"], ["hr"])
    assert rotated.expires - rotated.created == datetime.timedelta(days=10)


def test_a_running_reader_sees_keys_written_by_another_store_on_its_next_call(tmp_path):
    server, cli = KeyStore(keys_file(tmp_path)), KeyStore(keys_file(tmp_path))
    assert not server.configured()
    record, key = cli.create("ci", ["query"], ["*"])
    assert server.authenticate(key).id == record.id
    cli.revoke(record.id)
    assert "revoked" in server.authenticate(key)


def test_a_damaged_file_accepts_no_key(store):
    _, key = store.create("ci", ["query"], ["*"])
    store.path.write_text('{"version": 1, "keys": [{"id": 1}]}')
    assert store.authenticate(key) == "unknown API key"
    assert store.configured()


CREATE_MANY = """
import sys
from ragline.flows.serve.auth.keys import KeyStore
store = KeyStore(sys.argv[1])
for n in range(int(sys.argv[2])):
    store.create(f"{sys.argv[3]}-{n}", ["query"], ["*"])
"""


def test_two_processes_creating_at_once_lose_no_key(store):
    writers = [subprocess.Popen([sys.executable, "-c", CREATE_MANY, str(store.path), "25", name])
               for name in ("a", "b")]
    assert [w.wait(120) for w in writers] == [0, 0]
    names = {k.name for k in store.list()}
    assert len(names) == 50 and {"a-24", "b-24"} <= names


def test_the_cli_prints_a_key_once_and_lists_without_secrets(tmp_path, capsys):
    from ragline.flows.cli import main

    file = tmp_path / "pipelines.yaml"
    args = ["keys", "-f", str(file)]
    assert main([*args, "create", "--name", "bot", "--scope", "query", "--scope", "upload", "--collection", "alpha",
                 "--group", "hr", "--expires", "30d"]) == 0
    key = capsys.readouterr().out.strip()
    record = KeyStore(keys_file(tmp_path)).authenticate(key)
    assert record.scopes == ["query", "upload"] and record.groups == ["hr"]
    assert main([*args, "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [row["status"] for row in listed] == ["active"] and key.split("_", 2)[2] not in json.dumps(listed)
    assert main([*args, "rotate", record.id]) == 0
    assert capsys.readouterr().out.strip() != key
    assert main([*args, "revoke", record.id]) == 0 and "revoked" in capsys.readouterr().out
    assert main([*args, "revoke", "nope"]) == 2 and "no key 'nope'" in capsys.readouterr().err
