#!/usr/bin/env bash
# ensure-postgres.sh - make sure a PostgreSQL server answers on
# RABBITRETRY_PG_DSN and that its database exists, for the audit store
# tests (audit/pgstore). Prints the DSN to use on stdout.
#
# Usage: scripts/ensure-postgres.sh            (make test runs it)
#
# Environment:
#   RABBITRETRY_PG_DSN  DSN to check (URL form; default
#                       postgres://postgres@127.0.0.1:5432/test?sslmode=disable)
#   PG_WAIT_SECS        how long to wait for a local server to start (default 60)
#   PG_NO_INSTALL       set to 1 to never apt-get install postgresql
#   PG_NO_CONFIGURE     set to 1 to never touch pg_hba.conf
#
# Steps, for a local host (127.x, localhost, ::1):
#   1. a server answers on host:port (pg_isready) -> go to 4.
#   2. a Debian cluster is installed (/etc/postgresql/VER/main) -> start it
#      with pg_ctlcluster --skip-systemctl-redirect VER main start, wait.
#   3. root + apt-get -> apt-get install postgresql, start the cluster, wait.
#   4. the DSN's user can log in over TCP: if not, and root on the server's
#      machine, add "host all USER 127.0.0.1/32 trust" (and ::1/128) to the
#      top of pg_hba.conf and reload (test machines only).
#   5. the DSN's database exists: else CREATE DATABASE.
# For a remote host the script only waits for it to answer.
set -euo pipefail

DEFAULT_DSN="postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
DSN="${RABBITRETRY_PG_DSN:-$DEFAULT_DSN}"
WAIT_SECS="${PG_WAIT_SECS:-60}"
REMOTE_WAIT_SECS="${PG_REMOTE_WAIT_SECS:-30}"

export PATH="${PATH:-/usr/bin:/bin}:/usr/sbin:/sbin"

log() { printf 'ensure-postgres: %s\n' "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
have() { command -v "$1" >/dev/null 2>&1; }
run_t() {
	local t="$1"
	shift
	timeout --kill-after=5 "$t" "$@" </dev/null
}

# --- parse the DSN (URL form) -----------------------------------------------
parse_dsn() {
	local dsn="$1" rest auth hostport path
	case "$dsn" in
	postgres://* | postgresql://*) ;;
	*) die "RABBITRETRY_PG_DSN must be a postgres:// URL (got '${dsn%%@*}...')" ;;
	esac
	rest="${dsn#*://}"
	path=""
	if [[ $rest == */* ]]; then path="${rest#*/}"; fi
	rest="${rest%%/*}"
	rest="${rest%%\?*}"
	auth=""
	if [[ $rest == *@* ]]; then
		auth="${rest%@*}"
		hostport="${rest##*@}"
	else
		hostport="$rest"
	fi
	PG_USER="${auth%%:*}"
	[[ -n $PG_USER ]] || PG_USER="${PGUSER:-postgres}"
	if [[ $hostport == \[*\]* ]]; then
		PG_HOST="${hostport#\[}"
		PG_HOST="${PG_HOST%%\]*}"
		PG_PORT="${hostport##*\]}"
		PG_PORT="${PG_PORT#:}"
	elif [[ $hostport == *:* ]]; then
		PG_HOST="${hostport%:*}"
		PG_PORT="${hostport##*:}"
	else
		PG_HOST="$hostport"
		PG_PORT=""
	fi
	[[ -n $PG_HOST ]] || PG_HOST=127.0.0.1
	[[ -n $PG_PORT ]] || PG_PORT=5432
	[[ $PG_PORT =~ ^[0-9]+$ ]] || die "bad port '$PG_PORT' in RABBITRETRY_PG_DSN"
	PG_DB="${path%%\?*}"
	[[ -n $PG_DB ]] || PG_DB="$PG_USER"
	[[ $PG_DB =~ ^[A-Za-z0-9_]+$ ]] || die "database name '$PG_DB' in RABBITRETRY_PG_DSN: this script handles letters, digits and '_' only"
	# The same DSN on the maintenance database "postgres".
	local scheme authority query=""
	scheme="${dsn%%://*}"
	authority="${dsn#*://}"
	authority="${authority%%/*}"
	authority="${authority%%\?*}"
	if [[ $dsn == *\?* ]]; then query="?${dsn#*\?}"; fi
	ADMIN_DSN="$scheme://$authority/postgres$query"
}

is_local_host() {
	case "$PG_HOST" in
	localhost | 127.* | ::1 | "$(hostname 2>/dev/null || echo localhost)") return 0 ;;
	esac
	return 1
}

