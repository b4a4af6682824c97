#!/usr/bin/env bash
# Start a local, throwaway PostgreSQL server for the tuner's shared-study test
# (tests/test_tuner_study.py, marked `postgres`) and hand back KGEN_TEST_POSTGRES_URL.
#
#   eval "$(bash .ci/postgres.sh)"     # prints one line: export KGEN_TEST_POSTGRES_URL=...
#   source .ci/postgres.sh             # same, exported into the calling shell
#
# Idempotent: installs the server only when missing (apt-get), starts the newest
# cluster, creates role and database only when absent. Everything but the export line
# goes to stderr, so `eval "$(...)"` sees nothing else. Needs root (CI runs as root).
# Listens on 127.0.0.1 only.

if [[ "${BASH_SOURCE[0]}" != "${0}" ]]; then
    # Sourced: run the body in a child bash so its `set -e` cannot end the caller.
    if _kgen_pg_line="$(bash "${BASH_SOURCE[0]}")"; then
        eval "${_kgen_pg_line}"
        echo "postgres.sh: ${_kgen_pg_line}" >&2
        unset _kgen_pg_line
        return 0
    fi
    unset _kgen_pg_line
    echo "postgres.sh: could not start PostgreSQL (see above); the postgres tests will be skipped" >&2
    return 1
fi

set -euo pipefail

PG_USER="${KGEN_PG_USER:-kgen}"
PG_PASSWORD="${KGEN_PG_PASSWORD:-kgen}"
PG_DB="${KGEN_PG_DB:-kgen_test}"

log() { echo "postgres.sh: $*" >&2; }

as_postgres() {
    if command -v runuser >/dev/null 2>&1; then
        runuser -u postgres -- "$@"
    else
        su postgres -s /bin/sh -c "$(printf '%q ' "$@")"
    fi
}

if [[ "$(id -u)" != "0" ]]; then
    log "must run as root (it installs and starts a server); run it with sudo"
    exit 1
fi

if ! ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1; then
    log "installing postgresql with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq postgresql >&2
fi

PG_VERSION="$(ls /usr/lib/postgresql | sort -V | tail -n 1)"
if ! pg_lsclusters -h | awk '{print $1" "$2}' | grep -qx "${PG_VERSION} main"; then
    log "creating cluster ${PG_VERSION}/main"
    pg_createcluster "${PG_VERSION}" main >&2
fi
if ! pg_lsclusters -h | awk -v v="${PG_VERSION}" '$1==v && $2=="main" {print $4}' | grep -qx online; then
    log "starting cluster ${PG_VERSION}/main"
    pg_ctlcluster "${PG_VERSION}" main start >&2
fi
PG_PORT="$(pg_lsclusters -h | awk -v v="${PG_VERSION}" '$1==v && $2=="main" {print $3}')"

for _ in $(seq 1 60); do
    if pg_isready -q -h 127.0.0.1 -p "${PG_PORT}"; then break; fi
    sleep 0.5
done
pg_isready -h 127.0.0.1 -p "${PG_PORT}" >&2 || { log "server on port ${PG_PORT} is not ready"; exit 1; }

psql_admin() { as_postgres psql -p "${PG_PORT}" -v ON_ERROR_STOP=1 -qtAX "$@"; }

if [[ "$(psql_admin -c "SELECT 1 FROM pg_roles WHERE rolname = '${PG_USER}'")" != "1" ]]; then
    log "creating role ${PG_USER}"
    psql_admin -c "CREATE ROLE \"${PG_USER}\" LOGIN PASSWORD '${PG_PASSWORD}'"
fi
if [[ "$(psql_admin -c "SELECT 1 FROM pg_database WHERE datname = '${PG_DB}'")" != "1" ]]; then
    log "creating database ${PG_DB}"
    psql_admin -c "CREATE DATABASE \"${PG_DB}\" OWNER \"${PG_USER}\""
fi

# The Python driver (the `postgres` extra of pyproject.toml) so the test can connect.
if ! python3 -c "import psycopg2" >/dev/null 2>&1; then
    log "installing the psycopg2-binary driver"
    python3 -m pip install -q "psycopg2-binary>=2.9" >&2
fi

URL="postgresql+psycopg2://${PG_USER}:${PG_PASSWORD}@127.0.0.1:${PG_PORT}/${PG_DB}"
PGPASSWORD="${PG_PASSWORD}" psql -h 127.0.0.1 -p "${PG_PORT}" -U "${PG_USER}" -d "${PG_DB}" \
    -v ON_ERROR_STOP=1 -qtAX -c "SELECT 1" >/dev/null \
    || { log "cannot log in as ${PG_USER} over TCP on 127.0.0.1:${PG_PORT}"; exit 1; }
log "PostgreSQL ${PG_VERSION} ready on 127.0.0.1:${PG_PORT}, database ${PG_DB}"
echo "export KGEN_TEST_POSTGRES_URL=${URL}"
