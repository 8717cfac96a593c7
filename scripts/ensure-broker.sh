#!/usr/bin/env bash
# ensure-broker.sh - make sure a RabbitMQ broker answers on AMQP_URI.
#
# Usage: scripts/ensure-broker.sh            (or: make broker)
#
# Environment:
#   AMQP_URI          broker to check (default amqp://guest:guest@127.0.0.1:5672/)
#   BROKER_WAIT_SECS  how long to wait for a local broker to boot (default 90)
#   BROKER_NO_INSTALL set to 1 to never apt-get install rabbitmq-server
#
# Steps, for a local host (127.x, localhost, ::1):
#   1. node reachable with the RabbitMQ CLI: start the app if it was stopped
#      (rabbitmqctl stop_app), then await_startup and an AMQP handshake -> done.
#   2. something already speaks AMQP on host:port (e.g. a container) -> done.
#   3. rabbitmq-server installed -> rabbitmq-server -detached, wait.
#   4. root + apt-get -> apt-get install rabbitmq-server, start, wait.
#   5. otherwise explain what to do and exit 1.
# For a remote host the script only waits for it to answer.
set -euo pipefail

AMQP_URI="${AMQP_URI:-amqp://guest:guest@127.0.0.1:5672/}"
WAIT_SECS="${BROKER_WAIT_SECS:-90}"
REMOTE_WAIT_SECS="${BROKER_REMOTE_WAIT_SECS:-30}"

# The RabbitMQ CLI tools live in /usr/sbin on Debian; non-login PATHs miss it.
export PATH="${PATH:-/usr/bin:/bin}:/usr/sbin:/sbin"

log() { printf 'ensure-broker: %s\n' "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
have() { command -v "$1" >/dev/null 2>&1; }

# --- parse AMQP_URI ---------------------------------------------------------
parse_uri() {
	local uri="$1" scheme rest hostport
	case "$uri" in
	amqp://*) scheme=amqp ;;
	amqps://*) scheme=amqps ;;
	*) die "AMQP_URI must start with amqp:// or amqps:// (got '$uri')" ;;
	esac
	rest="${uri#*://}"
	hostport="${rest%%/*}"       # drop /vhost
	hostport="${hostport%%\?*}"  # drop ?query
	hostport="${hostport##*@}"   # drop user:pass@
	if [[ $hostport == \[*\]* ]]; then # [ipv6]:port
		BROKER_HOST="${hostport#\[}"
		BROKER_HOST="${BROKER_HOST%%\]*}"
		BROKER_PORT="${hostport##*\]}"
		BROKER_PORT="${BROKER_PORT#:}"
	elif [[ $hostport == *:* ]]; then
		BROKER_HOST="${hostport%:*}"
		BROKER_PORT="${hostport##*:}"
	else
		BROKER_HOST="$hostport"
		BROKER_PORT=""
	fi
	[[ -n $BROKER_HOST ]] || BROKER_HOST=localhost
	if [[ -z $BROKER_PORT ]]; then
		if [[ $scheme == amqps ]]; then BROKER_PORT=5671; else BROKER_PORT=5672; fi
	fi
	[[ $BROKER_PORT =~ ^[0-9]+$ ]] || die "bad port '$BROKER_PORT' in AMQP_URI"
	BROKER_SCHEME="$scheme"
}

is_local_host() {
	case "$BROKER_HOST" in
	localhost | 127.* | ::1 | "$(hostname 2>/dev/null || echo localhost)") return 0 ;;
	esac
	return 1
}

# --- probes -----------------------------------------------------------------
# run_t SECS CMD...: run a command with a hard time limit and no stdin.
run_t() {
	local t="$1"
	shift
	timeout --kill-after=5 "$t" "$@" </dev/null
}

port_open() {
	# shellcheck disable=SC2016 # $1/$2 expand in the child bash
	run_t 5 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$BROKER_HOST" "$BROKER_PORT" 2>/dev/null
}

