"""API keys and scopes through a real uvicorn server (issue 19 item 2): two collections, keys made
by the CLI's store while the server runs, every route checked."""
from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import httpx
import pytest

from ragline.flows.run import engine
from ragline.flows.serve.auth.keys import KeyStore, keys_file
from ragline.flows.serve.supervise.service import api_app
from ragline.flows.spec.compile import load_project
from tests.helpers.api_harness import running

pytestmark = pytest.mark.integration

PIPELINES = """
resources:
  embedder: {type: sentence_transformer, model: all-MiniLM-L6-v2}
  store_a:  {type: chroma, path: a/chroma, collection: alpha}
  sparse_a: {type: bm25, path: a/bm25}
  state_a:  {type: index_state, path: a/state.sqlite}
  store_b:  {type: chroma, path: b/chroma, collection: beta}
  sparse_b: {type: bm25, path: b/bm25}
  state_b:  {type: index_state, path: b/state.sqlite}
pipelines:
  index_a:
    kind: ingestion
    steps:
      - {id: load, task: load, with: {paths: [docs_a, {type: uploads, name: up_a}]}}
      - {id: convert, task: convert}
      - {id: chunk, task: chunk, uses: [embedder], with: {size: 128, overlap: 8}}
      - {id: embed, task: embed, uses: [embedder]}
      - {id: write, task: index, uses: [store_a, sparse_a, state_a]}
  index_b:
    kind: ingestion
    steps:
      - {id: load, task: load, with: {paths: [docs_b, {type: uploads, name: up_b}]}}
      - {id: convert, task: convert}
      - {id: chunk, task: chunk, uses: [embedder], with: {size: 128, overlap: 8}}
      - {id: embed, task: embed, uses: [embedder]}
      - {id: write, task: index, uses: [store_b, sparse_b, state_b]}
  search_a:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, uses: [store_a, embedder], with: {k: 5}}
      - {id: fuse, task: fuse, with: {top_k: 3}}
  search_b:
    kind: query
    steps:
      - {id: dense, task: retrieve_dense, uses: [store_b, embedder], with: {k: 5}}
      - {id: fuse, task: fuse, with: {top_k: 3}}
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("keys")
    for side, text in (("a", "Axolotls regenerate limbs in cold water."), ("b", "Quasars emit Lyman alpha.")):
        (folder / f"docs_{side}").mkdir()
        (folder / f"docs_{side}" / "note.md").write_text(f"# Note {side}\n\n{text}\n")
    path = folder / "pipelines.yaml"
    path.write_text(PIPELINES)
    for name in ("index_a", "index_b"):
        assert engine.run(load_project(path).pipeline(name), orchestrate=False).added == 1
    return path


@pytest.fixture(scope="module")
def store(project) -> KeyStore:
    return KeyStore(keys_file(project.parent))


@pytest.fixture(scope="module")
def keys(store) -> dict[str, str]:
    """Made before the server starts; more are made while it runs."""
    return {"reader": store.create("reader", ["query"], ["*"])[1],
            "alpha": store.create("alpha", ["query"], ["alpha"], ["hr"])[1],
            "beta": store.create("beta", ["query"], ["beta"])[1],
            "admin": store.create("ops", ["admin"], ["*"])[1]}


@pytest.fixture(scope="module")
def served(project, keys):
    with running(api_app(project)) as url:
        yield url


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def query(url: str, key: str, pipeline: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/query", json={"question": "What regenerates limbs?", "pipeline": pipeline},
                      headers=bearer(key), timeout=60)


def forbidden(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "forbidden" and all(w in error["message"] for w in words), error


def refused(response: httpx.Response, reason: str) -> None:
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == "invalid_api_key" and reason in response.json()["error"]["message"]


def test_without_a_credential_nothing_protected_answers_once_keys_exist(served):
    refused(httpx.post(f"{served}/v1/query", json={"question": "q", "pipeline": "search_a"}), "missing")
    for path in ("/v1/models", "/metrics", "/openapi.json", "/docs"):
        assert httpx.get(f"{served}{path}").status_code == 401, path
    assert httpx.get(f"{served}/healthz").status_code == 200
    refused(query(served, "rl_0123456789ab_" + "x" * 43, "search_a"), "unknown API key")


def test_a_query_only_key_cannot_upload_delete_ingest_or_read_metrics(served, keys):
    key = keys["reader"]
    assert query(served, key, "search_a").status_code == 200
    assert httpx.get(f"{served}/v1/documents", headers=bearer(key)).status_code == 200
    forbidden(httpx.post(f"{served}/v1/documents", files={"file": ("x.md", b"# x\n\nx\n")},
                         data={"pipeline": "index_a", "ingest": "false"}, headers=bearer(key)),
              "scope 'upload'", "'alpha'")
    forbidden(httpx.delete(f"{served}/v1/documents/some-id", params={"pipeline": "index_b"}, headers=bearer(key)),
              "scope 'delete'", "'beta'")
    forbidden(httpx.post(f"{served}/v1/ingest", json={"pipeline": "index_a"}, headers=bearer(key)),
              "scope 'ingest'", "'alpha'")
    forbidden(httpx.get(f"{served}/metrics", headers=bearer(key)), "scope 'admin'")
    assert httpx.get(f"{served}/metrics", headers=bearer(keys["admin"])).status_code == 200
    assert httpx.get(f"{served}/openapi.json", headers=bearer(key)).status_code == 200  # any caller with a key


def test_a_key_for_collection_a_cannot_query_b_nor_list_it(served, keys):
    key = keys["alpha"]
    assert query(served, key, "search_a").json()["passages"]
    forbidden(query(served, key, "search_b"), "scope 'query' on collection 'beta'", "search_b")
    models = httpx.get(f"{served}/v1/models", headers=bearer(key)).json()
    assert [m["id"] for m in models["data"]] == ["search_a"]
    forbidden(httpx.get(f"{served}/v1/models/search_b", headers=bearer(key)), "'beta'")
    documents = httpx.get(f"{served}/v1/documents", headers=bearer(key)).json()["documents"]
    assert {d["pipeline"] for d in documents} == {"index_a"}
    forbidden(httpx.get(f"{served}/v1/documents", params={"pipeline": "index_b"}, headers=bearer(key)), "'beta'")


def test_keys_work_through_the_stock_openai_client(served, keys):
    from openai import OpenAI, PermissionDeniedError

    client = OpenAI(base_url=f"{served}/v1", api_key=keys["alpha"], max_retries=0)
    assert [m.id for m in client.models.list()] == ["search_a"]
    reply = client.chat.completions.create(model="search_a", messages=[{"role": "user", "content": "Axolotls?"}])
    assert "Axolotl" in reply.choices[0].message.content
    with pytest.raises(PermissionDeniedError, match="beta"):
        client.chat.completions.create(model="search_b", messages=[{"role": "user", "content": "Quasars?"}])


def test_a_key_created_revoked_or_rotated_while_serving_counts_from_the_next_request(served, store):
    record, key = store.create("late", ["query"], ["alpha"])
    assert query(served, key, "search_a").status_code == 200
    rotated, new_key = store.rotate(record.id)
    refused(query(served, key, "search_a"), "unknown API key")
    assert query(served, new_key, "search_a").status_code == 200
    store.revoke(record.id)
    refused(query(served, new_key, "search_a"), f"API key {record.id} was revoked")


def test_an_expired_key_is_refused(served, store):
    record, key = store.create("short", ["query"], ["*"], lifetime=datetime.timedelta(hours=1))

    def expire(keys):
        found = next(k for k in keys.keys if k.id == record.id)
        found.expires = found.created - datetime.timedelta(seconds=1)
        return found, None

    store._change(expire)  # as if an hour went by
    refused(query(served, key, "search_a"), "expired")


def _created(client: httpx.Client, path: str, body: dict) -> dict:
    """POST to Prefect, again on its 503 (a database conflict with the worker's serving server's
    scheduler: the transaction was rolled back, so a retry creates nothing twice)."""
    for _ in range(10):
        response = client.post(path, json=body)
        if response.status_code != 503:
            break
        time.sleep(0.5)
    return response.raise_for_status().json()


def test_a_run_is_seen_only_by_keys_that_may_read_its_collections(served, keys, project, prefect_server):
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value().rstrip("/")
    with httpx.Client(base_url=api, timeout=30) as client:
        flow = _created(client, "/flows/", {"name": "ragline"})
        run = _created(client, "/flow_runs/", {"flow_id": flow["id"], "parameters": {
            "pipeline": "index_b", "file": str(project)}})
    status = httpx.get(f"{served}/v1/runs/{run['id']}", headers=bearer(keys["beta"]), timeout=30)
    assert status.status_code == 200 and status.json()["pipeline"] == "index_b", status.text
    hidden = httpx.get(f"{served}/v1/runs/{run['id']}", headers=bearer(keys["alpha"]), timeout=30)
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "run_not_found"


def test_an_oidc_token_is_a_principal_with_its_claims(project, keys, monkeypatch, tmp_path):
    """A JWT signed by a key made here, its JWKS in a file; scoped to alpha by its claims."""
    import time

    from joserfc import jwt
    from joserfc.jwk import KeySet, RSAKey

    key = RSAKey.generate_key(2048, parameters={"kid": "k1"})
    (tmp_path / "jwks.json").write_text(json.dumps(KeySet([key]).as_dict(private=False)))
    for name, value in {"ISSUER": "https://idp.example", "AUDIENCE": "ragline", "JWKS_FILE": str(tmp_path / "jwks.json"),
                        "SCOPE_MAP": '{"rag.read": ["query"]}'}.items():
        monkeypatch.setenv(f"RAGLINE_OIDC_{name}", value)
    now = int(time.time())

    def token(**claims) -> str:
        body = {"iss": "https://idp.example", "aud": "ragline", "sub": "alice", "exp": now + 300,
                "scope": "rag.read", "ragline_collections": ["alpha"], **claims}
        return jwt.encode({"alg": "RS256", "kid": "k1"}, body, key)

    with running(api_app(project)) as url:
        assert query(url, token(), "search_a").status_code == 200
        forbidden(query(url, token(), "search_b"), "'beta'")
        refused(query(url, token(exp=now - 600), "search_a"), "expired")
        refused(query(url, token(aud="other"), "search_a"), "aud")
        assert query(url, keys["alpha"], "search_a").status_code == 200  # keys still work beside it
