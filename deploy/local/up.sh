#!/usr/bin/env bash
# The production topology on one machine, without containers (see deploy/README.md):
#   PostgreSQL -> Prefect API server (--no-services) + Prefect services -> Chroma server ->
#   Dask scheduler + worker(s) -> `ragline serve` (the deployments' runner + the HTTP API).
# All on 127.0.0.1. Pids in $RAGLINE_LOCAL_DIR/pids, logs in $RAGLINE_LOCAL_DIR/logs; stop with down.sh.
#
#   bash deploy/local/up.sh                       # deploy/local/pipelines.yaml over samples/docs
#   RAGLINE_PIPELINES=/path/pipelines.yaml RAGLINE_PORT=8100 bash deploy/local/up.sh
#
# Environment (defaults): RAGLINE_LOCAL_DIR (.ragline/local), RAGLINE_PIPELINES (a copy of deploy/local/pipelines.yaml
# in RAGLINE_LOCAL_DIR, indexing RAGLINE_DOCS, default samples/docs),
# RAGLINE_PG_PORT (54320), RAGLINE_PREFECT_PORT (4200), RAGLINE_CHROMA_PORT (8001),
# RAGLINE_DASK_PORT (8786), RAGLINE_DASK_DASHBOARD_PORT (8787), RAGLINE_DASK_WORKERS (1, processes),
# RAGLINE_PORT (8080, ragline's API), RAGLINE_API_TOKEN (none: loopback only), RAGLINE_LLM_BASE_URL
# (http://127.0.0.1:8002/v1: start one with `VLLM_PORT=8002 bash deploy/vllm/serve.sh`), RAGLINE_UP_TIMEOUT (180 s
# per service). No `prefect worker` is started: `ragline serve` is the runner of its own deployments.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${RAGLINE_VENV:-$REPO/.venv}/bin
DIR=$(mkdir -p "${RAGLINE_LOCAL_DIR:-$REPO/.ragline/local}" && cd "${RAGLINE_LOCAL_DIR:-$REPO/.ragline/local}" && pwd)
if [ -n "${RAGLINE_PIPELINES:-}" ]; then
  PIPELINES=$(readlink -f "$RAGLINE_PIPELINES")   # its indexes (BM25, state, results) live beside it, as usual
else  # a copy of the template in $DIR, so its .ragline/ (BM25, state, results) is ours; no --data-dir: that
  PIPELINES=$DIR/pipelines.yaml                   # would replace the Chroma server by an embedded store
  cp "$REPO/deploy/local/pipelines.yaml" "$PIPELINES"
  export RAGLINE_DOCS=${RAGLINE_DOCS:-$REPO/samples/docs}
fi
HOST=127.0.0.1
PG_PORT=${RAGLINE_PG_PORT:-54320}
PREFECT_PORT=${RAGLINE_PREFECT_PORT:-4200}
CHROMA_PORT_=${RAGLINE_CHROMA_PORT:-8001}
DASK_PORT=${RAGLINE_DASK_PORT:-8786}
DASK_DASH_PORT=${RAGLINE_DASK_DASHBOARD_PORT:-8787}
DASK_WORKERS=${RAGLINE_DASK_WORKERS:-1}
API_PORT=${RAGLINE_PORT:-8080}
TIMEOUT=${RAGLINE_UP_TIMEOUT:-180}
PIDS=$DIR/pids LOGS=$DIR/logs
mkdir -p "$PIDS" "$LOGS" "$DIR/run"

bash "$REPO/deploy/local/install.sh" >/dev/null
PG_BIN=$(bash "$REPO/deploy/local/install.sh" | sed -n 's/^postgres binaries: //p')
[ -x "$BIN/ragline" ] || { echo "no ragline in $BIN: run deploy/bootstrap.sh first" >&2; exit 1; }
"$BIN/python" -c "import asyncpg" 2>/dev/null || { echo "asyncpg is missing from $BIN (Prefect's Postgres driver)" >&2; exit 1; }