# broker_answers: TCP connect; for plain amqp also send the AMQP 0-9-1
# protocol header and expect a method frame on channel 0 (Connection.Start).
broker_answers() {
	if [[ $BROKER_SCHEME == amqps ]]; then
		port_open
		return
	fi
	local out
	# shellcheck disable=SC2016 # $1/$2 expand in the child bash
	out="$(run_t 5 bash -c '
		exec 3<>"/dev/tcp/$1/$2" || exit 1
		printf "AMQP\000\000\011\001" >&3
		head -c 3 <&3 | od -An -tx1
	' _ "$BROKER_HOST" "$BROKER_PORT" 2>/dev/null)" || return 1
	[[ ${out//[[:space:]]/} == 010000 ]]
}

# The CLI: rabbitmq-diagnostics if present, else rabbitmqctl (same commands).
DIAG=""
if have rabbitmq-diagnostics; then
	DIAG=rabbitmq-diagnostics
elif have rabbitmqctl; then
	DIAG=rabbitmqctl
fi

node_up() {
	[[ -n $DIAG ]] || return 1
	run_t 30 "$DIAG" -q ping >/dev/null 2>&1
}
app_running() { run_t 30 "$DIAG" -q check_running >/dev/null 2>&1; }
app_booting() {
	local out
	out="$(run_t 30 "$DIAG" -q is_booting --formatter json 2>/dev/null)" || return 1
	[[ $out == *'"result":true'* ]]
}

START_LOG="${TMPDIR:-/tmp}/ensure-broker.$$.log"
# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() { rm -f "$START_LOG"; }
trap cleanup EXIT

show_failure_hints() {
	if [[ -s $START_LOG ]]; then
		log "output of rabbitmq-server -detached:"
		sed 's/^/    /' "$START_LOG" >&2 || true
	fi
	local f
	for f in /var/log/rabbitmq/*.log; do
		[[ -s $f ]] || continue
		log "last lines of $f:"
		tail -n 20 "$f" | sed 's/^/    /' >&2 || true
	done
	if [[ -n $DIAG ]] && node_up; then
		log "status of the local node:"
		run_t 30 rabbitmqctl status 2>&1 | head -n 40 | sed 's/^/    /' >&2 || true
	fi
}

# wait_ready: bounded wait until the local node is fully booted and
# host:port speaks AMQP.
wait_ready() {
	local deadline=$((SECONDS + WAIT_SECS)) remaining
	if [[ -n $DIAG ]] && have rabbitmqctl; then
		until node_up; do
			((SECONDS < deadline)) || {
				show_failure_hints
				die "RabbitMQ node did not come up within ${WAIT_SECS}s"
			}
			sleep 1
		done
		remaining=$((deadline - SECONDS))
		((remaining > 0)) || remaining=1
		if ! run_t $((remaining + 10)) rabbitmqctl -q await_startup --timeout "$remaining" >/dev/null 2>&1; then
			show_failure_hints
			die "rabbitmqctl await_startup did not succeed within ${WAIT_SECS}s"
		fi
	fi
	until broker_answers; do
		((SECONDS < deadline)) || {
			show_failure_hints
			die "nothing answers AMQP on $BROKER_HOST:$BROKER_PORT after ${WAIT_SECS}s" \
				"(is the node listening on that port? check listeners.tcp in /etc/rabbitmq/rabbitmq.conf)"
		}
		sleep 1
	done
	log "broker ready on $BROKER_HOST:$BROKER_PORT"
}

# ensure_app_running: the node is up (ping works); make sure the rabbit app
# runs too (it does not after `rabbitmqctl stop_app`).
ensure_app_running() {
	app_running && return 0
	if app_booting; then
		log "RabbitMQ node is booting; waiting"
		return 0
	fi
	log "RabbitMQ node is up but the app is stopped; running rabbitmqctl start_app"
	run_t "$WAIT_SECS" rabbitmqctl -q start_app >&2 || {
		show_failure_hints
		die "rabbitmqctl start_app failed"
	}
}

start_node() {
	log "starting RabbitMQ: rabbitmq-server -detached"
	# Redirect everything so the daemon never holds our stdout/stderr open.
	if ! run_t 60 rabbitmq-server -detached >"$START_LOG" 2>&1; then
		show_failure_hints
		die "rabbitmq-server -detached failed"
	fi
	wait_ready
}

# On a fresh install the node name is rabbit@<short hostname>; Erlang
# distribution fails if that name does not resolve. Fall back to localhost.
fix_nodename_if_needed() {
	local short env=/etc/rabbitmq/rabbitmq-env.conf
	short="$(hostname -s 2>/dev/null || true)"
	if [[ -n $short ]] && getent hosts "$short" >/dev/null 2>&1; then
		return 0
	fi
	if [[ -f $env ]] && grep -Eq '^[[:space:]]*(export[[:space:]]+)?NODENAME=' "$env"; then
		return 0
	fi
	log "hostname '$short' does not resolve; setting NODENAME=rabbit@localhost in $env"
	mkdir -p /etc/rabbitmq
	printf 'NODENAME=rabbit@localhost\n' >>"$env"
}

install_rabbitmq() {
	log "rabbitmq-server is not installed; installing it with apt-get (Debian package)"
	export DEBIAN_FRONTEND=noninteractive
	run_t 600 apt-get update -q >&2 || die "apt-get update failed"
	run_t 1200 apt-get install -y -q rabbitmq-server >&2 || die "apt-get install rabbitmq-server failed"
	have rabbitmq-server || die "rabbitmq-server still not found after apt-get install"
	DIAG=rabbitmq-diagnostics
	have "$DIAG" || DIAG=rabbitmqctl
	fix_nodename_if_needed
}

# ensure_management: the management plugin (HTTP API on :15672), which the
# tests of amqpretry.AdoptQueue use to apply and check policies. Enabled
# online; a failure is a warning (those tests then skip, saying why).
ensure_management() {
	have rabbitmq-plugins || return 0
	if run_t 60 rabbitmq-plugins -q list -e -m 2>/dev/null | grep -x rabbitmq_management >/dev/null; then
		return 0
	fi
	log "enabling the management plugin (rabbitmq-plugins enable rabbitmq_management)"
	run_t 120 rabbitmq-plugins -q enable rabbitmq_management >&2 ||
		log "warning: could not enable rabbitmq_management; the AdoptQueue tests that need the management API will skip"
}

how_to() {
	log "ERROR: no RabbitMQ broker answers on $BROKER_HOST:$BROKER_PORT (AMQP_URI=${AMQP_URI})"
	log "To fix, do one of:"
	log "  - install RabbitMQ 3.10+ and start it:"
	log "        sudo apt-get install rabbitmq-server && sudo rabbitmq-server -detached"
	log "    (then rerun this script, as root, so it can start/repair the node)"
	log "  - run one in a container:"
	log "        docker run -d --name rabbitmq -p 5672:5672 rabbitmq:3.10"
	log "  - point the tests at an existing broker:"
	log "        export AMQP_URI=amqp://user:pass@host:5672/"
	exit 1
}

# --- main -------------------------------------------------------------------
parse_uri "$AMQP_URI"
have timeout || die "the 'timeout' command (coreutils) is required"

if ! is_local_host; then
	log "waiting up to ${REMOTE_WAIT_SECS}s for remote broker $BROKER_HOST:$BROKER_PORT"
	deadline=$((SECONDS + REMOTE_WAIT_SECS))
	until broker_answers; do
		((SECONDS < deadline)) || how_to
		sleep 1
	done
	log "broker ready on $BROKER_HOST:$BROKER_PORT"
	exit 0
fi

# 1. Local node reachable through the CLI: make sure its app runs, then wait.
if have rabbitmqctl && node_up; then
	ensure_app_running
	wait_ready
	ensure_management
	exit 0
fi

# 2. Something else (container, other install) already speaks AMQP there.
if broker_answers; then
	log "broker ready on $BROKER_HOST:$BROKER_PORT (not managed by a local rabbitmqctl)"
	exit 0
fi

# 3. Installed but not running: start it.
if have rabbitmq-server; then
	start_node
	ensure_management
	exit 0
fi

# 4. Not installed: install it when we can.
if [[ ${BROKER_NO_INSTALL:-0} != 1 ]] && [[ $(id -u) == 0 ]] && have apt-get; then
	install_rabbitmq
	# The package's postinst may already have started the node.
	if node_up; then
		ensure_app_running
		wait_ready
	else
		start_node
	fi
	ensure_management
	exit 0
fi

how_to
