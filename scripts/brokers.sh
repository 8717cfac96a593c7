#!/usr/bin/env bash
# brokers.sh - RabbitMQ brokers on demand for the test suite.
#
# Usage:
#   scripts/brokers.sh up   local|43|dev|dev2|cluster|all   make sure the broker(s) run (installs what is missing)
#   scripts/brokers.sh down 43|cluster|all         stop what this script started
#   scripts/brokers.sh env  local|43|cluster       print `export` lines: eval "$(scripts/brokers.sh env 43)"
#   scripts/brokers.sh ctl  local|43|cluster [--node n1|n2|n3] -- RABBITMQCTL-ARGS...
#   scripts/brokers.sh node-kill  cluster n1|n2|n3 kill -9 the node's Erlang VM (a crash)
#   scripts/brokers.sh node-start cluster n1|n2|n3 start it again, wait until it runs and is clustered
#   scripts/brokers.sh node-stop  cluster n1|n2|n3 clean stop (rabbitmqctl stop)
#   scripts/brokers.sh node cluster kill|start|stop n1|n2|n3   the same (RABBITRETRY_NODE_CTL form)
#   scripts/brokers.sh status                      what runs, with URIs
#
# Brokers:
#   local    the machine's own broker (scripts/ensure-broker.sh), amqp://guest:guest@127.0.0.1:5672/,
#            controlled with plain `rabbitmqctl`. This script never stops or reconfigures it.
#   43       RabbitMQ 4.3.x from Debian sid, installed with debootstrap into a root of its own
#            ($RABBITRETRY_BROKERS_DIR/sid-root), run there with chroot: node rabbit43@localhost,
#            AMQP 127.0.0.1:5673, dist 25673, management http://127.0.0.1:15673/.
#   dev      a second 4.3 single node like 43 (node dev43@localhost, AMQP 5693, dist 25693,
#            management 15693) for development while a test run owns 43; never used by CI.
#   dev2     another one (node dev2@localhost, AMQP 5694, dist 25694, management 15694).
#   cluster  three 4.3 nodes n1..n3@localhost from the same root, AMQP 5681..5683, dist 25681..25683,
#            behind HAProxy on 127.0.0.1:5680 (TCP, leastconn, health checks every second).
#   All nodes in the root share their own epmd on port 4370 (ERL_EPMD_PORT) and one Erlang cookie;
#   the machine's epmd (4369) and broker (5672/25672) are never touched.
#
# Environment:
#   RABBITRETRY_BROKERS_DIR    where roots, node data and logs live (default /var/lib/rabbitretry-brokers)
#   RABBITRETRY_BROKERS_MIRROR Debian mirror for debootstrap (default: from /etc/apt/sources.list*)
#   RABBITRETRY_BROKERS_WAIT   seconds to wait for a node to boot (default 180)
#   RABBITRETRY_CTL_TIMEOUT    time limit of one `ctl` command in seconds (default 300)
#
# Layout under the brokers dir:
#   sid-root/                         the Debian sid root (marker: sid-root/.rabbitretry-ready)
#   sid-root/var/lib/rabbitmq/rabbitretry/NODE/   per node: rabbitmq.conf, enabled_plugins,
#                                     mnesia/ (data), log/ (RabbitMQ's logs), NODE.pid
#   logs/                             debootstrap, apt, node console output, haproxy check
#   haproxy/                          haproxy.cfg, haproxy.pid, admin.sock
set -euo pipefail

export PATH="${PATH:-/usr/bin:/bin}:/usr/sbin:/sbin"

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
SELF="$SCRIPT_DIR/$(basename "${BASH_SOURCE[0]}")"
BROKERS_DIR="${RABBITRETRY_BROKERS_DIR:-/var/lib/rabbitretry-brokers}"
ROOT="$BROKERS_DIR/sid-root"
READY_MARKER="$ROOT/.rabbitretry-ready"
LOG_DIR="$BROKERS_DIR/logs"
HAPROXY_DIR="$BROKERS_DIR/haproxy"
SUITE=sid
WAIT_SECS="${RABBITRETRY_BROKERS_WAIT:-180}"
CTL_TIMEOUT="${RABBITRETRY_CTL_TIMEOUT:-300}"

EPMD_PORT=4370
HAPROXY_PORT=5680
LOCAL_URI="amqp://guest:guest@127.0.0.1:5672/"
CLUSTER_NODES=(n1 n2 n3)
# Paths as seen inside the root.
IN_HOME=/var/lib/rabbitmq
IN_NODES=/var/lib/rabbitmq/rabbitretry
IN_BIN=/usr/lib/rabbitmq/bin

T_START="${EPOCHREALTIME/[.,]/}"
declare -A LAUNCHED=() # node -> $SECONDS when this run launched it

log() { printf 'brokers: %s\n' "$*" >&2; }
die() {
	log "ERROR: $*"
	exit 1
}
have() { command -v "$1" >/dev/null 2>&1; }
now_us() { printf '%s' "${EPOCHREALTIME/[.,]/}"; }
# since T0: seconds elapsed since the microsecond timestamp T0, one decimal.
since() {
	local d=$(($(now_us) - $1))
	printf '%d.%ds' $((d / 1000000)) $((d % 1000000 / 100000))
}
usage() {
	sed -n '2,12p' "$SELF" | sed 's/^# \{0,1\}//' >&2
	exit 2
}

# run_t SECS CMD...: run a command with a hard time limit and no stdin.
run_t() {
	local t="$1"
	shift
	timeout --kill-after=10 "$t" "$@" </dev/null
}

need_root() {
	[[ $(id -u) == 0 ]] || die "this needs root (chroot, mount, apt-get); run it as root"
}

