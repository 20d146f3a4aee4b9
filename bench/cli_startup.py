"""Start-up time of the ragline command as a user runs it (issue 24.5): wall time of the console
script for `--help`, `validate`, an `index` with nothing changed, `search` (cold: in-process,
loading the embedder; and answered by a running `ragline api` of the same project) and a cold
`ask -p ask_extractive`; and the peak RSS of each variant's process for the cold ones (issue 38.1).

Each figure is a ratio against a baseline measured in the same run, on the same machine, the
variants' runs interleaved (medians of ``--repeats``):
  - eager: the same command with the imports the CLI made eagerly before issue 24 (Prefect's
    server module, settings, compile, contracts, serve, spec, trafilatura, pypdf) loaded first;
  - cold: for `search` via the API, the same command with no API running (in-process, as before);
  - before (optional, ``--before COMMIT``): the same command from the code at COMMIT (``git archive``
    into a temporary folder put first on PYTHONPATH, so the same interpreter and packages run it).
Workspace: a copy of the repository's pipelines.yaml, samples/ and prompts/, indexed once (untimed).

Usage: .venv/bin/python bench/cli_startup.py [--repeats 5] [--before b32d279]
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
import urllib.request
from pathlib import Path

from common import REPO, publish, save
from ragline.flows.ops.llm_server import free_port

TOKEN = "bench-cli-token"
QUESTION = "What happens to a document that cannot be read?"
MAIN = "import sys\nfrom ragline.flows.cli import main\nsys.exit(main())"
EAGER = ("import sys, ragline.flows.ops.prefect_server, ragline.flows.settings, ragline.flows.spec.compile, "
         "ragline.flows.contracts, ragline.flows.serve, ragline.flows.spec, trafilatura, pypdf\n"
         "from ragline.flows.cli import main\nsys.exit(main())")
COMMANDS = {  # name: (arguments, target seconds or None)
    "--help": (["--help"], None),
    "validate": (["validate"], 2.0),
    "index (unchanged)": (["index", "--no-prefect"], 3.0),
    "search (cold, in-process)": (["search", QUESTION, "-k", "3"], 1.5),
    "ask -p ask_extractive (cold, in-process)": (["ask", "-p", "ask_extractive", QUESTION], 2.0),
}
RSS_TARGET_MB = {"search (cold, in-process)": 300}


def script(python: str) -> list[str]:
    return [str(Path(python).parent / "ragline")]


PEAK_RSS_MB: list[float] = []  # of every process `timed` ran, in order


def timed(command: list[str], cwd: Path, env: dict[str, str], repeats: int) -> list[float]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        with tempfile.TemporaryFile() as stderr:
            child = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
            _, status, usage = os.wait4(child.pid, 0)  # this child's own peak RSS (ru_maxrss, KiB on Linux)
            seconds.append(time.perf_counter() - started)
            child.returncode = os.waitstatus_to_exitcode(status)
            PEAK_RSS_MB.append(usage.ru_maxrss / 1024)
            if child.returncode != 0:
                stderr.seek(0)
                raise SystemExit(f"{' '.join(command)} exited {child.returncode}: {stderr.read()[-2000:].decode()}")
    return seconds


def checkout(commit: str, folder: Path) -> Path:
    """The package ``ragline`` as it was at ``commit``, importable from ``folder`` (PYTHONPATH)."""
    source = folder / "source"
    source.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit, "ragline", "flows", "tasks", "prompts"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
    package = folder / "path" / "ragline"
    package.mkdir(parents=True)
    shutil.copy(source / "ragline" / "__init__.py", package / "__init__.py")
    for name in ("flows", "tasks", "prompts"):
        (package / name).symlink_to(source / name)
    return folder / "path"


def compiled(*folders: Path) -> None:
    """Bytecode written for every variant's modules first: with PYTHONDONTWRITEBYTECODE set (as on
    this machine) a module changed since its .pyc was written is compiled again at every run, which
    is not what a user's installation does."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", *map(str, folders)], check=True,
                   stdout=subprocess.DEVNULL)


