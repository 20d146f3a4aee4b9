"""The document API over real HTTP (uvicorn on a free port): uploads into the managed folder,
listing with status, limits, hostile names, idempotency keys and a body cut mid-way. The runs
here are started in-process (what the triggered deployment run does); the end-to-end test with
`ragline serve`, its Prefect deployments and the triggered runs is tests/integration/test_documents_serve.py."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest
from ragline.flows.run import engine
from ragline.flows.serve.supervise.service import api_app
from ragline.flows.spec.compile import load_project

from tests.helpers.api_harness import running
from tests.helpers.uploads import DOCX, MAX_BYTES, MD, PDF, PIPELINES, TOKEN, ingest

pytestmark = pytest.mark.integration

AUTH = {"Authorization": f"Bearer {TOKEN}"}



@pytest.fixture
def project(tmp_path) -> Path:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "configured.md").write_text("# Configured\n\nA configured note about lichens.\n")
    path = tmp_path / "pipelines.yaml"
    path.write_text(PIPELINES)
    return path


@pytest.fixture
def served(project):
    with running(api_app(project, token=TOKEN)) as url:
        yield url


def upload(url: str, name: str, data: bytes, headers: dict | None = None, **form) -> httpx.Response:
    return httpx.post(f"{url}/v1/documents", files={"file": (name, data)}, data={"ingest": "false", **form},
                      headers={**AUTH, **(headers or {})}, timeout=60)


def raw_upload(url: str, filename: bytes, data: bytes) -> httpx.Response:
    """A multipart body with the file name's bytes as they are (httpx would percent-encode controls)."""
    boundary = b"rawboundary"
    body = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="ingest"\r\n\r\nfalse\r\n'
            + b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="' + filename
            + b'"\r\nContent-Type: application/octet-stream\r\n\r\n' + data + b"\r\n--" + boundary + b"--\r\n")
    return httpx.post(f"{url}/v1/documents", content=body, timeout=60,
                      headers={**AUTH, "Content-Type": f"multipart/form-data; boundary={boundary.decode()}"})


def uploads_folder(project: Path) -> Path:
    return project.parent / ".ragline" / "uploads" / "uploads"


def tree(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) if folder.exists() else []


