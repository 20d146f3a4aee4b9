"""Issue 20 item 5 end to end: a served app (uvicorn, the scripted LLM, RAGLINE_QUERY_LOG=1) answers
questions (one of them hostile HTML), they are rated over POST /v1/feedback, `ragline eval` scores
the feedback export, a week of earlier traffic is written through the same QueryLog and
FeedbackStore; `ragline report` writes the page and headless Chromium opens it from disk: every
plot is drawn, the hostile question is text, nothing runs, nothing is fetched, no console error."""
from __future__ import annotations

import os
import random
import shutil
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from tests.helpers.api_harness import AUTH, QUESTION, TOKEN, running
from tests.helpers.chromium import CHROMIUM, CHROMIUM_FLAGS

pytestmark = pytest.mark.integration

HOSTILE = '<script>alert(1)</script><img src=x onerror="alert(2)"> what is diffusion tensor imaging?'
SCREENSHOT = Path(__file__).resolve().parents[3] / "docs" / "img" / "report.png"
STEPS = ("dense", "sparse", "fuse", "insert", "answer", "check")  # the served ask pipeline's steps


def _cli(*argv: str, capsys) -> str:
    from ragline.flows.cli import main

    capsys.readouterr()
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def _earlier_week(service, store) -> None:
    """Seven days of traffic as the served app logs it (its own QueryLog, the feedback file's store)."""
    rng, now = random.Random(7), datetime.now(timezone.utc).timestamp()
    for n in range(400):
        at = now - rng.uniform(3600, 7 * 86400)
        timings = {step: round(rng.lognormvariate(3 if step != "answer" else 6.5, 0.6), 2) for step in STEPS}
        status = rng.choices(["answered", "refused", "failed"], [0.85, 0.12, 0.03])[0]
        answer_id = f"{n:032x}"
        service.query_log.record({
            "answer_id": answer_id, "time": datetime.fromtimestamp(at, timezone.utc).isoformat().replace("+00:00", "Z"),
            "pipeline": rng.choice(["ask", "ask", "search", "ask-reranked"]), "status": status,
            "latency_ms": round(sum(timings.values()), 2), "timings": timings,
            "principal": rng.choice(["key:support-bot", "key:intranet", "oidc:alice"]), "question": f"question {n}"})
        if rng.random() < 0.2:
            store.append({"feedback_id": f"{n:032x}", "time": datetime.fromtimestamp(
                at + 60, timezone.utc).isoformat().replace("+00:00", "Z"), "principal": "oidc:alice",
                "answer_id": answer_id, "rating": rng.choice(["up", "up", "down"]), "corrected_passage_ids": []})
    service.query_log.flush()


def test_the_report_renders_every_plot_in_chromium_and_runs_nothing(api_project, fresh_script, capsys, tmp_path):
    from playwright.sync_api import sync_playwright

    from ragline.flows.serve.app import create_app
    from ragline.flows.serve.routers.feedback import FEEDBACK_FOLDER, FeedbackStore

    folder = tmp_path / "project"
    shutil.copytree(api_project.parent, folder, ignore=shutil.ignore_patterns("feedback", "query-log", "eval-runs"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAGLINE_QUERY_LOG", "1")
        app = create_app(str(folder / "pipelines.yaml"), token=TOKEN)
    service = app.state.service
    fresh_script.answer = "Diffusion tensor imaging measures it [1]."
    with running(app) as url, httpx.Client(base_url=url, headers=AUTH, timeout=120) as client:
        ids = [client.post("/v1/query", json={"question": q}).json()["answer_id"] for q in (QUESTION, HOSTILE)]
        for answer_id, rating in zip(ids, ("up", "down")):
            assert client.post("/v1/feedback", json={"answer_id": answer_id, "rating": rating}).status_code == 201
        store = FeedbackStore(folder / FEEDBACK_FOLDER, 10_000_000, text=True)
        _earlier_week(service, store)
        store.close()
    pipelines = str(folder / "pipelines.yaml")
    export = tmp_path / "qrels"
    _cli("feedback", "export", "-f", pipelines, "--qrels", str(export), "--test-share", "1", capsys=capsys)
    for _ in range(2):  # two eval runs: the metrics plot has a line
        _cli("eval", "-f", pipelines, "--dataset", str(export), "-p", "search", "--json", capsys=capsys)
    assert len(list((folder / ".ragline" / "eval-runs").glob("*.json"))) == 2

    out = tmp_path / "report.html"
    _cli("report", "-f", pipelines, "--out", str(out), "--since", "7d", capsys=capsys)
    page_html = out.read_text(encoding="utf-8")
    assert "&lt;script&gt;alert(1)" in page_html and "<script" not in page_html.lower()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1180, "height": 1250})
        console, requests, dialogs = [], [], []
        page.on("console", lambda m: console.append(m.text) if m.type in ("error", "warning") else None)
        page.on("pageerror", lambda e: console.append(str(e)))
        page.on("request", lambda r: requests.append(r.url))
        page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
        page.goto(out.as_uri())
        page.wait_for_load_state("load")
        assert requests == [out.as_uri()], "the page must fetch nothing but itself"
        assert console == [] and dialogs == []
        assert page.evaluate("document.querySelectorAll('script, img, iframe, object').length") == 0
        plots = page.locator("svg.plot")
        assert plots.count() >= len(STEPS) + 6  # per step and overall, outcomes, rates, feedback, 2 listings, eval
        for section in ("#latency", "#outcomes", "#feedback", "#usage", "#evaluation"):
            box = page.locator(f"{section} svg.plot").first.bounding_box()
            assert box and box["width"] > 100 and box["height"] > 50, section
        assert page.locator("#latency rect.bar").count() > 20 and page.locator("#outcomes circle.point").count() > 3
        assert page.locator("#evaluation circle.point").count() == 2 * 5  # two runs, five metrics
        assert page.locator("#ingestion").inner_text().count("index") >= 1
        assert HOSTILE[:40] in page.locator("body").inner_text()  # shown as the text it is
        assert page.locator("#usage").inner_text().count("key:support-bot") >= 1
        if os.environ.get("RAGLINE_SCREENSHOTS") == "1":  # the README's picture
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SCREENSHOT), full_page=False)
        browser.close()

    empty = tmp_path / "empty.html"
    (folder / ".ragline" / "query-log").rename(tmp_path / "moved")
    _cli("report", "-f", pipelines, "--out", str(empty), capsys=capsys)
    assert "RAGLINE_QUERY_LOG=1" in empty.read_text(encoding="utf-8")
