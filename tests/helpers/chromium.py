"""Debian's headless Chromium driven by playwright, and asking the chat page a question."""
from __future__ import annotations

import os

CHROMIUM = os.environ.get("RAGLINE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def ask(page, question: str, pipeline: str = "ask"):
    page.select_option("#pipeline", pipeline)
    page.fill("#question", question)
    page.click("#submit")
    card = page.locator("article.card").first
    card.locator(".meta, .banner, ol.sources").first.wait_for(timeout=60_000)
    return card