# --- node table ---------------------------------------------------------------
# node_vars SHORT: sets NODE (Erlang node name), AMQP_PORT, DIST_PORT, MGMT_PORT
# (empty: management off), IN_BASE (node dir inside the root) and HOST_BASE.
node_vars() {
	case "$1" in
	rabbit43) NODE=rabbit43@localhost AMQP_PORT=5673 DIST_PORT=25673 MGMT_PORT=15673 ;;
	dev43) NODE=dev43@localhost AMQP_PORT=5693 DIST_PORT=25693 MGMT_PORT=15693 ;;
	dev2) NODE=dev2@localhost AMQP_PORT=5694 DIST_PORT=25694 MGMT_PORT=15694 ;;
	n1) NODE=n1@localhost AMQP_PORT=5681 DIST_PORT=25681 MGMT_PORT="" ;;
	n2) NODE=n2@localhost AMQP_PORT=5682 DIST_PORT=25682 MGMT_PORT="" ;;
	n3) NODE=n3@localhost AMQP_PORT=5683 DIST_PORT=25683 MGMT_PORT="" ;;
	*) die "unknown node '$1' (want rabbit43, dev43, dev2, n1, n2 or n3)" ;;
	esac
	IN_BASE="$IN_NODES/$1"
	HOST_BASE="$ROOT$IN_BASE"
}

node_uri() {
	node_vars "$1"
	printf 'amqp://guest:guest@127.0.0.1:%s/' "$AMQP_PORT"
}

# --- running things inside the root --------------------------------------------
# The rabbitmq user's uid/gid in the root (not necessarily the host's).
RMQ_UID="" RMQ_GID=""
rmq_ids() {
	[[ -n $RMQ_UID ]] && return 0
	local line
	line="$(grep -m1 '^rabbitmq:' "$ROOT/etc/passwd" 2>/dev/null)" ||
		die "no rabbitmq user in $ROOT/etc/passwd: the root looks broken; remove $READY_MARKER and run '$SELF up 43'"
	IFS=: read -r _ _ RMQ_UID RMQ_GID _ <<<"$line"
}

# in_root_cmd: sets IN_ROOT to the command prefix that runs a command in the
# root as the rabbitmq user, with a clean environment: its own epmd port and
# HOME (the shared Erlang cookie). NAME=VALUE words may follow the prefix.
IN_ROOT=()
in_root_cmd() {
	rmq_ids
	IN_ROOT=(chroot --userspec="$RMQ_UID:$RMQ_GID" "$ROOT" /usr/bin/env -i
		PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME="$IN_HOME" LANG=C.UTF-8 LC_ALL=C.UTF-8
		ERL_EPMD_PORT="$EPMD_PORT" ERL_EPMD_ADDRESS=127.0.0.1)
}

# rctl SECS SHORT ARGS...: rabbitmqctl against a node of the root, time-limited.
rctl() {
	local t="$1" short="$2"
	shift 2
	node_vars "$short"
	in_root_cmd
	run_t "$t" "${IN_ROOT[@]}" "$IN_BIN/rabbitmqctl" -n "$NODE" "$@"
}
rdiag() {
	local t="$1" short="$2"
	shift 2
	node_vars "$short"
	in_root_cmd
	run_t "$t" "${IN_ROOT[@]}" "$IN_BIN/rabbitmq-diagnostics" -n "$NODE" "$@"
}

# --- processes -------------------------------------------------------------------
ROOT_REAL=""
root_real() {
	[[ -n $ROOT_REAL ]] || ROOT_REAL="$(readlink -f "$ROOT" 2>/dev/null || printf '%s' "$ROOT")"
	printf '%s' "$ROOT_REAL"
}

# in_our_root PID: true when the process runs chrooted in our root (so it is
# never the machine's own broker or epmd).
in_our_root() {
	local r
	r="$(readlink "/proc/$1/root" 2>/dev/null)" || return 1
	[[ $r == "$(root_real)" ]]
}

# is_node_beam PID NODE: PID is the beam.smp of NODE in our root.
is_node_beam() {
	local pid="$1" node="$2" exe env
	[[ -r /proc/$pid/environ ]] || return 1
	exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || return 1
	[[ $exe == */beam.smp ]] || return 1
	in_our_root "$pid" || return 1
	env="$(tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null)" || return 1
	[[ $'\n'$env$'\n' == *$'\n'"RABBITMQ_NODENAME=$node"$'\n'* ]]
}

# beam_pid SHORT: print the pid of the node's Erlang VM; false if it does not run.
beam_pid() {
	local short="$1" p pid=""
	node_vars "$short"
	[[ -d $ROOT ]] || return 1
	if [[ -s $HOST_BASE/$short.pid ]]; then
		read -r pid <"$HOST_BASE/$short.pid" || true
		if [[ $pid =~ ^[0-9]+$ ]] && is_node_beam "$pid" "$NODE"; then
			printf '%s\n' "$pid"
			return 0
		fi
	fi
	# No (or a stale) pid file: look for it.
	for p in /proc/[0-9]*; do
		p="${p#/proc/}"
		if is_node_beam "$p" "$NODE"; then
			printf '%s\n' "$p"
			return 0
		fi
	done
	return 1
}

# node_procs SHORT: some process of the node (e.g. its rabbitmq-server
# script, before the VM starts) runs in our root.
node_procs() {
	local p
	node_vars "$1"
	for p in /proc/[0-9]*; do
		p="${p#/proc/}"
		in_our_root "$p" || continue
		tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -xF "RABBITMQ_NODENAME=$NODE" >/dev/null && return 0
	done
	return 1
}

# root_pids: every process running chrooted in our root.
root_pids() {
	local p
	[[ -d $ROOT ]] || return 0
	for p in /proc/[0-9]*; do
		p="${p#/proc/}"
		in_our_root "$p" && printf '%s\n' "$p"
	done
	return 0
}

rss_of() { awk '/^VmRSS:/ {printf "%d MiB", $2 / 1024}' "/proc/$1/status" 2>/dev/null || true; }

