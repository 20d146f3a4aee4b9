"""What Prefect mode adds to a CLI command (issue 22 item 5): wall time of `ragline index` over an
unchanged folder (the shipped pipelines.yaml over samples/, indexed once, untimed), with no
`PREFECT_API_URL` set, in these variants measured in the same run, interleaved (medians of ``--repeats``):

  - in-process: `index --no-prefect`, the baseline;
  - shared, cold: the first command after `ragline prefect stop`: it starts the shared server;
  - shared, warm: the next command, which reuses it;
  - with ``--per-command``: `RAGLINE_PREFECT_IDLE_SECONDS=0`, each command starts ragline's local
    Prefect API and stops it on exit (the behaviour before the shared server);
and, to tell what the warm overhead is made of, a fresh interpreter that only imports Prefect's
flow engine (a cost every Prefect-mode command pays, server or not).

``--baseline DIR``: the same variants for another revision too, interleaved with this one's (DIR holds
that revision's ``ragline/`` package, e.g. ``git archive REV`` unpacked, with ``ragline/flows``,
``ragline/tasks``, ``ragline/prompts`` linked to its folders; it goes first on PYTHONPATH; its name
labels its columns): before/after figures under the same load.

The overhead column is the variant's median minus the same code's in-process median; the target is
warm <= 3 s. Every variant uses one temporary RAGLINE_HOME whose Prefect database is created before timing.

Usage: .venv/bin/python bench/cli_prefect_overhead.py [--repeats 3] [--per-command] [--baseline DIR] [--no-readme]
"""
from __future__ import annotations

import argparse
import os
import resource
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
IN_PROCESS, COLD, WARM, PER_COMMAND = ("in-process (--no-prefect)", "shared server, cold (starts it)",
                                       "shared server, warm (reuses it)", "per-command server (idle 0)")


CPU: dict[str, float] = {}  # the last command's CPU seconds (user + system, the command and the children it reaped)


def ragline(arguments: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, str]:
    """Run the console script; returns its wall time and stderr (a failure ends the benchmark); its
    CPU time goes to ``CPU["last"]``: what its wall time would be on an idle machine, near enough."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([str(Path(sys.executable).parent / "ragline"), *arguments], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU["last"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
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


def measure(times: dict[str, list[float]], cpu: dict[str, list[float]], root: Path, env: dict[str, str],
            per_command: bool) -> None:
    """One round of every variant for one revision (its environment): wall and CPU seconds."""
    ragline(["prefect", "stop"], root, env)
    commands = [(COLD, INDEX, env, "Prefect API: started"), (WARM, INDEX, env, "Prefect API: reusing"),
                (IN_PROCESS, INDEX + ["--no-prefect"], env, "")]
    if per_command:
        commands.append((PER_COMMAND, INDEX, {**env, "RAGLINE_PREFECT_IDLE_SECONDS": "0"}, ""))
    for name, arguments, variant_env, expected in commands:
        seconds, said = ragline(arguments, root, variant_env)
        assert expected in said, said
        times[name].append(seconds)
        cpu[name].append(CPU["last"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--per-command", action="store_true", help="also time a server started per command")
    parser.add_argument("--baseline", type=Path, help="another revision's package root, measured beside this one")
    parser.add_argument("--no-readme", dest="readme", action="store_false", help="print the table only")
    args = parser.parse_args()
    variants = [IN_PROCESS, COLD, WARM] + ([PER_COMMAND] if args.per_command else [])
    revisions = {"this tree": None} if args.baseline is None else {
        f"baseline {args.baseline.name}": args.baseline.resolve(), "this tree": None}
    times = {rev: {name: [] for name in variants} for rev in revisions}
    cpu = {rev: {name: [] for name in variants} for rev in revisions}
    imports: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ragline-prefect-bench-") as folder:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(RAGLINE_HOME=str(Path(folder) / "home"), PREFECT_HOME=str(Path(folder) / "prefect-home"),
                   PREFECT_PROFILES_PATH=str(Path(folder) / "profiles.toml"), RAGLINE_START_LLM="0",
                   RAGLINE_PREFECT_IDLE_SECONDS="600")
        envs = {rev: env if path is None else {**env, "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(path), env.get("PYTHONPATH")]))} for rev, path in revisions.items()}
        root = workspace(Path(folder) / "project", env)
        try:
            for _ in range(args.repeats):  # interleaved: the machine's drift hits every variant alike
                for rev in revisions:
                    measure(times[rev], cpu[rev], root, envs[rev], args.per_command)
                started = time.perf_counter()
                subprocess.run([sys.executable, "-c", "import prefect.flow_engine"], env=env, check=True)
                imports.append(time.perf_counter() - started)
        finally:
            ragline(["prefect", "stop"], root, env)
    medians = {rev: {name: round(statistics.median(values), 2) for name, values in by.items()}
               for rev, by in times.items()}
    cpu_medians = {rev: {name: round(statistics.median(values), 2) for name, values in by.items()}
                   for rev, by in cpu.items()}
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    columns = list(revisions)
    lines = ["| `ragline index`, unchanged folder | " + " | ".join(
                 f"{rev}: wall (s) | over in-process | CPU (s) | over in-process" for rev in columns) + " | target |",
             "|---|" + "---:|---:|---:|---:|" * len(columns) + "---:|"]
    for name in variants:
        cells = []
        for rev in columns:
            for table in (medians, cpu_medians):
                value = table[rev][name]
                cells += [f"{value}", "" if name == IN_PROCESS else f"{value - table[rev][IN_PROCESS]:+.2f}"]
        target = f"<= {TARGET_S:g} s" if name == WARM else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {target} |")
    lines.append("")
    lines.append("CPU: the command's user + system seconds (a shared server's own work is not counted): close to "
                 "its wall time on an idle machine, where a loaded one multiplies every wall time.")
    lines.append("")
    lines.append(f"A fresh interpreter's `import prefect.flow_engine` (what every Prefect-mode command imports, "
                 f"server or not): {statistics.median(imports):.2f} s (median).")
    lines.append("")
    lines.append(f"Medians of {args.repeats}, interleaved; load average {load:.1f} at the end on "
                 f"{os.cpu_count()} cores." if load is not None else f"Medians of {args.repeats}, interleaved.")
    save("cli_prefect_overhead", {"repeats": args.repeats, "seconds": times, "medians": medians,
                                  "cpu_seconds": cpu, "cpu_medians": cpu_medians,
                                  "import_prefect_s": imports, "load": load,
                                  "baseline": str(args.baseline) if args.baseline else None})
    publish("cli_prefect_overhead", lines, args.readme)


if __name__ == "__main__":
    main()
