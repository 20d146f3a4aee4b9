"""What Prefect mode adds to a CLI command (issue 22 item 5): wall time of `ragline index` over an
unchanged folder (the shipped pipelines.yaml over samples/, indexed once, untimed), with no
`PREFECT_API_URL` set, in four variants measured in the same run, interleaved (medians of ``--repeats``):

  - in-process: `index --no-prefect`, the baseline;
  - per-command server: `RAGLINE_PREFECT_IDLE_SECONDS=0`, each command starts ragline's local
    Prefect API and stops it on exit (the behaviour before the shared server);
  - shared, cold: the first command after `ragline prefect stop`: it starts the shared server;
  - shared, warm: the next command, which reuses it;
and, to tell what the warm overhead is made of, a fresh interpreter that only imports Prefect's
flow module (a cost every Prefect-mode command pays, server or not).

The overhead column is the variant's median minus the in-process median; the target is warm <= 3 s.
Every variant uses one temporary RAGLINE_HOME whose Prefect database is created before timing.

Usage: .venv/bin/python bench/cli_prefect_overhead.py [--repeats 3] [--no-readme]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, publish, save

TARGET_S = 3.0
INDEX = ["index"]


def ragline(arguments: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    """Run the console script; returns its wall time and stderr (a failure ends the benchmark)."""
    started = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / "ragline"), *arguments], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"ragline {' '.join(arguments)} exited {done.returncode}: {done.stderr[-2000:]}")
    return seconds, done.stderr


def workspace(root: Path, env: dict[str, str]) -> Path:
    root.mkdir()
    shutil.copy(REPO / "pipelines.yaml", root / "pipelines.yaml")
    shutil.copytree(REPO / "samples", root / "samples")
    shutil.copytree(REPO / "prompts", root / "prompts")
    ragline(INDEX + ["--no-prefect"], root, env)  # the first build, untimed
    ragline(INDEX, root, {**env, "RAGLINE_PREFECT_IDLE_SECONDS": "0"})  # creates the Prefect database, untimed
    return root


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-readme", dest="readme", action="store_false", help="print the table only")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"in-process (--no-prefect)": [], "per-command server (idle 0)": [],
                                     "shared server, cold (starts it)": [], "shared server, warm (reuses it)": []}
    imports: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ragline-prefect-bench-") as folder:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(RAGLINE_HOME=str(Path(folder) / "home"), PREFECT_HOME=str(Path(folder) / "prefect-home"),
                   PREFECT_PROFILES_PATH=str(Path(folder) / "profiles.toml"), RAGLINE_START_LLM="0",
                   RAGLINE_PREFECT_IDLE_SECONDS="600")
        root = workspace(Path(folder) / "project", env)
        try:
            for _ in range(args.repeats):  # interleaved: the machine's drift hits every variant alike
                ragline(["prefect", "stop"], root, env)
                seconds, said = ragline(INDEX, root, env)
                assert "Prefect API: started" in said, said
                times["shared server, cold (starts it)"].append(seconds)
                seconds, said = ragline(INDEX, root, env)
                assert "Prefect API: reusing" in said, said
                times["shared server, warm (reuses it)"].append(seconds)
                times["in-process (--no-prefect)"].append(ragline(INDEX + ["--no-prefect"], root, env)[0])
                times["per-command server (idle 0)"].append(
                    ragline(INDEX, root, {**env, "RAGLINE_PREFECT_IDLE_SECONDS": "0"})[0])
                started = time.perf_counter()
                subprocess.run([sys.executable, "-c", "import prefect.flows"], env=env, check=True)
                imports.append(time.perf_counter() - started)
        finally:
            ragline(["prefect", "stop"], root, env)
    medians = {name: round(statistics.median(values), 2) for name, values in times.items()}
    baseline = medians["in-process (--no-prefect)"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    lines = ["| `ragline index`, unchanged folder | wall time (s) | overhead over in-process (s) | target |",
             "|---|---:|---:|---:|"]
    for name, value in medians.items():
        target = f"<= {TARGET_S:g} s" if name.startswith("shared server, warm") else ""
        lines.append(f"| {name} | {value} | {value - baseline:+.2f} | {target} |")
    lines.append("")
    lines.append(f"Of the warm overhead, {statistics.median(imports):.2f} s is importing Prefect (`import prefect.flows` "
                 f"in a fresh interpreter, median); the rest is the flow run's API calls and the lease and health check.")
    lines.append("")
    lines.append(f"Medians of {args.repeats}, interleaved; load average {load:.1f} at the end on "
                 f"{os.cpu_count()} cores." if load is not None else f"Medians of {args.repeats}, interleaved.")
    save("cli_prefect_overhead", {"repeats": args.repeats, "seconds": times, "medians": medians,
                                  "import_prefect_s": imports, "load": load})
    publish("cli_prefect_overhead", lines, args.readme)


if __name__ == "__main__":
    main()
