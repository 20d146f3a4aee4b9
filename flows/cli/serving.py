"""`ragline api`, `mcp`, `serve`, `keys` and `prefect`: the HTTP API, MCP over stdio, the supervised
service with its deployments, the API keys, and ragline's local Prefect server."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from ragline.flows.cli.common import API_PORT, api_token, keep_days, open_project, port_number, positive, start_llm_flag
from ragline.flows.cli.llm import api_llms


def _listen_flags(p) -> None:
    """Where `api` and `serve` listen and the token they want."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=API_PORT, help=f"default {API_PORT} (the LLM endpoint has 8000)")
    p.add_argument("--token",
                   help="bearer token, required off loopback (prefer RAGLINE_API_TOKEN: flags show in ps)")


def register(command) -> None:
    """This module's commands and their flags (``command`` adds a subparser with the common ones)."""
    p = command("api", api, "Serve the HTTP API: queries, OpenAI-compatible chat, documents (uploads ingested in this "
                             "process), health (OpenAPI at /docs).")
    _listen_flags(p)
    p.add_argument("--max-body-bytes", type=int, default=1_000_000)
    p.add_argument("--cors-origin", action="append", default=[], help="allow this browser origin (CORS is off)")
    start_llm_flag(p)

    p = command("mcp", mcp, "Serve the project to an MCP client over stdio (Claude Desktop, Cursor): tools search, "
                             "ask, list_collections, get_passage, list_documents and documents as resources, as the "
                             "local operator (every collection and document). Over HTTP: /mcp of `api` and `serve`.")
    start_llm_flag(p)

    p = command("serve", serve, "Serve every pipeline as a Prefect deployment (schedules included) plus the "
                                 "HTTP API, in one supervised process.")
    _listen_flags(p)
    p.add_argument("--no-api", action="store_true", help="serve the deployments only")
    p.add_argument("--start-prefect", action="store_true",
                   help="start a local Prefect server when PREFECT_API_URL is not set")
    p.add_argument("--poll-seconds", type=positive(float), default=2.0,
                   help="how often the runner looks for new runs")
    p.add_argument("--limit", type=positive(int), help="flow runs at once (default: PREFECT_RUNNER_PROCESS_LIMIT, 5)")
    p.add_argument("--keep-schedules", action="store_true", help="do not pause schedules when serve stops")
    p.add_argument("--serve-jobs", action="store_true", default=None,
                   help="also deploy job pipelines (tune, adapt, summarize) that declare no schedule "
                        "(RAGLINE_SERVE_JOBS); without it they have no deployment to start")
    p.add_argument("--keep-results-days", type=keep_days, default=30.0, metavar="DAYS",
                   help="delete served runs' JSON results older than this (at start, then hourly); 0: keep all")
    p.add_argument("--cold-runs", action="store_true",
                   help="start each flow run in a fresh interpreter (Prefect's way) instead of forking it from "
                        "a process that imported Prefect, ragline and the project's libraries once")
    start_llm_flag(p)

    register_keys(command)
    p = command("prefect", prefect, "Show or stop ragline's local Prefect server (shared by commands until "
                                     "RAGLINE_PREFECT_IDLE_SECONDS pass unused).")
    p.add_argument("action", choices=("status", "stop"))


def api(args) -> int:
    from ragline.flows.serve.app import serve_api
    from ragline.flows.serve.routers.documents import api_documents

    with contextlib.ExitStack() as stack:
        api_llms(open_project(args), args.start_llm, stack)
        documents, upload_limits = api_documents(args.file, data_dir=args.data_dir)  # runs ingest in-process
        serve_api(args.file, host=args.host, port=args.port, token=api_token(args), data_dir=args.data_dir,
                  max_body_bytes=args.max_body_bytes, cors_origins=args.cors_origin, routers=[documents],
                  body_limits=upload_limits)
    return 0


