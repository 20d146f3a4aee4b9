#!/usr/bin/env bash
# Install Debian's PostgreSQL server binaries when they are missing (for deploy/local/up.sh).
# Idempotent: does nothing when initdb/pg_ctl are found. Needs root (or sudo) for apt-get only;
# no cluster is created or started here (up.sh initialises its own, under its own folder).
set -euo pipefail
find_pg_bin() {
  if [ -n "${PG_BIN:-}" ] && [ -x "$PG_BIN/pg_ctl" ]; then echo "$PG_BIN"; return 0; fi
  local d
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r); do
    [ -x "$d/pg_ctl" ] && [ -x "$d/initdb" ] && { echo "$d"; return 0; }
  done
  command -v pg_ctl >/dev/null 2>&1 && command -v initdb >/dev/null 2>&1 && { dirname "$(readlink -f "$(command -v pg_ctl)")"; return 0; }
  return 1
}
if bin=$(find_pg_bin); then echo "postgres binaries: $bin"; exit 0; fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  command -v sudo >/dev/null 2>&1 || { echo "postgresql is not installed and this is not root (no sudo): install it with apt-get install postgresql" >&2; exit 1; }
  SUDO="sudo -n"
fi
export DEBIAN_FRONTEND=noninteractive
# Debian's package may also create a system cluster (port 5432): up.sh does not use it (its own cluster,
# own port, own folder).
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends postgresql postgresql-client >/dev/null
bin=$(find_pg_bin) || { echo "postgresql installed but no pg_ctl found" >&2; exit 1; }
echo "postgres binaries: $bin"
