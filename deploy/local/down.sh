#!/usr/bin/env bash
# Stop what deploy/local/up.sh started, in reverse order: SIGTERM to each process group, wait, SIGKILL only
# what is still there after RAGLINE_DOWN_GRACE seconds (20); PostgreSQL with `pg_ctl stop -m fast`.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
DIR=${RAGLINE_LOCAL_DIR:-$REPO/.ragline/local}
PIDS=$DIR/pids
GRACE=${RAGLINE_DOWN_GRACE:-20}
[ -d "$PIDS" ] || { echo "[down] nothing to stop ($PIDS does not exist)"; exit 0; }
stop_group() {  # NAME: the process group (session) started by up.sh's setsid
  local name=$1 file=$PIDS/$1.pid pid
  [ -f "$file" ] || return 0
  pid=$(cat "$file")
  if kill -0 -- "-$pid" 2>/dev/null; then
    kill -TERM -- "-$pid" 2>/dev/null
    local deadline=$((SECONDS + GRACE))
    while kill -0 -- "-$pid" 2>/dev/null && [ $SECONDS -lt $deadline ]; do sleep 0.2; done
    if kill -0 -- "-$pid" 2>/dev/null; then
      echo "[down] $name still running after ${GRACE}s: SIGKILL"; kill -KILL -- "-$pid" 2>/dev/null
    fi
    echo "[down] stopped $name"
  fi
  rm -f "$file"
}
for name in ragline dask-worker dask-scheduler chroma prefect-services prefect-server; do stop_group "$name"; done
if [ -f "$DIR/pg/postmaster.pid" ]; then
  PG_BIN=$(bash "$REPO/deploy/local/install.sh" | sed -n 's/^postgres binaries: //p')
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$DIR/pg" -m fast -w stop >/dev/null
  else "$PG_BIN/pg_ctl" -D "$DIR/pg" -m fast -w stop >/dev/null; fi && echo "[down] stopped postgres"
fi
rm -f "$PIDS/postgres.pid"
