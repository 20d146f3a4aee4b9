"""`ragline search` and `ask`: answered by a running `ragline api`/`serve` of the project when there
is one (its models are loaded), else in this process; passages and answers printed with their sources."""
from __future__ import annotations

import json
import sys
from typing import Any

from ragline.flows.cli.common import (
    collection_flag, json_value, open_query_pipeline, orchestration_flags, plain, start_llm_flag)
from ragline.flows.cli.llm import packaged_llms
from ragline.flows.errors import EX_USAGE, RaglineError
from ragline.flows.terminal import printable


def register(command) -> None:
    """This module's commands and their flags (``command`` adds a subparser with the common ones)."""
    p = command("search", search, "Search the index and print ranked passages.")
    p.add_argument("question")
    p.add_argument("-p", "--pipeline", default="search")
    p.add_argument("-k", "--top", type=int, default=5, help="passages to print")
    p.add_argument("--where", type=json_value, help='metadata filter, e.g. \'{"format": "markdown"}\'')
    collection_flag(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    orchestration_flags(p, default=False)

    p = command("ask", ask, "Answer a question from the index, with citations (needs the LLM server).")
    p.add_argument("question")
    p.add_argument("-p", "--pipeline", default="ask")
    p.add_argument("--history", type=json_value, default=[],
                   help='earlier turns, e.g. \'[{"role": "user", "content": "..."}, {"role": "assistant", ...}]\'')
    p.add_argument("--where", type=json_value, help="metadata filter")
    collection_flag(p)
    p.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    p.add_argument("--json", action="store_true", help="print the whole answer object as JSON")
    orchestration_flags(p, default=False)
    start_llm_flag(p)


def search(args) -> int:
    from ragline.flows.run import engine

    pipeline = open_query_pipeline(args)
    query: dict[str, Any] = {"text": args.question, "filters": args.where, "collections": args.collection}
    passages = engine.run(pipeline, {"query": query}, orchestrate=args.orchestrate)
    print_passages([plain(p) for p in passages[: args.top]], args.json)
    return 0


def ask(args) -> int:
    from ragline.flows.run import engine

    pipeline = open_query_pipeline(args)
    streamed: list[str] = []

    def show(token: str) -> None:
        streamed.append(token)
        print(printable(token, keep_newlines=True), end="", flush=True)

    if args.stream:
        pipeline = pipeline.with_overrides({s.id: {"stream": True} for s in pipeline.steps
                                            if "stream" in s.stage.params.model_fields})
    query = {"text": args.question, "history": args.history, "filters": args.where, "collections": args.collection}
    with packaged_llms(pipeline.project, args.start_llm, [args.pipeline]):
        answer = engine.run(pipeline, {"query": query}, orchestrate=args.orchestrate,
                            on_token=show if args.stream and not args.json else None)
    print_answer(answer.model_dump(mode="json"), args.json, bool(streamed))
    return 0


def print_answer(answer: dict[str, Any], as_json: bool, streamed: bool) -> None:
    """An answer (``Answer`` as JSON, in-process or from the API): its text, or the refusal and its
    reason, then its numbered sources."""
    if as_json:
        print(json.dumps(answer, indent=2))
        return
    if streamed:
        print("\n")
        if answer["refused"] or answer.get("answered_by") == "evidence":
            print(printable(answer["text"], keep_newlines=True))
    else:
        print(printable(answer["text"], keep_newlines=True))
    if answer["refused"] and answer.get("reason"):
        print(printable(f"({answer['reason']})"))
    elif answer.get("answered_by") == "evidence":
        print(printable(f"(evidence answer{': ' + answer['reason'] if answer.get('reason') else ''})"))
    for source in [] if answer["refused"] else answer.get("sources", []):
        where = f" ({source['collection']})" if source.get("collection") else ""
        print(printable(f"[{source['number']}] {source.get('title') or source['source_id']} — {source.get('path')}"
                        f"{where}"))
    if answer.get("invalid_citations"):
        print(f"warning: citations with no matching reference: {answer['invalid_citations']}", file=sys.stderr)


def print_passages(passages: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps(passages, indent=2))
        return
    if not passages:
        print("no passages found")
    for rank, p in enumerate(passages, start=1):
        source = (p.get("metadata") or {}).get("source", p["source_id"])
        collection = (p.get("metadata") or {}).get("collection")
        source += f" ({collection})" if collection else ""
        print(f"{rank}. [{p['score']:.4f}] {printable(p.get('title') or p['source_id'])}\n   {printable(source)}")
        snippet = " ".join(p["text"].split())
        print(f"   {printable(snippet[:300])}{'…' if len(snippet) > 300 else ''}\n")


def answer_by_api(args) -> int | None:
    """`search` or `ask` answered by a running local `ragline api`/`serve` of this very project
    (``serve.discovery``): its models are loaded, so it answers in milliseconds where this process
    would load the embedder first. None: there is none to use (or it refused our token): run here."""
    if args.orchestrate or args.no_tuned:
        return None
    from ragline.flows.serve.supervise.discovery import find

    service, why = find(args.file, args.data_dir)
    if service is None:
        if why:
            print(printable(f"({why}: running in-process)"), file=sys.stderr)
        return None
    from ragline.flows import settings

    if service.tuned and not settings.project().tuned:  # RAGLINE_TUNED=0: the API's overlay is not wanted
        return None
    token = _client_token(service)
    if service.token_required and not token:
        print(printable(f"(the ragline API at {service.url} needs a token: set RAGLINE_API_TOKEN to use it; "
                        f"running in-process)"), file=sys.stderr)
        return None
    body: dict[str, Any] = {"question": args.question, "pipeline": args.pipeline, "filters": args.where}
    if args.collection:
        body["collections"] = args.collection
    if args.handler is search:
        body["top_k"] = args.top
    else:
        body["history"] = args.history
        body["stream"] = bool(args.stream and not args.json)
    try:
        response = _post(f"{service.url}/v1/query", body, token)
    except _Refused as refused:
        if refused.status == 401:
            print(printable(f"(the ragline API at {service.url} refused the token in RAGLINE_API_TOKEN: running "
                            f"in-process)"), file=sys.stderr)
            return None
        print(printable(f"error: {refused.message} (ragline API at {service.url})"), file=sys.stderr)
        return EX_USAGE if refused.status < 500 else 1
    except OSError as exc:  # not listening (yet), reset: this process can still answer
        print(printable(f"(the ragline API at {service.url} did not answer ({exc}): running in-process)"),
              file=sys.stderr)
        return None
    print(printable(f"(answered by the running ragline API at {service.url}, pid {service.pid})"), file=sys.stderr)
    with response:
        if body.get("stream"):
            return _print_stream(response)
        result = json.load(response)
    if args.handler is search:
        print_passages(result["passages"], args.json)
    else:
        print_answer(result["answer"], args.json, streamed=False)
    return 0


def _client_token(service) -> str | None:
    """The token the CLI sends: where `ragline api` reads its own (RAGLINE_API_TOKEN, through settings)."""
    from ragline.flows import settings

    return settings.auth().api_token or None


class _Refused(RaglineError):
    """The running API answered the query with an error status (its message; 401: not our token)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _post(url: str, body: dict[str, Any], token: str | None):
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    try:
        return urllib.request.urlopen(request, timeout=900)  # an answer may wait for a busy LLM
    except urllib.error.HTTPError as exc:
        with exc:
            try:
                message = json.load(exc)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {exc.code}"
        raise _Refused(exc.code, message) from None


def _print_stream(response) -> int:
    """The API's server-sent events: tokens as they come, then the answer (or its error)."""
    event, streamed = None, False
    for raw in response:
        line = raw.decode("utf-8", "replace").rstrip("\n")
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = json.loads(line[6:])
            if event == "token" and data is not None:
                streamed = True
                print(printable(data["text"], keep_newlines=True), end="", flush=True)
            elif event == "answer":
                print_answer(data["answer"], as_json=False, streamed=streamed)
                return 0
            elif event == "error":
                print(printable(f"error: {data['error']['message']}"), file=sys.stderr)
                return 1
    print("error: the ragline API's answer stream ended early", file=sys.stderr)
    return 1
