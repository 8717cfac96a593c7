#!/usr/bin/env bash
# account-table.sh - the reliability table of the README from the logs of
# `make test-brokers` (test-logs/test-<broker>.log): one row per fault test,
# one column per broker, each cell "published / handled / poisoned /
# duplicates / lost" from the test's ACCOUNT line.
#
# Usage: scripts/account-table.sh [LOGDIR]   (default test-logs)
set -euo pipefail
dir="${1:-test-logs}"
shopt -s nullglob
logs=()
for b in local 43 cluster; do
	[[ -f $dir/test-$b.log ]] && logs+=("$dir/test-$b.log")
done
for f in "$dir"/test-*.log; do
	case "$f" in "$dir"/test-local.log | "$dir"/test-43.log | "$dir"/test-cluster.log) ;; *) logs+=("$f") ;; esac
done
((${#logs[@]} > 0)) || {
	echo "no $dir/test-*.log: run make test-brokers first" >&2
	exit 1
}
awk '
	BEGIN { split("published handled poisoned duplicates lost", w, " "); for (i in w) want[w[i]] = 1 }
	FNR == 1 {
		b = FILENAME; sub(/.*test-/, "", b); sub(/\.log$/, "", b)
		brokers[++nb] = b
	}
	/ACCOUNT Test/ {
		delete v
		line = $0; sub(/.*ACCOUNT /, "", line)
		name = line; sub(/:.*/, "", name)
		cell = ""
		n = split(line, f, " ")
		for (i = 2; i <= n; i++) {
			split(f[i], kv, "=")
			sub(/[;,]$/, "", kv[2])
			if (kv[1] ~ /^(published|handled|poisoned|duplicates|lost)$/) v[kv[1]] = kv[2]
		}
		for (k in want) if (!(k in v)) v[k] = "–" # a field the test does not count
		cell = v["published"] " / " v["handled"] " / " v["poisoned"] " / " v["duplicates"] " / **" v["lost"] "**"
		if (!(name in seen)) { seen[name] = 1; order[++nt] = name }
		cells[name, b] = cell
	}
	END {
		printf "| test (published / handled / poisoned / duplicates / lost) |"
		for (i = 1; i <= nb; i++) printf " %s |", brokers[i]
		printf "\n|---|"
		for (i = 1; i <= nb; i++) printf "---|"
		printf "\n"
		for (t = 1; t <= nt; t++) {
			printf "| `%s` |", order[t]
			for (i = 1; i <= nb; i++) {
				c = cells[order[t], brokers[i]]
				printf " %s |", (c == "" ? "–" : c)
			}
			printf "\n"
		}
	}
' "${logs[@]}"
