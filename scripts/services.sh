#!/usr/bin/env bash
# Makes sure Redis (>= 6.0) and PostgreSQL answer on 127.0.0.1, starting them from the installed
# packages (and installing them with apt-get when absent), and that chromium (the console's
# browser tests) is installed. Fails loudly: it never lets the tests
# skip a service that is missing.
set -euo pipefail

REDIS_PORT=${REDIS_PORT:-6379}
PG_PORT=${PG_PORT:-5432}

LOG_NAME=services
# shellcheck source=apt.sh
. "$(dirname "${BASH_SOURCE[0]}")/apt.sh"

wait_for() { # name, tries, command...
  local name=$1 tries=$2; shift 2
  for _ in $(seq "$tries"); do
    if "$@" >/dev/null 2>&1; then log "$name is up"; return 0; fi
    sleep 0.5
  done
  die "$name did not come up"
}

ensure_redis() {
  if ! command -v redis-server >/dev/null; then apt_install redis-server; fi
  if ! redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping >/dev/null 2>&1; then
    log "starting redis-server on 127.0.0.1:$REDIS_PORT"
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log --maxmemory-policy noeviction \
      || die "redis-server failed to start"
  fi
  wait_for redis 60 redis-cli -h 127.0.0.1 -p "$REDIS_PORT" ping
}

ensure_postgres() {
  if ! command -v pg_ctlcluster >/dev/null && ! command -v psql >/dev/null; then
    apt_install postgresql
  fi
  if ! pg_isready -h 127.0.0.1 -p "$PG_PORT" >/dev/null 2>&1; then
    log "starting PostgreSQL"
    if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
      pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -1)" main start \
        || die "pg_ctlcluster failed"
    else
      die "no PostgreSQL cluster to start (install the postgresql package)"
    fi
  fi
  wait_for postgres 120 pg_isready -h 127.0.0.1 -p "$PG_PORT"
  # The tests use database "test" (trust auth); create it when this machine lacks it.
  if ! psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d test -Atc 'select 1' >/dev/null 2>&1; then
    psql -h 127.0.0.1 -p "$PG_PORT" -U postgres -d postgres -c 'create database test' >/dev/null \
      || die "cannot create database test"
  fi
}

# The README's sessions run in bash with curl and jq (server/readme_test.go).
ensure_tools() {
  local missing=()
  for t in curl jq; do command -v "$t" >/dev/null || missing+=("$t"); done
  if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi
}

# The console's browser tests (server/console_browser_test.go) drive Debian's chromium headless.
ensure_chromium() {
  if ! command -v chromium >/dev/null; then apt_install chromium; fi
  chromium --headless --no-sandbox --disable-gpu --version >/dev/null 2>&1 || die "chromium is installed but does not run"
}

ensure_tools
ensure_chromium
ensure_redis
ensure_postgres
