#!/usr/bin/env bash
# fuzz.sh - run every Go fuzz target in the module for a short time.
#
# Usage: scripts/fuzz.sh            (or: make fuzz)
# Environment: GO (default go), FUZZTIME (default 10s), PKGS (default ./...)
#
# Targets are found with `go test -list '^Fuzz' ./...`; each one is run as
#   go test -run '^$' -fuzz "^Name$" -fuzztime $FUZZTIME <package>
# New crashers land in the package's testdata/fuzz/ (checked in as seeds).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="${PATH:-/usr/bin:/bin}:/usr/local/go/bin"
GO="${GO:-go}"
FUZZTIME="${FUZZTIME:-10s}"
PKGS="${PKGS:-./...}"

log() { printf 'fuzz.sh: %s\n' "$*" >&2; }

# `go test -list` prints the matching names of a package, then its
# "ok  <import path>  <time>" line; pair them up. $PKGS may hold several
# patterns, so it is split on purpose.
# shellcheck disable=SC2086
if ! listing="$("$GO" test -list '^Fuzz' $PKGS 2>&1)"; then
	printf '%s\n' "$listing" >&2
	log "ERROR: go test -list failed"
	exit 1
fi

targets=()
names=()
while IFS= read -r line; do
	case "$line" in
	Fuzz*) names+=("$line") ;;
	ok[[:space:]]*)
		pkg="$(awk '{print $2}' <<<"$line")"
		for n in ${names[@]+"${names[@]}"}; do targets+=("$pkg $n"); done
		names=()
		;;
	esac
done <<<"$listing"

if ((${#targets[@]} == 0)); then
	log "no fuzz targets found in $PKGS"
	exit 0
fi

failed=0
for t in "${targets[@]}"; do
	pkg="${t% *}"
	name="${t#* }"
	log "$pkg $name (fuzztime $FUZZTIME)"
	if ! "$GO" test -run '^$' -fuzz "^${name}\$" -fuzztime "$FUZZTIME" "$pkg"; then
		log "FAILED: $pkg $name"
		failed=1
	fi
done
exit "$failed"
