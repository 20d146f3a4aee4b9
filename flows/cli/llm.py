"""The LLM endpoints a command needs: started from the packaged model when asked and nothing answers,
else one line saying how to start one (issue 24.3)."""
from __future__ import annotations

import contextlib
import sys

from ragline.flows.errors import DependencyUnavailable
from ragline.flows.terminal import printable


class LLMDown(DependencyUnavailable):
    """An LLM endpoint a command needs accepts no connection, and ragline is not to start it."""


def _llm_endpoints(project, pipelines=None) -> set[tuple[str, str]]:
    """(base_url, model) of the LLM resources the named pipelines use (all of the file's: None)."""
    used = None if pipelines is None else {name for p in pipelines for s in project.pipeline(p).steps
                                          for name in s.resources.values()}
    return {(spec.base_url, spec.model) for name, spec in project.spec.resources.items()
            if getattr(spec, "type", None) == "openai_compatible" and (used is None or name in used)}


def _accepts_connections(base_url: str, timeout: float = 3.0) -> bool:
    """Something listens at the endpoint (a hung or busy server too: the pipeline's own checks say which)."""
    import socket
    from urllib.parse import urlsplit

    from ragline.flows.ops.llm_server import endpoint_port

    try:
        with socket.create_connection((urlsplit(base_url).hostname or "127.0.0.1", endpoint_port(base_url)),
                                      timeout=timeout):
            return True
    except OSError:
        return False


def _how_to_start(base_url: str, model: str, enabled: bool) -> str:
    """One line: the endpoint that is down and the command that starts one there."""
    from ragline.flows.ops.llm_server import PACKAGED_MODEL, endpoint_port, is_local, start_enabled

    down = f"the LLM endpoint {base_url} (model '{model}') did not answer: nothing accepts connections there"
    if not is_local(base_url):
        return (f"{down}; start that server, or point RAGLINE_LLM_BASE_URL at one that runs (the packaged "
                f"model runs here with `ragline serve`)")
    if model != PACKAGED_MODEL:
        return (f"{down}; start your server for '{model}' on port {endpoint_port(base_url)} (ragline starts only "
                f"the packaged model, '{PACKAGED_MODEL}')")
    if not (enabled and start_enabled()):
        return (f"{down}; start it with `VLLM_PORT={endpoint_port(base_url)} bash deploy/vllm/serve.sh`, or let "
                f"ragline start it (without --no-start-llm and RAGLINE_START_LLM=0)")
    return f"{down}, and the packaged LLM could not start there"


@contextlib.contextmanager
def packaged_llms(project, enabled: bool, pipelines=None, required: bool = True):
    """The packaged model on vLLM for each local LLM endpoint of ``pipelines`` that is down, for this
    command's life, as `quickstart` and `serve` do. An endpoint that is down and not ours to start
    (remote, another model, --no-start-llm) is ``LLMDown`` in one line when ``required``."""
    from ragline.flows.ops.llm_server import local_llm, should_start

    with contextlib.ExitStack() as stack:
        servers = []
        for base_url, model in sorted(_llm_endpoints(project, pipelines)):
            if _accepts_connections(base_url):
                continue
            why: list[str] = []
            server = None
            if should_start(base_url, model, enabled=enabled, say=lambda line: None):
                def say(line: str) -> None:
                    if line.startswith("could not start"):
                        why.append(line)  # it becomes the error's end
                    else:
                        print(printable(line), file=sys.stderr, flush=True)

                server = stack.enter_context(local_llm(base_url, model, enabled=enabled, say=say))
            if server is not None:
                servers.append(server)
            elif required:
                raise LLMDown(_how_to_start(base_url, model, enabled) + "".join(f": {line}" for line in why))
            for line in why:  # quickstart searches without an LLM: the reason, in one line
                print(printable(line), file=sys.stderr, flush=True)
        yield servers


def api_llms(project, enabled: bool, stack: contextlib.ExitStack, command: str = "ragline api") -> None:
    """`ragline api`'s LLMs, as `serve`'s: the packaged one started in the background and supervised
    (/readyz reports it until it answers); any other endpoint that is down is one line, and the API
    serves search meanwhile."""
    from ragline.flows.ops.llm_server import ManagedLLM, PACKAGED_MODEL, should_start

    def say(line: str) -> None:
        print(printable(f"{command}: {line}"), file=sys.stderr, flush=True)

    for base_url, model in sorted(_llm_endpoints(project)):
        if _accepts_connections(base_url):
            continue
        if should_start(base_url, model, enabled=enabled, say=lambda line: None):
            say(f"starting the packaged LLM ({PACKAGED_MODEL} on vLLM) at {base_url} in the background "
                f"(--no-start-llm to skip); /readyz reports it until it answers")
            stack.callback(ManagedLLM(base_url, say=say).start().stop)
        else:
            say(f"warning: {_how_to_start(base_url, model, enabled)}; answers fail until it runs")