server_answers() {
	if have pg_isready; then
		run_t 5 pg_isready -q -h "$PG_HOST" -p "$PG_PORT" >/dev/null 2>&1
		return
	fi
	# shellcheck disable=SC2016 # $1/$2 expand in the child bash
	run_t 5 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$PG_HOST" "$PG_PORT" 2>/dev/null
}

wait_ready() {
	local secs="$1" deadline=$((SECONDS + $1))
	until server_answers; do
		((SECONDS < deadline)) || return 1
		sleep 1
	done
}

# The installed Debian clusters' versions, newest first.
cluster_versions() {
	[[ -d /etc/postgresql ]] || return 0
	find /etc/postgresql -mindepth 2 -maxdepth 2 -name main -type d 2>/dev/null |
		awk -F/ '{print $4}' | sort -rn
}

cluster_port() { # VER
	sed -n 's/^[[:space:]]*port[[:space:]]*=[[:space:]]*\([0-9]*\).*/\1/p' "/etc/postgresql/$1/main/postgresql.conf" 2>/dev/null | head -n1
}

start_cluster() {
	local ver port
	for ver in $(cluster_versions); do
		port="$(cluster_port "$ver")"
		if [[ -n $port && $port != "$PG_PORT" ]]; then
			log "cluster $ver/main listens on port $port, not $PG_PORT; skipping it"
			continue
		fi
		have pg_ctlcluster || die "cluster $ver/main is installed but pg_ctlcluster is missing (postgresql-common)"
		log "starting PostgreSQL: pg_ctlcluster --skip-systemctl-redirect $ver main start"
		if ! run_t 120 pg_ctlcluster --skip-systemctl-redirect "$ver" main start >&2; then
			tail -n 20 "/var/log/postgresql/postgresql-$ver-main.log" 2>/dev/null | sed 's/^/    /' >&2 || true
			die "pg_ctlcluster $ver main start failed"
		fi
		wait_ready "$WAIT_SECS" || die "PostgreSQL $ver/main started but nothing answers on $PG_HOST:$PG_PORT after ${WAIT_SECS}s"
		log "PostgreSQL $ver/main ready on $PG_HOST:$PG_PORT"
		STARTED_VER="$ver"
		return 0
	done
	return 1
}

install_postgres() {
	log "PostgreSQL is not installed; installing it with apt-get (Debian package postgresql)"
	export DEBIAN_FRONTEND=noninteractive
	run_t 600 apt-get update -q >&2 || die "apt-get update failed"
	run_t 1200 apt-get install -y -q postgresql >&2 || die "apt-get install postgresql failed"
}

# psql_as_dsn DSN SQL: run SQL over TCP as the DSN's user.
psql_as_dsn() { run_t 30 psql "$1" -X -q -t -A -v ON_ERROR_STOP=1 -c "$2"; }

can_login() { psql_as_dsn "$ADMIN_DSN" "SELECT 1" >/dev/null 2>&1; }

