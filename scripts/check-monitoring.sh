#!/usr/bin/env bash
# check-monitoring.sh - checks the Prometheus alerting rules in monitoring/
# with promtool (`promtool check rules`). promtool comes with Debian's
# `prometheus` package: when it is missing and we are root with apt-get, it is
# installed (no service is started by it here); otherwise the check is skipped
# with a message. The metric names the rules and the dashboard use are checked
# by go test (metrics.TestMonitoringNamesExist) everywhere.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v promtool >/dev/null 2>&1 && [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
	echo "check-monitoring: installing promtool (Debian package prometheus)" >&2
	export DEBIAN_FRONTEND=noninteractive
	if ! apt-get install -y -q --no-install-recommends prometheus </dev/null >/dev/null 2>&1; then
		apt-get update -q </dev/null >/dev/null 2>&1 || true
		apt-get install -y -q --no-install-recommends prometheus </dev/null >/dev/null 2>&1 || true
	fi
fi
if ! command -v promtool >/dev/null 2>&1; then
	echo "check-monitoring: promtool not available (apt-get install prometheus); rules not checked" >&2
	exit 0
fi
promtool check rules monitoring/alerts.yml