def mcp(args) -> int:
    from ragline.flows.serve.mcp import serve_stdio

    with contextlib.ExitStack() as stack:  # stdout is the protocol's: every line of ours goes to stderr
        api_llms(open_project(args), args.start_llm, stack, command="ragline mcp")
        serve_stdio(args.file, data_dir=args.data_dir)
    return 0


def serve(args) -> int:
    from ragline.flows.serve.supervise.service import serve

    # the packaged LLM is started (and supervised) by serve, once every argument and port checked out
    return serve(args.file, api=not args.no_api, host=args.host, port=args.port, token=api_token(args),
                 start_prefect=args.start_prefect, data_dir=args.data_dir, poll_seconds=args.poll_seconds,
                 limit=args.limit, pause_on_shutdown=not args.keep_schedules,
                 keep_results_days=args.keep_results_days or None, start_llm=args.start_llm,
                 warm_runs=not args.cold_runs, serve_jobs=args.serve_jobs)


def prefect(args) -> int:
    from ragline.flows.ops import prefect_server

    print(prefect_server.stop_shared_server() if args.action == "stop" else prefect_server.describe_shared_server())
    return 0


def register_keys(command) -> None:
    from ragline.flows.serve.auth.scopes import SCOPES

    p = command("keys", keys, "Manage the API keys of this project's `ragline api`/`serve` (kept hashed in "
                               "<data dir>/.ragline/keys.json; a running server sees changes on the next request).")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = actions.add_parser("create", help="create a key and print it (once: it is never shown again)")
    create.add_argument("--name", required=True, help="who or what uses the key")
    create.add_argument("--scope", action="append", required=True, choices=SCOPES,
                        help="what the key may do (repeat; admin implies all)")
    create.add_argument("--collection", action="append", required=True, metavar="NAME",
                        help="a Chroma collection the key may use (repeat), or * for all")
    create.add_argument("--group", action="append", default=[], help="a group of the key's holder (document ACLs)")
    create.add_argument("--expires", default="90d", help="lifetime: 12h, 90d, 4w (default 90d, at most 365d)")
    listing = actions.add_parser("list", help="every key: id, name, rights, expiry, status (never a secret)")
    listing.add_argument("--json", action="store_true", help="print JSON")
    revoke = actions.add_parser("revoke", help="refuse a key from the next request on")
    revoke.add_argument("id")
    rotate = actions.add_parser("rotate", help="a new secret for a key (same rights); the old one is refused")
    rotate.add_argument("id")
    rotate.add_argument("--expires", help="new lifetime (default: as long as the key was made to live)")


def keys(args) -> int:
    from ragline.flows.serve.auth.keys import KeyStore, describe, keys_file, parse_lifetime

    store = KeyStore(keys_file(args.data_dir or Path(args.file).resolve().parent))
    if args.action == "create":
        record, key = store.create(args.name, args.scope, args.collection, args.group, parse_lifetime(args.expires))
        print(f"created key {record.id} ({record.name}), expires {record.expires.isoformat()}; store it now, it "
              f"is not shown again:", file=sys.stderr)
        print(key)
    elif args.action == "list":
        rows = [describe(k) for k in store.list()]
        if args.json:
            print(json.dumps(rows, indent=2))
        for row in [] if args.json else rows:
            print(f"{row['id']}  {row['status']:<7}  {row['name']}  scopes={','.join(row['scopes'])}  "
                  f"collections={','.join(row['collections'])}  groups={','.join(row['groups']) or '-'}  "
                  f"expires={row['expires']}")
    elif args.action == "revoke":
        record = store.revoke(args.id)
        print(f"revoked key {record.id} ({record.name})")
    else:
        record, key = store.rotate(args.id, parse_lifetime(args.expires) if args.expires else None)
        print(f"rotated key {record.id} ({record.name}): the old secret is refused from now; new key, "
              f"expires {record.expires.isoformat()}:", file=sys.stderr)
        print(key)
    return 0