def listing(url: str, **params) -> list[dict]:
    response = httpx.get(f"{url}/v1/documents", params=params, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["documents"]


def test_uploads_are_queued_then_indexed_and_found_and_the_same_bytes_are_unchanged(project, served):
    created = {name: upload(served, name, data) for name, data in
               (("axolotl.md", MD), ("quasars.pdf", PDF), ("tardigrades.docx", DOCX))}
    assert {r.status_code for r in created.values()} == {201}, [r.text for r in created.values()]
    ids = {name: r.json()["document"]["id"] for name, r in created.items()}
    assert all(r.json()["document"]["status"] == "queued" for r in created.values())
    again = upload(served, "copy-of-axolotl.md", MD)
    assert again.status_code == 200 and again.json()["unchanged"] is True
    assert again.json()["document"]["id"] == ids["axolotl.md"]
    assert len(tree(uploads_folder(project))) == 6  # three <id>/<name>: the copy wrote nothing

    report = ingest(project)
    assert report.added == 4 and report.failed == 0, report.summary()
    documents = {d["id"]: d for d in listing(served)}
    assert set(documents) == {*ids.values(), "docs/configured.md"}
    for name, upload_id in ids.items():
        document = documents[upload_id]
        assert (document["status"], document["managed"], document["name"]) == ("indexed", True, name)
        assert document["chunks"] >= 1 and document["source"] == f"uploads/{upload_id}/{name}"
    assert documents["docs/configured.md"]["managed"] is False

    for question, name in (("Lyman alpha forests in quasar spectra", "quasars.pdf"),
                           ("How do tardigrades survive desiccation?", "tardigrades.docx"),
                           ("axolotl limb regeneration", "axolotl.md")):
        passages = httpx.post(f"{served}/v1/query", json={"pipeline": "search", "question": question},
                              headers=AUTH, timeout=60).json()["passages"]
        assert passages[0]["source_id"] == f"uploads/{ids[name]}/{name}", passages[0]

    assert upload(served, "axolotl.md", MD).json()["unchanged"] is True
    assert ingest(project).unchanged == 4  # nothing re-indexed
    one = httpx.get(f"{served}/v1/documents/{ids['quasars.pdf']}", headers=AUTH, timeout=30).json()
    assert one == documents[ids["quasars.pdf"]]


def test_the_list_is_paged_by_cursor(project, served):
    for n in range(5):
        assert upload(served, f"note{n}.md", f"# Note {n}\n\nText {n}.\n".encode()).status_code == 201
    seen, cursor = [], None
    while True:
        page = httpx.get(f"{served}/v1/documents", params={"limit": 2, **({"cursor": cursor} if cursor else {})},
                         headers=AUTH, timeout=30).json()
        assert len(page["documents"]) <= 2
        seen += [d["id"] for d in page["documents"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == 5 and seen == sorted(seen)
    bad = httpx.get(f"{served}/v1/documents", params={"cursor": "garbage!"}, headers=AUTH, timeout=30)
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "cursor"


@pytest.mark.parametrize("given, stored", [
    ("../../../etc/evil.md", "evil.md"),
    ("..\\..\\windows\\evil.md", "evil.md"),
    ("/abs/path/report.md", "report.md"),
    ("\x1b[31mred\x07\x7f\u202e.md", "[31mred.md"),  # ESC, BEL, DEL, right-to-left override
    ("...hidden.md", "hidden.md"),
    ("list#1.md", "list_1.md"),
])
def test_client_file_names_stay_inside_the_folder(project, served, given, stored):
    response = raw_upload(served, given.encode(), b"# Title\n\nSome body text.\n")
    assert response.status_code == 201, response.text
    document = response.json()["document"]
    assert document["name"] == stored
    assert tree(uploads_folder(project)) == [document["id"], f"{document['id']}/{stored}"]
    assert not (project.parent.parent / "etc").exists()


def test_a_name_with_nothing_usable_is_refused_naming_the_field(served):
    response = upload(served, "../..", b"# x\n\ny\n")
    assert response.status_code in (415, 422) and response.json()["error"]["param"] == "file"


def test_the_same_name_with_other_bytes_is_another_document(project, served):
    first = upload(served, "report.md", b"# One\n\nfirst\n").json()["document"]
    second = upload(served, "report.md", b"# Two\n\nsecond\n").json()["document"]
    assert first["id"] != second["id"]
    folder = uploads_folder(project)
    assert (folder / first["id"] / "report.md").read_bytes() == b"# One\n\nfirst\n"
    assert (folder / second["id"] / "report.md").read_bytes() == b"# Two\n\nsecond\n"


def test_limits_on_size_and_type_name_the_field(project, served):
    big = upload(served, "big.md", b"x" * (MAX_BYTES + 1))
    assert big.status_code == 413 and big.json()["error"]["param"] == "file", big.text
    assert str(MAX_BYTES) in big.json()["error"]["message"]
    huge = upload(served, "huge.md", b"x" * (MAX_BYTES * 2))  # beyond the body limit: refused before the route
    assert huge.status_code == 413
    for name in ("tool.exe", "README", "archive.tar.gz"):
        wrong = upload(served, name, b"MZ\x90\x00")
        assert wrong.status_code == 415 and wrong.json()["error"]["param"] == "file", wrong.text
        assert ".docx" in wrong.json()["error"]["message"]
    missing = httpx.post(f"{served}/v1/documents", data={"pipeline": "index"}, headers=AUTH, timeout=30)
    assert missing.status_code == 422 and missing.json()["error"]["param"] == "file", missing.text
    wrong_pipeline = upload(served, "a.md", b"# a\n\nb\n", pipeline="search")
    assert wrong_pipeline.status_code == 404 and wrong_pipeline.json()["error"]["param"] == "pipeline"
    assert tree(uploads_folder(project)) == []  # nothing stored, no staging folder left behind


def test_writes_need_the_token(served):
    response = httpx.post(f"{served}/v1/documents", files={"file": ("a.md", b"# a\n\nb\n")}, timeout=30)
    assert response.status_code == 401
    assert httpx.delete(f"{served}/v1/documents/{'0' * 32}", timeout=30).status_code == 401


def test_idempotency_key_replays_the_answer_and_refuses_another_body(project, served):
    key = {"Idempotency-Key": "upload-42"}
    first = upload(served, "key.md", b"# Key\n\nkeyed text\n", headers=key)
    replay = upload(served, "key.md", b"# Key\n\nkeyed text\n", headers=key)
    assert first.status_code == replay.status_code == 201
    assert first.json() == replay.json() and replay.headers.get("idempotent-replayed") == "true"
    other = upload(served, "key.md", b"# Key\n\nother text\n", headers=key)
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"
    assert len(tree(uploads_folder(project))) == 2  # the refused body stored nothing


def test_deleting_a_configured_document_is_refused(project, served):
    ingest(project)
    response = httpx.delete(f"{served}/v1/documents/docs/configured.md", headers=AUTH, timeout=30)
    assert response.status_code == 409 and response.json()["error"]["code"] == "not_managed", response.text
    assert (project.parent / "docs" / "configured.md").exists()
    missing = httpx.delete(f"{served}/v1/documents/{'a' * 32}", headers=AUTH, timeout=30)
    assert missing.status_code == 404


def test_a_failed_upload_shows_its_reason(project, served):
    bad = upload(served, "broken.pdf", b"%PDF-1.4 this is not a pdf").json()["document"]
    ingest(project)
    document = httpx.get(f"{served}/v1/documents/{bad['id']}", headers=AUTH, timeout=30).json()
    assert document["status"] == "failed" and document["reason"], document


def test_a_document_failing_after_load_shows_failed_with_its_stage(project, served):
    """Loaded (its bytes are text) but dropped by convert (nothing left after conversion), and one
    that fails in load: both are `failed` in the list, each naming its stage and reason."""
    scripts = upload(served, "scripts-only.html", b"<html><body><script>var x = 1;</script></body></html>")
    broken = upload(served, "broken.pdf", b"%PDF-1.4 this is not a pdf")
    report = ingest(project)
    assert {(f.stage, f.source_id.rsplit("/", 1)[-1]) for f in report.failures} == \
        {("convert", "scripts-only.html"), ("load", "broken.pdf")}, report.failures
    documents = {d["id"]: d for d in listing(served)}
    converted = documents[scripts.json()["document"]["id"]]
    assert (converted["status"], converted["stage"]) == ("failed", "convert"), converted
    assert "no text after conversion" in converted["reason"]
    loaded = documents[broken.json()["document"]["id"]]
    assert (loaded["status"], loaded["stage"]) == ("failed", "load") and loaded["reason"], loaded
    assert documents["docs/configured.md"]["status"] == "indexed"


def test_an_upload_cut_mid_body_leaves_nothing(project, served):
    host, port = served.removeprefix("http://").split(":")
    boundary = "cutcutcut"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"cut.md\"\r\n"
            f"Content-Type: text/markdown\r\n\r\n").encode()
    body = head + b"# Cut\n\n" + b"words " * 20_000 + f"\r\n--{boundary}--\r\n".encode()
    request = (f"POST /v1/documents HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
               f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request + body[: len(body) // 2])
        time.sleep(0.5)
    time.sleep(0.5)
    assert tree(uploads_folder(project)) == []
    assert listing(served) == []
    ingest(project)
    assert [d["id"] for d in listing(served)] == ["docs/configured.md"]
    whole = upload(served, "cut.md", body[len(head):-len(f"\r\n--{boundary}--\r\n")])
    assert whole.status_code == 201  # the server is fine and the same file uploads whole


# ----------------------------------------------------------------------------- issue 19 item 3: who reads an upload
UPLOADER = "x-test-uploader-groups"  # stands for the principal the auth layer will give (principal_of)


def uploader_groups(request):
    """The server's side: the uploader's groups (the header is this test's stand-in for a principal)."""
    given = request.headers.get(UPLOADER)
    return None if given is None else [g for g in given.split(",") if g]


def test_an_upload_is_readable_by_its_uploaders_groups_only(project):
    from ragline.flows.serve.app import create_app
    from ragline.flows.serve.routers.documents import documents_router
    from ragline.flows.serve.query_service import access_for
    from ragline.flows.serve.ingestion_runs import ingestion_runs

    runs = ingestion_runs(project)
    app = create_app(str(project), token=TOKEN, routers=[documents_router(runs, uploader_groups=uploader_groups)])

    def found(groups) -> bool:
        passages = engine.run(load_project(project).pipeline("search"),
                              {"query": {"text": "axolotl limb regeneration", "access": access_for(groups)}},
                              orchestrate=False)
        return any("Axolotl" in p.text for p in passages)

    with running(app) as url:
        # a client's own `groups` field sets nothing: only the server's uploader_groups does
        first = upload(url, "axolotl.md", MD, headers={UPLOADER: "hr"}, groups="eng")
        assert first.status_code == 201, first.text
        assert ingest(project).added == 2
        assert found({"hr"}) and not found({"eng"}) and not found(set()) and found(None)
        again = upload(url, "copy.md", MD, headers={UPLOADER: "eng"})  # the same bytes from an eng uploader
        assert again.status_code == 200 and again.json()["unchanged"] is True
        report = ingest(project)
        assert (report.regranted, report.chunks_written) == (1, 0)  # re-granted, not re-embedded
        assert found({"eng"}) and found({"hr"}) and not found({"sales"})
        assert upload(url, "axolotl.md", MD).status_code == 200  # an uploader without groups: for everyone
        assert ingest(project).regranted == 1 and found(set())
