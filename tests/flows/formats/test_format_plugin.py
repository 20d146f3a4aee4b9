"""A format added by another package: a distribution that declares a converter in the
``ragline.formats`` entry-point group is read by ``load`` with no change in ragline."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from ragline.flows.formats import GROUP

LOAD = """
import json, sys
from ragline.flows.context import StepContext
from ragline.tasks.ingest.load import Params, load
ctx = StepContext(pipeline="t", step_id="load")
documents = load.fn(params=Params(paths=[sys.argv[1]], include=["*.csv"]), ctx=ctx)
print(json.dumps({"docs": [[d.source_id.rsplit("/", 1)[-1], d.format, d.text] for d in documents],
                  "failures": [f.reason for f in ctx.failures]}))
"""


def test_a_converter_registered_by_entry_point_is_used_by_load(tmp_path):
    (tmp_path / "csv_format.py").write_text(textwrap.dedent("""
        import csv, io
        from ragline.flows.formats import Converted, FormatError
        from ragline.flows.formats.base import markdown_table

        def convert(data, name, options):
            rows = list(csv.reader(io.StringIO(data.decode("utf-8"))))
            if not rows or len(rows[0]) < 2:
                raise FormatError("not a table: fewer than two columns")
            return Converted(text=markdown_table(rows), title=name)
    """))
    dist = tmp_path / "csv_format-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: csv-format\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(f"[{GROUP}]\ncsv = csv_format:convert\n")
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "costs.csv").write_text("Item,Cost\nRadar,1200\n")
    (docs / "list.csv").write_text("just one column\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    result = subprocess.run([sys.executable, "-c", LOAD, str(docs)], capture_output=True, text=True, cwd=tmp_path,
                            env=env, timeout=300)

    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {
        "docs": [["costs.csv", "csv", "| Item | Cost |\n|---|---|\n| Radar | 1200 |"]],
        "failures": ["not a table: fewer than two columns"]}
