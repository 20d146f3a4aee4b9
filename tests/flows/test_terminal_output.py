"""Terminal output (issue 16 item 14): control characters from data (file names, titles, document
ids, error messages) are printed escaped by every print path of the CLI, its log lines and its
progress, so a file name cannot retitle the terminal, ring its bell or forge a line."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ragline.flows.terminal import printable

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


@pytest.mark.parametrize("raw, shown", [
    ("a\x1b]0;pwned\x07b", "a\\x1b]0;pwned\\x07b"),
    ("line\nforged: ok", "line\\nforged: ok"),
    ("back\rover", "back\\rover"),
    ("tab\there", "tab\\there"),
    ("nul\x00del\x7fcsi\x9b", "nul\\x00del\\x7fcsi\\x9b"),
    ("rtl\u202eexe.txt", "rtl\\u202eexe.txt"),
    ("sep\u2028x", "sep\\u2028x"),
    ("lone\ud800", "lone\\ud800"),
    ("café 日本 ✓ [1]", "café 日本 ✓ [1]"),
])
def test_printable_escapes_every_control_character_and_keeps_text(raw, shown):
    assert printable(raw) == shown
    assert not CONTROL.search(printable(raw))


def test_printable_can_keep_paragraphs_of_an_answer():
    assert printable("one\n\ntwo\x1b[2J\r", keep_newlines=True) == "one\n\ntwo\\x1b[2J\\r"
    assert printable(ValueError("bad\x07")) == "bad\\x07"


def test_log_lines_escape_their_message():
    import logging

    from ragline.flows.terminal import PrintableFormatter

    record = logging.LogRecord("ragline.x", logging.WARNING, __file__, 1, "skipped %s: %s", ("a\x1b[31m\n.md", "x"),
                               None)
    assert PrintableFormatter("%(levelname)s %(message)s").format(record) == "WARNING skipped a\\x1b[31m\\n.md: x"


@pytest.mark.integration
def test_the_cli_escapes_file_names_titles_and_errors(index_project, tmp_path):
    """Index, search and a failing command as a user runs them (the console script, a real
    terminal's stdout/stderr as pipes): no control character from the data reaches the output."""
    project = index_project()
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "title\x1b]0;pwned\x07.md").write_text("# Ribosome\x1b[2J\x07 notes\n\n"
                                                   "Ribosomes translate messenger RNA.\n")
    (docs / "two\nlines: added 99.md").write_text("# Plain\n\nRibosomes are made of RNA and protein.\n")
    (docs / "bin\x1b[31m\x07.txt").write_bytes(b"\x00\x01\x02binary")
    ragline = [sys.executable, "-m", "ragline.flows.cli"]
    env = {**os.environ, "PREFECT_LOGGING_LEVEL": "WARNING"}

    indexed = subprocess.run([*ragline, "index", "-f", str(project), "--no-prefect"], capture_output=True,
                             text=True, env=env, timeout=600)
    assert indexed.returncode == 3, indexed.stderr[-2000:]  # the binary file is skipped
    for stream in (indexed.stdout, indexed.stderr):
        assert not CONTROL.search(stream), [line for line in stream.splitlines() if CONTROL.search(line)]
    assert indexed.stdout.strip().splitlines() == ["index: added 2, updated 0, deleted 0, unchanged 0, failed 1 "
                                                   + indexed.stdout.split("failed 1 ", 1)[1].strip()]
    skipped = [line for line in indexed.stderr.splitlines() if "bin\\x1b[31m\\x07.txt" in line]
    assert len(skipped) == 2 and all("binary content" in line for line in skipped), indexed.stderr  # log + summary

    searched = subprocess.run([*ragline, "search", "ribosome RNA", "-f", str(project), "-k", "5"],
                              capture_output=True, text=True, env=env, timeout=600)
    assert searched.returncode == 0, searched.stderr[-2000:]
    assert not CONTROL.search(searched.stdout)
    assert "Ribosome\\x1b[2J\\x07 notes" in searched.stdout and "title\\x1b]0;pwned\\x07.md" in searched.stdout
    assert "two\\nlines: added 99.md" in searched.stdout
    assert len([line for line in searched.stdout.splitlines() if re.match(r"\d+\. \[", line)]) == 2

    missing = subprocess.run([*ragline, "validate", str(tmp_path / "gone\x1b[8m\n.yaml")], capture_output=True,
                             text=True, env=env, timeout=600)
    assert missing.returncode != 0 and "gone\\x1b[8m\\n.yaml" in missing.stderr, missing.stderr
    assert not CONTROL.search(missing.stdout + missing.stderr)