def workspace(root: Path, env: dict[str, str]) -> Path:
    root.mkdir()
    shutil.copy(REPO / "pipelines.yaml", root / "pipelines.yaml")
    shutil.copytree(REPO / "samples", root / "samples")
    shutil.copytree(REPO / "prompts", root / "prompts")
    timed(script(sys.executable) + ["index", "--no-prefect"], root, env, 1)  # the first build, untimed
    return root


def running_api(root: Path, env: dict[str, str]) -> subprocess.Popen:
    port = free_port()
    api = subprocess.Popen(script(sys.executable) + ["api", "--port", str(port)], cwd=root, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).close()
            return api
        except OSError:
            if api.poll() is not None:
                raise SystemExit(f"ragline api exited {api.returncode}")
            time.sleep(0.3)
    api.kill()
    raise SystemExit("ragline api did not start")


def median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--before", metavar="COMMIT", help="also time the code at this commit (e.g. the branch's base)")
    args = parser.parse_args()
    env = {**os.environ, "RAGLINE_API_TOKEN": TOKEN, "RAGLINE_START_LLM": "0"}
    env.pop("PREFECT_API_URL", None)
    results: dict[str, dict[str, float]] = {}
    peaks: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="ragline-cli-bench-") as folder:
        root = workspace(Path(folder) / "project", env)
        before_env = {**env, "PYTHONPATH": str(checkout(args.before, Path(folder) / "before"))} if args.before else None
        compiled(*(REPO / name for name in ("flows", "tasks", "ragline")),
                 *([Path(folder) / "before" / "source"] if args.before else []))
        for name, (arguments, target) in COMMANDS.items():
            is_cold = "cold" in name
            repeats = max(2, args.repeats // 2) if is_cold and not target else args.repeats
            variants = {"after_s": (script(sys.executable) + arguments, env),
                        "eager_s": ([sys.executable, "-c", EAGER, *arguments], env)}
            if before_env:
                variants["before_s"] = ([sys.executable, "-c", MAIN, *arguments], before_env)
            times: dict[str, list[float]] = {key: [] for key in variants}
            rss: dict[str, list[float]] = {key: [] for key in variants}
            for _ in range(repeats):  # interleaved (A B C A B C ...): the machine's drift hits every variant alike
                for key, (command, variant_env) in variants.items():
                    times[key] += timed(command, root, variant_env, 1)
                    rss[key].append(PEAK_RSS_MB[-1])
            row = {key: median(values) for key, values in times.items()}
            if is_cold:
                peaks[name] = {key.replace("_s", "_mb"): round(statistics.median(values)) for key, values in rss.items()}
            results[name] = {**row, "target_s": target} if target else row
        cold = results["search (cold, in-process)"]["after_s"]
        api = running_api(root, env)
        try:
            timed(script(sys.executable) + COMMANDS["search (cold, in-process)"][0], root, env, 1)  # its models load
            via = timed(script(sys.executable) + COMMANDS["search (cold, in-process)"][0], root, env, args.repeats)
        finally:
            api.terminate()
            api.wait(30)
        results["search (via a running ragline api)"] = {"after_s": median(via), "cold_s": cold, "target_s": 1.0}
    lines = ["| command | after (s) | baseline (s) | baseline / after | target |", "|---|---:|---:|---:|---:|"]
    for name, row in results.items():
        baselines = [(key.removesuffix("_s"), row[key]) for key in ("eager_s", "cold_s", "before_s") if key in row]
        for label, value in baselines:
            lines.append(f"| {name} | {row['after_s']} | {value} ({label}) | {value / row['after_s']:.1f}x | "
                         f"{'< %g s' % row['target_s'] if row.get('target_s') else ''} |")
    for name, row in peaks.items():
        for key in ("eager_mb", "before_mb"):
            if key in row:
                target = f"< {RSS_TARGET_MB[name]} MB" if name in RSS_TARGET_MB else ""
                lines.append(f"| {name}: peak RSS (MB) | {row['after_mb']} | {row[key]} ({key.removesuffix('_mb')}) | "
                             f"{row[key] / row['after_mb']:.1f}x | {target} |")
    save("cli_startup", {"repeats": args.repeats, "before": args.before, "results": results, "peak_rss_mb": peaks})
    publish("cli_startup", lines)


if __name__ == "__main__":
    main()