# allow_trust: test machines only: let the DSN's user in over loopback TCP,
# through the local superuser (peer auth on the socket): create the role if
# it is missing; if it still cannot log in, trust it on 127.0.0.1 and ::1
# in pg_hba.conf and reload.
allow_trust() {
	local hba su=(runuser -u postgres -- psql -X -q -t -A -v ON_ERROR_STOP=1)
	[[ ${PG_NO_CONFIGURE:-0} != 1 ]] || return 1
	[[ $(id -u) == 0 ]] && have runuser || return 1
	if [[ $(run_t 30 "${su[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname = '$PG_USER'" 2>/dev/null) != 1 ]]; then
		log "creating role $PG_USER (LOGIN CREATEDB)"
		run_t 30 "${su[@]}" -c "CREATE ROLE \"$PG_USER\" LOGIN CREATEDB" >/dev/null || return 1
		can_login && return 0
	fi
	hba="$(run_t 30 "${su[@]}" -c 'SHOW hba_file' 2>/dev/null)" || return 1
	[[ -f $hba ]] || return 1
	if grep -qx "host all $PG_USER 127.0.0.1/32 trust" "$hba"; then
		return 1 # already there: something else is wrong
	fi
	log "user '$PG_USER' cannot log in over TCP; adding trust lines for it on 127.0.0.1/::1 to the top of $hba and reloading"
	{
		printf '# added by rabbitretry scripts/ensure-postgres.sh (test machine)\n'
		printf 'host all %s 127.0.0.1/32 trust\nhost all %s ::1/128 trust\n' "$PG_USER" "$PG_USER"
		cat "$hba"
	} >"$hba.rabbitretry.tmp" && cat "$hba.rabbitretry.tmp" >"$hba" && rm -f "$hba.rabbitretry.tmp"
	run_t 30 "${su[@]}" -c 'SELECT pg_reload_conf()' >/dev/null
}

how_to() {
	log "ERROR: no PostgreSQL answers on $PG_HOST:$PG_PORT (RABBITRETRY_PG_DSN=${DSN%%\?*})"
	log "To fix, do one of:"
	log "  - install PostgreSQL and rerun this script as root:  sudo apt-get install postgresql"
	log "  - run one in a container:"
	log "        docker run -d -p 5432:5432 -e POSTGRES_HOST_AUTH_METHOD=trust -e POSTGRES_DB=test postgres:15"
	log "  - point the tests at an existing server:"
	log "        export RABBITRETRY_PG_DSN=postgres://user:pass@host:5432/db?sslmode=disable"
	exit 1
}

# --- main -------------------------------------------------------------------
parse_dsn "$DSN"
have timeout || die "the 'timeout' command (coreutils) is required"

if ! is_local_host; then
	log "waiting up to ${REMOTE_WAIT_SECS}s for remote PostgreSQL $PG_HOST:$PG_PORT"
	wait_ready "$REMOTE_WAIT_SECS" || how_to
	log "PostgreSQL answers on $PG_HOST:$PG_PORT (remote: database not checked)"
	printf '%s\n' "$DSN"
	exit 0
fi

STARTED_VER=""
if server_answers; then
	log "PostgreSQL answers on $PG_HOST:$PG_PORT"
elif start_cluster; then
	:
elif [[ ${PG_NO_INSTALL:-0} != 1 ]] && [[ $(id -u) == 0 ]] && have apt-get; then
	install_postgres
	# The package's postinst usually creates and starts the cluster.
	wait_ready 10 || start_cluster || die "postgresql installed but no cluster answers on port $PG_PORT"
else
	how_to
fi

if ! have psql; then
	if [[ ${PG_NO_INSTALL:-0} != 1 ]] && [[ $(id -u) == 0 ]] && have apt-get; then
		log "psql is missing; installing postgresql-client"
		export DEBIAN_FRONTEND=noninteractive
		run_t 600 apt-get install -y -q postgresql-client >&2 || die "apt-get install postgresql-client failed"
	else
		log "psql is missing: cannot check user '$PG_USER' and database '$PG_DB'; assuming they exist"
		printf '%s\n' "$DSN"
		exit 0
	fi
fi

if ! can_login; then
	allow_trust || true
	can_login || die "user '$PG_USER' cannot log in to $PG_HOST:$PG_PORT (check pg_hba.conf and the password in RABBITRETRY_PG_DSN): $(psql_as_dsn "$ADMIN_DSN" 'SELECT 1' 2>&1 | head -n1)"
fi

if [[ $(psql_as_dsn "$ADMIN_DSN" "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'") != 1 ]]; then
	log "creating database $PG_DB"
	psql_as_dsn "$ADMIN_DSN" "CREATE DATABASE \"$PG_DB\"" >/dev/null ||
		[[ $(psql_as_dsn "$ADMIN_DSN" "SELECT 1 FROM pg_database WHERE datname = '$PG_DB'") == 1 ]] ||
		die "could not create database $PG_DB"
fi
log "ready: $PG_USER@$PG_HOST:$PG_PORT/$PG_DB"
printf '%s\n' "$DSN"