export OMP_WAIT_POLICY=PASSIVE DO_NOT_TRACK=1 ANONYMIZED_TELEMETRY=False
export PREFECT_HOME=$DIR/prefect PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_API_URL=http://$HOST:$PREFECT_PORT/api
export CHROMA_HOST=$HOST CHROMA_PORT=$CHROMA_PORT_ DASK_SCHEDULER_ADDRESS=tcp://$HOST:$DASK_PORT
export RAGLINE_LLM_BASE_URL=${RAGLINE_LLM_BASE_URL:-http://127.0.0.1:8002/v1}

log() { echo "[up] $*"; }
fail() { echo "[up] $*" >&2; exit 1; }
# start NAME CMD...: a new session (its own process group, which down.sh signals), output to logs/NAME.log
start() {
  local name=$1; shift
  if [ -f "$PIDS/$name.pid" ] && kill -0 "$(cat "$PIDS/$name.pid")" 2>/dev/null; then
    log "$name already running (pid $(cat "$PIDS/$name.pid"))"; return 0
  fi
  setsid "$@" >>"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$PIDS/$name.pid"
}
# wait_for NAME CHECK...: until CHECK succeeds; fails early if NAME's process died
wait_for() {
  local name=$1; shift
  local deadline=$((SECONDS + TIMEOUT))
  until "$@" >/dev/null 2>&1; do
    if [ -f "$PIDS/$name.pid" ] && ! kill -0 "$(cat "$PIDS/$name.pid")" 2>/dev/null; then
      tail -n 30 "$LOGS/$name.log" >&2; fail "$name exited (log: $LOGS/$name.log)"
    fi
    [ $SECONDS -lt $deadline ] || { tail -n 30 "$LOGS/$name.log" >&2; fail "$name not healthy after ${TIMEOUT}s"; }
    sleep 0.5
  done
  log "$name healthy"
}
http_ok() { curl -fsS -m 5 -o /dev/null "$1"; }

# --- PostgreSQL: our own cluster in $DIR/pg (postgres refuses to run as root: then it runs as `postgres`)
PGDATA=$DIR/pg
as_pg() { "$@"; }
if [ "$(id -u)" = 0 ]; then
  id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/false postgres
  as_pg() { runuser -u postgres -- "$@"; }
  chown postgres "$DIR/run"
  as_pg test -x "$DIR" || fail "user postgres cannot enter $DIR: make it and its parents world-executable (chmod o+x)"
fi
if [ ! -s "$DIR/pg.password" ]; then
  (umask 077; "$BIN/python" -c "import secrets; print(secrets.token_urlsafe(24))" > "$DIR/pg.password")
fi
PG_PASSWORD=$(cat "$DIR/pg.password")
if [ ! -f "$PGDATA/PG_VERSION" ]; then
  mkdir -p "$PGDATA"
  pwfile=$DIR/run/pwfile; (umask 077; echo "$PG_PASSWORD" > "$pwfile")
  if [ "$(id -u)" = 0 ]; then chown postgres "$PGDATA" "$pwfile"; fi
  as_pg "$PG_BIN/initdb" -D "$PGDATA" -U ragline --pwfile="$pwfile" --auth=scram-sha-256 -E UTF8 \
    --locale=C.UTF-8 >"$LOGS/initdb.log" 2>&1 || { cat "$LOGS/initdb.log" >&2; fail "initdb failed"; }
  rm -f "$pwfile"
fi
export PGPASSWORD=$PG_PASSWORD
if ! "$PG_BIN/pg_isready" -q -h $HOST -p "$PG_PORT"; then
  touch "$LOGS/postgres.log"; [ "$(id -u)" != 0 ] || chown postgres "$LOGS/postgres.log"
  as_pg "$PG_BIN/pg_ctl" -D "$PGDATA" -l "$LOGS/postgres.log" -w -t "$TIMEOUT" start \
    -o "-c listen_addresses=$HOST -p $PG_PORT -c unix_socket_directories=$DIR/run" >/dev/null \
    || { tail -n 20 "$LOGS/postgres.log" >&2; fail "postgres did not start"; }
fi
head -n 1 "$PGDATA/postmaster.pid" > "$PIDS/postgres.pid"
wait_for postgres "$PG_BIN/psql" -h $HOST -p "$PG_PORT" -U ragline -d postgres -tAc "select 1"
if [ "$("$PG_BIN/psql" -h $HOST -p "$PG_PORT" -U ragline -d postgres -tAc "select 1 from pg_database where datname='prefect'")" != 1 ]; then
  "$PG_BIN/psql" -q -h $HOST -p "$PG_PORT" -U ragline -d postgres -c "create database prefect"
fi
export PREFECT_API_DATABASE_CONNECTION_URL="postgresql+asyncpg://ragline:$PG_PASSWORD@$HOST:$PG_PORT/prefect"

# --- Prefect: the API server (migrates the database) without services, then the services in their own process
start prefect-server "$BIN/prefect" server start --host $HOST --port "$PREFECT_PORT" --no-services --analytics-off
wait_for prefect-server http_ok "$PREFECT_API_URL/health"
start prefect-services "$BIN/prefect" server services start
# --- Chroma server
mkdir -p "$DIR/chroma"
start chroma "$BIN/chroma" run --path "$DIR/chroma" --host $HOST --port "$CHROMA_PORT"
# --- Dask: the scheduler, then workers (one process each, one thread: the embedder is the heavy part)
start dask-scheduler "$BIN/dask" scheduler --host $HOST --port "$DASK_PORT" --dashboard-address "$HOST:$DASK_DASH_PORT"
wait_for chroma http_ok "http://$HOST:$CHROMA_PORT/api/v2/heartbeat"
wait_for dask-scheduler http_ok "http://$HOST:$DASK_DASH_PORT/health"
start dask-worker "$BIN/dask" worker "$DASK_SCHEDULER_ADDRESS" --host $HOST --nworkers "$DASK_WORKERS" --nthreads 1 \
  --local-directory "$DIR/dask" --no-dashboard
dask_workers() { curl -fsS -m 5 "http://$HOST:$DASK_DASH_PORT/json/counts.json" | "$BIN/python" -c \
  "import json,sys; sys.exit(0 if json.load(sys.stdin)['workers'] >= $DASK_WORKERS else 1)"; }
wait_for dask-worker dask_workers
wait_for prefect-services true   # still alive?
# --- ragline serve: applies the deployments, runs them (the runner), serves the API
start ragline "$BIN/ragline" serve -f "$PIPELINES" --host $HOST --port "$API_PORT" --no-start-llm
wait_for ragline http_ok "http://$HOST:$API_PORT/healthz"
ready=$(curl -sS -m 30 "http://$HOST:$API_PORT/readyz" || true)
log "readyz: $ready"
cat <<MSG
[up] Prefect dashboard: http://$HOST:$PREFECT_PORT   (API $PREFECT_API_URL, database postgres://$HOST:$PG_PORT/prefect)
[up] ragline API:       http://$HOST:$API_PORT/docs   (pipelines $PIPELINES)
[up] Chroma:            http://$HOST:$CHROMA_PORT     Dask: $DASK_SCHEDULER_ADDRESS (status http://$HOST:$DASK_DASH_PORT/json/counts.json)
[up] logs: $LOGS   stop: bash $REPO/deploy/local/down.sh
MSG
