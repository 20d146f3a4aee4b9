"""The chat page's documents list and upload button in headless Chromium (Debian's, via playwright)
against the real API (uvicorn, the document API mounted): upload a file, see it queued, then
indexed with its chunk count once a run indexed it, delete it, see it go after the next run."""
from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from ragline.flows.serve.supervise.service import api_app

from tests.helpers.api_harness import running
from tests.helpers.chromium import CHROMIUM, CHROMIUM_FLAGS
from tests.helpers.uploads import PIPELINES, TOKEN, ingest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).is_file()):
        pytest.fail(f"no Chromium at {CHROMIUM}: run `bash deploy/bootstrap.sh` (it installs Debian's chromium)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def project(tmp_path) -> Path:
    # no Prefect API here: an upload or a delete starts no run (`not_started`); the test runs them in-process
    (tmp_path / "docs").mkdir()
    path = tmp_path / "pipelines.yaml"
    path.write_text(PIPELINES)
    return path


def test_upload_list_and_delete_from_the_page(browser, project, tmp_path):
    from playwright.sync_api import expect

    note = tmp_path / "field-notes.md"
    note.write_text("# Field notes\n\nNewts return to the pond where they hatched.\n")
    with running(api_app(project, token=TOKEN)) as url:
        context = browser.new_context()
        page = context.new_page()
        page.add_init_script(f"sessionStorage.setItem('ragline.token', {TOKEN!r})")
        page.goto(url + "/")
        page.wait_for_selector("#documents:not([hidden])")
        page.set_input_files("#file", str(note))
        page.click("#upload-button")
        row = page.locator("#doc-list tbody tr").first
        row.wait_for()
        assert row.locator("td.name").inner_text() == "field-notes.md"
        assert row.get_attribute("data-status") == "queued"
        assert "uploaded" in page.locator("#upload-status").inner_text()

        ingest(project)  # what the scheduled run does
        page.wait_for_selector("#doc-list tr[data-status=indexed]", timeout=15_000)  # the page polls while queued
        assert int(page.locator("#doc-list tr[data-status=indexed] td.chunks").inner_text()) >= 1

        page.set_input_files("#file", str(note))  # the same bytes again
        page.click("#upload-button")
        expect(page.locator("#upload-status")).to_contain_text("unchanged")

        page.click("#doc-list button.delete")
        page.wait_for_selector("#doc-list tr[data-status=deleting]")
        ingest(project)
        expect(page.locator("#doc-list tbody tr")).to_have_count(0, timeout=15_000)
        context.close()
