#!/usr/bin/env bash
# bench-compare.sh - the healthy path of this tree vs a baseline commit, side
# by side in one bench run: builds examples/bench at BASELINE (a commit) and
# at the work tree, then runs `bench -scenarios compare -baseline <old
# binary>`, which interleaves the overhead scenario of both builds round by
# round (each build drains bare watermill-amqp and the retry chain).
#
# Usage: scripts/bench-compare.sh BASELINE_COMMIT [bench flags, e.g. -uri ... -md out.md]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PATH="$PATH:/usr/local/go/bin"
base=${1:?usage: scripts/bench-compare.sh BASELINE_COMMIT [bench flags]}
shift
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/base" >/dev/null 2>&1 || true; rm -rf "$tmp"' EXIT
git worktree add --detach "$tmp/base" "$base" >/dev/null
(cd "$tmp/base" && go build -o "$tmp/bench-base" ./examples/bench)
go build -o "$tmp/bench-head" ./examples/bench
"$tmp/bench-head" -scenarios compare -baseline "$tmp/bench-base" "$@"