# amqp_answers PORT: the AMQP 0-9-1 handshake starts (Connection.Start) on 127.0.0.1:PORT.
amqp_answers() {
	local out
	# shellcheck disable=SC2016 # $1 expands in the child bash
	out="$(run_t 5 bash -c '
		exec 3<>"/dev/tcp/127.0.0.1/$1" || exit 1
		printf "AMQP\000\000\011\001" >&3
		head -c 3 <&3 | od -An -tx1
	' _ "$1" 2>/dev/null)" || return 1
	[[ ${out//[[:space:]]/} == 010000 ]]
}

port_busy() {
	# shellcheck disable=SC2016 # $1 expands in the child bash
	run_t 3 bash -c 'exec 3<>"/dev/tcp/127.0.0.1/$1"' _ "$1" 2>/dev/null
}

# --- host packages ---------------------------------------------------------------
APT_UPDATED=0
apt_install() {
	local logf="$LOG_DIR/apt.log" t0
	t0="$(now_us)"
	export DEBIAN_FRONTEND=noninteractive
	log "apt-get install $* (on the host; log: $logf)"
	if ! run_t 900 apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 "$@" >>"$logf" 2>&1; then
		if ((APT_UPDATED == 0)); then
			log "apt-get install failed; running apt-get update and trying again"
			run_t 600 apt-get update -q -o DPkg::Lock::Timeout=300 >>"$logf" 2>&1 || {
				tail -n 20 "$logf" >&2
				die "apt-get update failed (log: $logf)"
			}
			APT_UPDATED=1
		fi
		run_t 900 apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=300 "$@" >>"$logf" 2>&1 || {
			tail -n 20 "$logf" >&2
			die "apt-get install $* failed (log: $logf)"
		}
	fi
	log "installed $* in $(since "$t0")"
}

# ensure_host_tools CMD:PKG...: apt-get install the packages whose command is missing.
ensure_host_tools() {
	local want=() spec
	for spec in "$@"; do
		have "${spec%%:*}" || want+=("${spec#*:}")
	done
	((${#want[@]} == 0)) || apt_install "${want[@]}"
	for spec in "$@"; do
		have "${spec%%:*}" || die "${spec%%:*} still missing after apt-get install ${spec#*:}"
	done
}

# Debian mirror: the one the host's apt uses (non-security), else deb.debian.org.
debian_mirror() {
	local m=""
	if [[ -n ${RABBITRETRY_BROKERS_MIRROR:-} ]]; then
		printf '%s' "$RABBITRETRY_BROKERS_MIRROR"
		return
	fi
	if compgen -G '/etc/apt/sources.list.d/*.sources' >/dev/null; then
		m="$(awk 'tolower($1) == "uris:" { for (i = 2; i <= NF; i++) if ($i !~ /security/) { print $i; exit } }' \
			/etc/apt/sources.list.d/*.sources 2>/dev/null | head -n 1)" || true
	fi
	if [[ -z $m ]] && compgen -G '/etc/apt/sources.list*' >/dev/null; then
		m="$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) { print $i; exit } }' \
			/etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null | head -n 1)" || true
	fi
	printf '%s' "${m:-http://deb.debian.org/debian}"
}

# --- the sid root ------------------------------------------------------------------
# unmount_root: unmount everything mounted below the root (deepest first).
unmount_root() {
	local m
	[[ -d $ROOT ]] || return 0
	while read -r m; do
		[[ -n $m ]] || continue
		umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || log "warning: could not unmount $m"
	done < <(awk -v r="$(root_real)" '$2 == r || index($2, r "/") == 1 { print $2 }' /proc/mounts | sort -r)
}

kill_root_pids() {
	local p pids
	pids="$(root_pids)"
	[[ -n $pids ]] || return 0
	for p in $pids; do
		log "killing leftover process $p in the root: $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null | cut -c1-100)"
		kill -9 "$p" 2>/dev/null || true
	done
	sleep 1
}

# prepare_root: things every command that runs in the root needs (idempotent).
prepare_root() {
	mkdir -p "$ROOT/proc" "$ROOT/etc"
	cmp -s /etc/hosts "$ROOT/etc/hosts" || cp /etc/hosts "$ROOT/etc/hosts"
	if ! mountpoint -q "$ROOT/proc"; then
		mount -t proc proc "$ROOT/proc" || die "mount -t proc proc $ROOT/proc failed"
	fi
	local dev
	for dev in null:1:3 zero:1:5 random:1:8 urandom:1:9; do
		[[ -c $ROOT/dev/${dev%%:*} ]] && continue
		mkdir -p "$ROOT/dev"
		rm -f "$ROOT/dev/${dev%%:*}"
		IFS=: read -r n ma mi <<<"$dev"
		mknod -m 666 "$ROOT/dev/$n" c "$ma" "$mi" || die "mknod $ROOT/dev/$n failed"
	done
}

# ensure_root: the sid root with rabbitmq-server exists (debootstrap if not).
ensure_root() {
	if [[ -f $READY_MARKER ]]; then
		prepare_root
		return 0
	fi
	need_root
	local t0 mirror logf="$LOG_DIR/debootstrap.log"
	t0="$(now_us)"
	ensure_host_tools debootstrap:debootstrap
	if [[ -e $ROOT ]]; then
		log "$ROOT exists without $READY_MARKER (an interrupted run?): removing it and starting over"
		kill_root_pids
		unmount_root
		rm -rf --one-file-system "$ROOT"
	fi
	mirror="$(debian_mirror)"
	mkdir -p "$BROKERS_DIR/debcache"
	log "debootstrap --variant=minbase --include=rabbitmq-server $SUITE $ROOT $mirror"
	log "  (~400 MB; 40 s to 6 min depending on the mirror; log: $logf)"
	if ! run_t 3600 debootstrap --variant=minbase --include=rabbitmq-server \
		--cache-dir="$BROKERS_DIR/debcache" "$SUITE" "$ROOT" "$mirror" >"$logf" 2>&1; then
		tail -n 30 "$logf" >&2
		kill_root_pids
		unmount_root
		die "debootstrap failed (log: $logf; $ROOT is left for inspection and removed on the next run)"
	fi
	log "debootstrap done in $(since "$t0")"
	# Nothing of the root may run yet (a postinst could have started something).
	kill_root_pids
	[[ -x $ROOT$IN_BIN/rabbitmq-server ]] || die "$ROOT$IN_BIN/rabbitmq-server missing after debootstrap"
	prepare_root
	rmq_ids
	# One Erlang cookie for every node of the root (and the CLI), written
	# before any node starts so concurrent first boots cannot race for it.
	local cookie="$ROOT$IN_HOME/.erlang.cookie"
	if [[ ! -s $cookie ]]; then
		mkdir -p "$ROOT$IN_HOME"
		(umask 077 && od -An -tx1 -N 20 /dev/urandom | tr -d ' \n' | tr 'a-f' 'A-F' >"$cookie")
	fi
	chown "$RMQ_UID:$RMQ_GID" "$ROOT$IN_HOME" "$cookie"
	chmod 400 "$cookie"
	printf 'provisioned %s by %s: %s %s\n' "$(date -Is)" "$SELF" "$SUITE" \
		"$(dpkg-query --admindir="$ROOT/var/lib/dpkg" -W -f '${Version}' rabbitmq-server 2>/dev/null || echo '?')" \
		>"$READY_MARKER"
	log "root ready in $(since "$t0"): rabbitmq-server $(pkg_version) in $ROOT"
}

pkg_version() {
	local v
	v="$(dpkg-query --admindir="$ROOT/var/lib/dpkg" -W -f '${Version}' rabbitmq-server 2>/dev/null)" || return 1
	v="${v#*:}"
	printf '%s' "${v%-*}"
}

# --- nodes -------------------------------------------------------------------------
# write_if_changed FILE CONTENT
write_if_changed() {
	if [[ ! -f $1 ]] || [[ "$(cat "$1")" != "$2" ]]; then
		printf '%s\n' "$2" >"$1"
	fi
}

# setup_node SHORT: per-node directories and config (rewritten when the
# script's idea of them changes; takes effect at the next start).
setup_node() {
	local short="$1" conf plugins
	node_vars "$short"
	rmq_ids
	mkdir -p "$HOST_BASE/mnesia" "$HOST_BASE/log" "$LOG_DIR"
	conf="# written by scripts/brokers.sh - node $NODE
listeners.tcp.1 = 127.0.0.1:$AMQP_PORT
loopback_users = none
default_vhost = /
default_user = guest
default_pass = guest
default_user_tags.administrator = true
default_permissions.configure = .*
default_permissions.read = .*
default_permissions.write = .*
log.file.level = info"
	if [[ -n $MGMT_PORT ]]; then
		conf+="
management.tcp.ip = 127.0.0.1
management.tcp.port = $MGMT_PORT"
		plugins='[rabbitmq_management].'
	else
		plugins='[].'
	fi
	write_if_changed "$HOST_BASE/rabbitmq.conf" "$conf"
	write_if_changed "$HOST_BASE/enabled_plugins" "$plugins"
	chown -R "$RMQ_UID:$RMQ_GID" "$HOST_BASE"
	ln -sfn "$HOST_BASE/log" "$LOG_DIR/$short"
}

# launch_node SHORT: start the node in the background unless it runs.
# Returns 0 if it was started, 1 if it already ran.
launch_node() {
	local short="$1" console p
	beam_pid "$short" >/dev/null && return 1
	setup_node "$short"
	console="$LOG_DIR/$short.console.log"
	for p in $AMQP_PORT $DIST_PORT ${MGMT_PORT:+$MGMT_PORT}; do
		port_busy "$p" && die "port $p (for $NODE) is in use by something else: $(ss -ltnpH "sport = :$p" 2>/dev/null | head -n 1)"
	done
	log "starting $NODE (AMQP $AMQP_PORT, dist $DIST_PORT${MGMT_PORT:+, management $MGMT_PORT}; console: $console)"
	printf '\n=== %s: starting %s\n' "$(date -Is)" "$NODE" >>"$console"
	rm -f "$HOST_BASE/$short.pid"
	# Detached in its own session; the node's output goes to the console log,
	# never to our stdout/stderr (callers may be waiting on those pipes).
	(
		cd /
		in_root_cmd
		exec setsid "${IN_ROOT[@]}" \
			RABBITMQ_NODENAME="$NODE" \
			RABBITMQ_DIST_PORT="$DIST_PORT" \
			RABBITMQ_MNESIA_BASE="$IN_BASE/mnesia" \
			RABBITMQ_LOG_BASE="$IN_BASE/log" \
			RABBITMQ_PID_FILE="$IN_BASE/$short.pid" \
			RABBITMQ_CONFIG_FILE="$IN_BASE/rabbitmq.conf" \
			RABBITMQ_ENABLED_PLUGINS_FILE="$IN_BASE/enabled_plugins" \
			RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="+sbwt none +sbwtdcpu none +sbwtdio none -kernel inet_dist_use_interface {127,0,0,1}" \
			"$IN_BIN/rabbitmq-server"
	) >>"$console" 2>&1 </dev/null 9>&- &
	LAUNCHED[$short]=$SECONDS
	return 0
}

node_failure_hints() {
	local short="$1" f
	node_vars "$short"
	log "last lines of $LOG_DIR/$short.console.log:"
	tail -n 25 "$LOG_DIR/$short.console.log" 2>/dev/null | sed 's/^/    /' >&2 || true
	for f in "$HOST_BASE"/log/*.log; do
		[[ -s $f ]] || continue
		log "last lines of $f:"
		tail -n 15 "$f" | sed 's/^/    /' >&2 || true
	done
}

# wait_node SHORT [SECS]: bounded wait until the node's app runs and its AMQP
# port answers. Starts the app if the VM runs with the app stopped.
wait_node() {
	local short="$1" secs="${2:-$WAIT_SECS}" deadline left t0 started_app=0 out
	t0="$(now_us)"
	deadline=$((SECONDS + secs))
	node_vars "$short"
	while :; do
		if ! beam_pid "$short" >/dev/null; then
			# Just launched: the rabbitmq-server script runs before the VM.
			if node_procs "$short" || ((SECONDS < ${LAUNCHED[$short]:-0} + 15)); then
				((SECONDS < deadline)) || die "$NODE did not start within ${secs}s"
				sleep 1
				continue
			fi
			node_failure_hints "$short"
			die "$NODE is not running (its Erlang VM exited)"
		fi
		node_vars "$short"
		amqp_answers "$AMQP_PORT" && break
		((SECONDS < deadline)) || {
			node_failure_hints "$short"
			die "$NODE did not answer AMQP on 127.0.0.1:$AMQP_PORT within ${secs}s"
		}
		left=$((deadline - SECONDS))
		((left > 0)) || left=1
		if [[ -n ${LAUNCHED[$short]:-} ]] || node_booting "$short"; then
			# Booting: await_startup waits (it fails at once while the node
			# is not reachable yet, right after launch).
			if out="$(rctl $((left + 10)) "$short" -q await_startup --timeout "$left" 2>&1)"; then
				continue
			fi
			printf '%s\n' "$out" >>"$LOG_DIR/$short.console.log"
		elif ((started_app == 0)) && rdiag 30 "$short" -q ping >/dev/null 2>&1 &&
			! rdiag 30 "$short" -q check_running >/dev/null 2>&1; then
			# The VM runs with the app stopped (rabbitmqctl stop_app).
			log "$NODE runs but its app is stopped: rabbitmqctl start_app"
			rctl "$left" "$short" -q start_app >&2 || log "warning: start_app on $NODE failed"
			started_app=1
			continue
		fi
		sleep 1
	done
	log "$NODE ready ($(since "$t0") waiting)"
}

node_booting() {
	local out
	out="$(rdiag 30 "$1" -q is_booting --formatter json 2>/dev/null)" || return 1
	[[ $out == *'"result":true'* ]]
}

# stop_node SHORT: clean stop, then SIGTERM, then SIGKILL (bounded).
stop_node() {
	local short="$1" pid t0 i
	pid="$(beam_pid "$short")" || return 0
	node_vars "$short"
	t0="$(now_us)"
	log "stopping $NODE (pid $pid)"
	rctl 120 "$short" -q stop >/dev/null 2>&1 || log "rabbitmqctl stop on $NODE failed; signalling its VM"
	for i in $(seq 1 60); do
		is_node_beam "$pid" "$NODE" || break
		((i == 30)) && kill -TERM "$pid" 2>/dev/null
		sleep 0.5
	done
	if is_node_beam "$pid" "$NODE"; then
		kill -9 "$pid" 2>/dev/null || true
		sleep 1
	fi
	is_node_beam "$pid" "$NODE" && die "could not stop $NODE (pid $pid)"
	log "$NODE stopped in $(since "$t0")"
}

# --- cluster --------------------------------------------------------------------
# cluster_json SHORT: `cluster_status --formatter json` of a node.
# On failure the CLI's output is logged.
cluster_json() {
	local out
	if out="$(rctl 60 "$1" -q cluster_status --formatter json 2>&1)"; then
		printf '%s\n' "$out"
		return 0
	fi
	log "cluster_status on $1 failed: $(tail -n 5 <<<"$out")"
	return 1
}

# json_array JSON KEY: the members of a JSON string array, one per line.
json_array() {
	local re="\"$2\"[[:space:]]*:[[:space:]]*\\[([^]]*)\\]" items
	[[ $1 =~ $re ]] || return 0
	items="${BASH_REMATCH[1]//\"/}"
	items="${items//[[:space:]]/}"
	[[ -n $items ]] && tr ',' '\n' <<<"$items"
	return 0
}

# ensure_joined SHORT: make n2/n3 a member of n1's cluster (once: the marker in
# the node's own dir says it was done; the node's own view is checked otherwise).
ensure_joined() {
	local short="$1" marker json t0
	node_vars "$short"
	marker="$HOST_BASE/joined-n1"
	if [[ -f $marker ]]; then
		return 0
	fi
	json="$(cluster_json "$short")" || die "cluster_status on $NODE failed"
	if json_array "$json" disk_nodes | grep -x 'n1@localhost' >/dev/null; then
		date -Is >"$marker"
		return 0
	fi
	t0="$(now_us)"
	log "joining $NODE to n1@localhost: stop_app, join_cluster, start_app"
	rctl 120 "$short" -q stop_app >&2 || die "stop_app on $NODE failed"
	if ! rctl 180 "$short" -q join_cluster n1@localhost >&2; then
		log "join_cluster failed; resetting $NODE and trying once more"
		rctl 120 "$short" -q reset >&2 || die "reset on $NODE failed"
		rctl 180 "$short" -q join_cluster n1@localhost >&2 || die "join_cluster n1@localhost on $NODE failed"
	fi
	rctl 180 "$short" -q start_app >&2 || die "start_app on $NODE failed"
	wait_node "$short"
	date -Is >"$marker"
	log "$NODE joined the cluster in $(since "$t0")"
}

# wait_clustered SHORT [SECS]: the node sees every other running node as running.
wait_clustered() {
	local short="$1" secs="${2:-120}" deadline json running other want
	deadline=$((SECONDS + secs))
	node_vars "$short"
	while :; do
		want=()
		for other in "${CLUSTER_NODES[@]}"; do
			beam_pid "$other" >/dev/null && want+=("$other@localhost")
		done
		json="$(cluster_json "$short")" || json=""
		running="$(json_array "$json" running_nodes)"
		local ok=1
		for other in "${want[@]}"; do
			grep -qx "$other" <<<"$running" || ok=0
		done
		((ok == 1)) && [[ -n $running ]] && return 0
		((SECONDS < deadline)) || die "$short@localhost does not see ${want[*]} running within ${secs}s (running: ${running//$'\n'/ })"
		sleep 2
	done
}

haproxy_pid() {
	local pid
	[[ -s $HAPROXY_DIR/haproxy.pid ]] || return 1
	read -r pid <"$HAPROXY_DIR/haproxy.pid" || return 1
	[[ $pid =~ ^[0-9]+$ ]] || return 1
	tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -xF "$HAPROXY_DIR/haproxy.cfg" >/dev/null || return 1
	printf '%s\n' "$pid"
}

haproxy_cfg() {
	local short
	cat <<EOF
# written by scripts/brokers.sh: AMQP in front of the 4.3 cluster n1..n3
global
    daemon
    maxconn 4096
    stats socket $HAPROXY_DIR/admin.sock mode 600 level admin

defaults
    mode tcp
    timeout connect 2s
    timeout client 3h
    timeout server 3h
    timeout check 2s
    retries 3
    option redispatch

listen amqp
    bind 127.0.0.1:$HAPROXY_PORT
    balance leastconn
    option clitcpka
    option srvtcpka
EOF
	for short in "${CLUSTER_NODES[@]}"; do
		node_vars "$short"
		printf '    server %s 127.0.0.1:%s check inter 1s fall 2 rise 1 on-marked-down shutdown-sessions\n' "$short" "$AMQP_PORT"
	done
}

ensure_haproxy() {
	local cfg="$HAPROXY_DIR/haproxy.cfg" new pid t0 i
	t0="$(now_us)"
	ensure_host_tools haproxy:haproxy
	mkdir -p "$HAPROXY_DIR"
	new="$(haproxy_cfg)"
	if pid="$(haproxy_pid)"; then
		[[ "$(cat "$cfg")" == "$new" ]] && return 0
		log "haproxy config changed: restarting haproxy"
	else
		pid=""
		port_busy "$HAPROXY_PORT" && die "port $HAPROXY_PORT is in use by something else: $(ss -ltnpH "sport = :$HAPROXY_PORT" 2>/dev/null | head -n 1)"
	fi
	printf '%s\n' "$new" >"$cfg"
	run_t 30 haproxy -c -q -f "$cfg" >"$LOG_DIR/haproxy-check.log" 2>&1 || {
		cat "$LOG_DIR/haproxy-check.log" >&2
		die "haproxy rejects $cfg"
	}
	if [[ -n $pid ]]; then
		run_t 30 haproxy -f "$cfg" -p "$HAPROXY_DIR/haproxy.pid" -sf "$pid" >>"$LOG_DIR/haproxy.log" 2>&1 9>&- ||
			die "haproxy restart failed (log: $LOG_DIR/haproxy.log)"
	else
		run_t 30 haproxy -f "$cfg" -p "$HAPROXY_DIR/haproxy.pid" >>"$LOG_DIR/haproxy.log" 2>&1 9>&- ||
			die "haproxy failed to start (log: $LOG_DIR/haproxy.log)"
	fi
	for i in $(seq 1 20); do
		amqp_answers "$HAPROXY_PORT" && break
		((i == 20)) && die "nothing answers AMQP through haproxy on 127.0.0.1:$HAPROXY_PORT"
		sleep 0.5
	done
	log "haproxy on 127.0.0.1:$HAPROXY_PORT started in $(since "$t0") (pid $(haproxy_pid || echo '?'))"
}

# haproxy_server_state SHORT: UP / DOWN / ... as haproxy's health checks see it.
haproxy_server_state() {
	have socat && [[ -S $HAPROXY_DIR/admin.sock ]] || return 1
	printf 'show stat\n' | timeout 5 socat stdio "unix-connect:$HAPROXY_DIR/admin.sock" 2>/dev/null |
		awk -F, -v s="$1" '$1 == "amqp" && $2 == s { print $18 }'
}

stop_haproxy() {
	local pid i
	pid="$(haproxy_pid)" || return 0
	log "stopping haproxy (pid $pid)"
	kill -TERM "$pid" 2>/dev/null || true
	for i in $(seq 1 20); do
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.25
	done
	kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
	rm -f "$HAPROXY_DIR/haproxy.pid"
}

# --- commands ------------------------------------------------------------------------
lock() {
	need_root
	mkdir -p "$BROKERS_DIR" "$LOG_DIR"
	exec 9>"$BROKERS_DIR/.lock"
	if ! flock -n 9; then
		log "another brokers.sh holds $BROKERS_DIR/.lock; waiting (up to 45 min)"
		flock -w 2700 9 || die "timed out waiting for $BROKERS_DIR/.lock"
	fi
}

up_local() {
	local t0
	t0="$(now_us)"
	AMQP_URI="$LOCAL_URI" bash "$SCRIPT_DIR/ensure-broker.sh" || die "the machine's broker is not available"
	log "local broker ready ($(since "$t0"))"
}

# up_root_nodes SHORT...: start the nodes that do not run (all at once), wait for all.
up_root_nodes() {
	local short t0
	t0="$(now_us)"
	ensure_root
	local started=()
	for short in "$@"; do
		if launch_node "$short"; then started+=("$short"); fi
	done
	for short in "$@"; do
		wait_node "$short"
	done
	if ((${#started[@]})); then
		log "started ${started[*]} in $(since "$t0")"
	fi
}

up_cluster_rest() {
	local t0
	t0="$(now_us)"
	ensure_joined n2
	ensure_joined n3
	# A node (re)started by this run must be back in the cluster.
	if [[ -n ${LAUNCHED[n1]:-}${LAUNCHED[n2]:-}${LAUNCHED[n3]:-} ]]; then
		wait_clustered n1
	fi
	ensure_haproxy
	log "cluster ready ($(since "$t0") for join/haproxy checks)"
}

print_summary() {
	local name
	printf '\n'
	for name in "$@"; do
		case "$name" in
		local)
			printf 'local    %s  (the machine'"'"'s RabbitMQ; control: rabbitmqctl ...)\n' "$LOCAL_URI"
			;;
		43)
			printf '43       %s  management http://127.0.0.1:15673/ (guest/guest)\n' "$(node_uri rabbit43)"
			printf '         control: %s ctl 43 -- status     logs: %s/rabbit43/\n' "$SELF" "$LOG_DIR"
			;;
		dev)
			printf 'dev      %s  management http://127.0.0.1:15693/ (guest/guest)\n' "$(node_uri dev43)"
			printf '         control: %s ctl dev -- status     logs: %s/dev43/\n' "$SELF" "$LOG_DIR"
			;;
		dev2)
			printf 'dev2     %s  management http://127.0.0.1:15694/ (guest/guest)\n' "$(node_uri dev2)"
			printf '         control: %s ctl dev2 -- status     logs: %s/dev2/\n' "$SELF" "$LOG_DIR"
			;;
		cluster)
			printf 'cluster  amqp://guest:guest@127.0.0.1:%s/  (haproxy -> %s %s %s)\n' "$HAPROXY_PORT" \
				"$(node_uri n1)" "$(node_uri n2)" "$(node_uri n3)"
			printf '         control: %s ctl cluster [--node n2] -- cluster_status\n' "$SELF"
			printf '         faults:  %s node-kill|node-start|node-stop cluster n1|n2|n3     logs: %s/n1..n3/\n' "$SELF" "$LOG_DIR"
			;;
		esac
		# shellcheck disable=SC2016 # printed for the user to run
		printf '         env:     eval "$(%s env %s)"\n' "$SELF" "$name"
	done
}

cmd_up() {
	local what="${1:-}" names=()
	case "$what" in
	local | 43 | dev | dev2 | cluster) names=("$what") ;;
	all) names=(local 43 cluster) ;;
	*) usage ;;
	esac
	lock
	log "up ${names[*]} (brokers dir $BROKERS_DIR)"
	local want_local=0 nodes=()
	for n in "${names[@]}"; do
		case "$n" in
		local) want_local=1 ;;
		43) nodes+=(rabbit43) ;;
		dev) nodes+=(dev43) ;;
		dev2) nodes+=(dev2) ;;
		cluster) nodes+=("${CLUSTER_NODES[@]}") ;;
		esac
	done
	((want_local)) && up_local
	if ((${#nodes[@]})); then
		if [[ " ${names[*]} " == *" cluster "* ]]; then
			# One apt-get run for both when the root is missing too.
			if [[ -f $READY_MARKER ]]; then
				ensure_host_tools haproxy:haproxy
			else
				ensure_host_tools haproxy:haproxy debootstrap:debootstrap
			fi
		fi
		up_root_nodes "${nodes[@]}"
		[[ " ${names[*]} " == *" cluster "* ]] && up_cluster_rest
	fi
	print_summary "${names[@]}"
	log "up ${names[*]}: done in $(since "$T_START")"
}

cmd_down() {
	local what="${1:-}" short
	case "$what" in 43 | dev | dev2 | cluster | all) ;; *) usage ;; esac
	lock
	if [[ ! -d $ROOT ]]; then
		log "nothing to stop ($ROOT does not exist)"
		return 0
	fi
	if [[ $what == cluster || $what == all ]]; then
		stop_haproxy
		# Stop the nodes together: none waits for the others to be gone.
		local pids=() rc=0
		for short in "${CLUSTER_NODES[@]}"; do
			stop_node "$short" &
			pids+=($!)
		done
		for p in "${pids[@]}"; do wait "$p" || rc=1; done
		((rc == 0)) || die "some cluster nodes did not stop"
	fi
	if [[ $what == 43 || $what == all ]]; then
		stop_node rabbit43
	fi
	if [[ $what == dev || $what == all ]]; then
		stop_node dev43
	fi
	if [[ $what == dev2 || $what == all ]]; then
		stop_node dev2
	fi
	# Our epmd goes when no node of the root is left.
	local any=0
	for short in rabbit43 dev43 dev2 "${CLUSTER_NODES[@]}"; do
		beam_pid "$short" >/dev/null && any=1
	done
	if ((any == 0)) && [[ -f $READY_MARKER ]]; then
		if [[ -n "$(root_pids)" ]]; then
			in_root_cmd
			run_t 10 "${IN_ROOT[@]}" epmd -port "$EPMD_PORT" -kill >/dev/null 2>&1 || true
			sleep 0.5
		fi
		if [[ $what == all ]]; then
			kill_root_pids
			unmount_root
		fi
	fi
	log "down $what: done in $(since "$T_START")"
}

# default_cluster_node: n1 when it runs, else the first running node.
default_cluster_node() {
	local short
	for short in "${CLUSTER_NODES[@]}"; do
		if beam_pid "$short" >/dev/null; then
			printf '%s' "$short"
			return 0
		fi
	done
	return 1
}

check_cluster_node() {
	case "$1" in n1 | n2 | n3) ;; *) die "unknown cluster node '$1' (want n1, n2 or n3)" ;; esac
}

cmd_ctl() {
	local name="${1:-}" node=""
	[[ -n $name ]] || usage
	shift
	while (($#)); do
		case "$1" in
		--node)
			[[ $# -ge 2 ]] || die "--node needs a value"
			node="$2"
			shift 2
			;;
		--node=*)
			node="${1#*=}"
			shift
			;;
		--)
			shift
			break
			;;
		*) break ;;
		esac
	done
	case "$name" in
	local)
		[[ -z $node ]] || die "--node applies to the cluster only"
		exec timeout --kill-after=10 "$CTL_TIMEOUT" rabbitmqctl "$@"
		;;
	43)
		[[ -z $node || $node == rabbit43 ]] || die "--node applies to the cluster only"
		node=rabbit43
		;;
	dev)
		[[ -z $node || $node == dev43 ]] || die "--node applies to the cluster only"
		node=dev43
		;;
	dev2)
		[[ -z $node || $node == dev2 ]] || die "--node applies to the cluster only"
		node=dev2
		;;
	cluster)
		if [[ -n $node ]]; then
			node="${node%@localhost}"
			check_cluster_node "$node"
		else
			node="$(default_cluster_node)" || die "no cluster node runs; start them with: $SELF up cluster"
		fi
		;;
	*) die "unknown broker '$name' (want local, 43, dev, dev2 or cluster)" ;;
	esac
	need_root
	[[ -f $READY_MARKER ]] || die "broker $name is not provisioned; run: $SELF up $name"
	mountpoint -q "$ROOT/proc" || prepare_root
	node_vars "$node"
	in_root_cmd
	exec timeout --kill-after=10 "$CTL_TIMEOUT" "${IN_ROOT[@]}" "$IN_BIN/rabbitmqctl" -n "$NODE" "$@"
}

broker_version() {
	local name="$1" v="" short
	case "$name" in
	local)
		v="$(run_t 60 rabbitmq-diagnostics -q server_version 2>/dev/null)" || v=""
		if [[ -z $v ]]; then
			v="$(dpkg-query -W -f '${Version}' rabbitmq-server 2>/dev/null)" || v=""
			v="${v#*:}" v="${v%-*}"
			log "warning: could not ask the local broker its version; using the package's (${v:-unknown})"
		fi
		;;
	43 | dev | dev2 | cluster)
		case "$name" in
		43) short=rabbit43 ;;
		dev) short=dev43 ;;
		dev2) short=dev2 ;;
		*) short="$(default_cluster_node)" || short="" ;;
		esac
		if [[ -n $short ]] && [[ $(id -u) == 0 ]]; then
			mountpoint -q "$ROOT/proc" || prepare_root
			v="$(rdiag 60 "$short" -q server_version 2>/dev/null)" || v=""
		fi
		if [[ -z $v ]]; then
			v="$(pkg_version)" || v=""
			log "warning: could not ask broker $name its version (does it run? $SELF up $name); using the package's (${v:-unknown})"
		fi
		;;
	esac
	v="${v//[[:space:]]/}"
	printf '%s' "${v:-unknown}"
}

cmd_env() {
	local name="${1:-}" uri node_list="" node_uris="" version short mgmt=""
	case "$name" in
	local) uri="$LOCAL_URI" mgmt="http://guest:guest@127.0.0.1:15672/" ;;
	43 | dev | dev2)
		case "$name" in 43) short=rabbit43 ;; dev) short=dev43 ;; *) short=dev2 ;; esac
		uri="$(node_uri "$short")"
		node_vars "$short"
		mgmt="http://guest:guest@127.0.0.1:$MGMT_PORT/"
		;;
	cluster)
		uri="amqp://guest:guest@127.0.0.1:$HAPROXY_PORT/"
		node_list="${CLUSTER_NODES[*]}"
		for short in "${CLUSTER_NODES[@]}"; do
			node_uris+="${node_uris:+ }$(node_uri "$short")"
		done
		;;
	*) usage ;;
	esac
	version="$(broker_version "$name")"
	printf "export AMQP_URI='%s'\n" "$uri"
	printf "export RABBITRETRY_BROKER='%s'\n" "$name"
	printf "export RABBITRETRY_CTL='%s ctl %s --'\n" "$SELF" "$name"
	printf "export RABBITRETRY_NODES='%s'\n" "$node_list"
	printf "export RABBITRETRY_NODE_URIS='%s'\n" "$node_uris"
	if [[ $name == cluster ]]; then
		printf "export RABBITRETRY_NODE_CTL='%s node cluster'\n" "$SELF"
	else
		printf "export RABBITRETRY_NODE_CTL=''\n"
	fi
	printf "export RABBITRETRY_BROKER_VERSION='%s'\n" "$version"
	# The management HTTP API (empty: the broker has none; the cluster's
	# nodes run without it).
	printf "export RABBITRETRY_MGMT_URI='%s'\n" "$mgmt"
}

cmd_node() {
	local action="$1" name="${2:-}" short="${3:-}" pid t0 i state
	[[ $name == cluster ]] || die "$action works on the cluster only: $action cluster n1|n2|n3"
	short="${short%@localhost}"
	check_cluster_node "$short"
	lock
	[[ -f $READY_MARKER ]] || die "the cluster is not provisioned; run: $SELF up cluster"
	prepare_root
	node_vars "$short"
	t0="$(now_us)"
	case "$action" in
	node-kill)
		pid="$(beam_pid "$short")" || die "$NODE does not run"
		log "kill -9 $pid ($NODE's beam.smp)"
		kill -9 "$pid"
		for i in $(seq 1 40); do
			is_node_beam "$pid" "$NODE" || break
			((i == 40)) && die "$NODE (pid $pid) still there 10s after kill -9"
			sleep 0.25
		done
		log "$NODE killed"
		;;
	node-stop)
		beam_pid "$short" >/dev/null || die "$NODE does not run"
		stop_node "$short"
		;;
	node-start)
		launch_node "$short" || log "$NODE already runs"
		wait_node "$short"
		wait_clustered "$short"
		# Give haproxy's health check (1s) the chance to see it back.
		if haproxy_pid >/dev/null; then
			for i in $(seq 1 20); do
				state="$(haproxy_server_state "$short")" || break
				[[ $state == UP* ]] && break
				sleep 0.5
			done
		fi
		log "$short@localhost runs and is clustered again ($(since "$t0"))"
		;;
	esac
}

cmd_status() {
	local pid short state
	printf 'brokers dir: %s\n' "$BROKERS_DIR"
	if amqp_answers 5672; then
		printf '  local     running   %s  (machine broker, control: rabbitmqctl)\n' "$LOCAL_URI"
	else
		printf '  local     DOWN      %s\n' "$LOCAL_URI"
	fi
	if [[ ! -f $READY_MARKER ]]; then
		printf '  43/cluster: not provisioned (%s up 43|cluster)\n' "$SELF"
		return 0
	fi
	printf '  root: %s, rabbitmq-server %s\n' "$ROOT" "$(pkg_version || echo '?')"
	for short in rabbit43 dev43 dev2 "${CLUSTER_NODES[@]}"; do
		node_vars "$short"
		if pid="$(beam_pid "$short")"; then
			if amqp_answers "$AMQP_PORT"; then state=running; else state='app-down'; fi
			printf '  %-9s %-9s %s  node %s pid %s rss %s\n' "$short" "$state" "$(node_uri "$short")" "$NODE" "$pid" "$(rss_of "$pid")"
		else
			printf '  %-9s stopped   %s  node %s\n' "$short" "$(node_uri "$short")" "$NODE"
		fi
	done
	if pid="$(haproxy_pid)"; then
		state=""
		for short in "${CLUSTER_NODES[@]}"; do
			state+=" $short=$(haproxy_server_state "$short" || echo '?')"
		done
		printf '  haproxy   running   amqp://guest:guest@127.0.0.1:%s/  pid %s, backends:%s\n' "$HAPROXY_PORT" "$pid" "$state"
	else
		printf '  haproxy   stopped   amqp://guest:guest@127.0.0.1:%s/\n' "$HAPROXY_PORT"
	fi
}

# --- main ----------------------------------------------------------------------------
[[ $BROKERS_DIR == /* ]] || die "RABBITRETRY_BROKERS_DIR must be an absolute path (got '$BROKERS_DIR')"
have timeout || die "the 'timeout' command (coreutils) is required"

cmd="${1:-}"
[[ -n $cmd ]] || usage
shift
case "$cmd" in
up) cmd_up "$@" ;;
down) cmd_down "$@" ;;
env) cmd_env "$@" ;;
ctl) cmd_ctl "$@" ;;
node-kill | node-start | node-stop) cmd_node "$cmd" "$@" ;;
# node NAME kill|start|stop NODE: the same, in the argument order of the
# RABBITRETRY_NODE_CTL prefix ("<prefix> VERB NODE").
node) cmd_node "node-${2:-}" "${1:-}" "${3:-}" ;;
status) cmd_status ;;
-h | --help | help) usage ;;
*) usage ;;
esac
