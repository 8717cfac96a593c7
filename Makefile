# Makefile for rabbitretry. Tests need a RabbitMQ broker on AMQP_URI
# (default amqp://guest:guest@127.0.0.1:5672/); `make broker` makes sure one runs.

GO ?= go
GOFMT ?= gofmt
export PATH := $(PATH):/usr/local/go/bin
SHELL := /bin/bash

.PHONY: all broker monitoring test test-faults demo bench fuzz lint test-brokers brokers-up brokers-down

all: lint test

broker:
	bash scripts/ensure-broker.sh

# PostgreSQL for the audit store tests (RABBITRETRY_PG_DSN, default
# postgres://postgres@127.0.0.1:5432/test?sslmode=disable).
postgres:
	bash scripts/ensure-postgres.sh >/dev/null

# promtool check rules on monitoring/alerts.yml (installs promtool when root).
monitoring:
	bash scripts/check-monitoring.sh

test: broker postgres monitoring
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 15m ./...
	# Frame sizes without the race detector (see TestHealthyPathStackDepth).
	$(GO) test -count=1 -run 'TestHealthyPathStackDepth' ./amqpretry/

# Fault tests that stop and restart the broker's app: nothing else may use the
# broker meanwhile, so they run alone (-p 1), after `make test`.
test-faults: broker
	RABBITRETRY_FAULTS=1 $(GO) test -race -count=1 -p 1 -timeout 20m -run 'TestBrokerRestartMidStorm' -v ./faults/

# The whole suite, fault tests included, against each broker of BROKERS in turn:
# local = the machine's RabbitMQ, 43 = RabbitMQ 4.3 in a Debian sid chroot,
# cluster = three 4.3 nodes behind HAProxy (see scripts/brokers.sh; needs root,
# provisions what is missing: debootstrap ~1-6 min and ~400 MB on a fresh machine).
# Every broker is tested even when an earlier one fails; the exit status says.
BROKERS ?= local 43 cluster
# Full `go test -v` output per broker; the console shows package results,
# failures and every ACCOUNT line.
BROKER_LOGS ?= test-logs

test-brokers:
	@failed=""; for b in $(BROKERS); do \
		echo "===== test-brokers: broker $$b ====="; \
		start=$$SECONDS; \
		if ! bash scripts/brokers.sh up $$b; then failed="$$failed $$b(up)"; continue; fi; \
		if ! envs="$$(bash scripts/brokers.sh env $$b)"; then failed="$$failed $$b(env)"; continue; fi; \
		echo "$$envs" | sed 's/^/    /'; \
		log="$(BROKER_LOGS)/test-$$b.log"; mkdir -p "$(BROKER_LOGS)"; \
		if ( set -o pipefail; eval "$$envs" && RABBITRETRY_FAULTS=1 $(GO) test -race -count=1 -p 1 -timeout 30m -v ./... 2>&1 \
			| tee "$$log" | grep --line-buffered -E '^(ok|FAIL|--- FAIL|panic:)|ACCOUNT' ); then \
			echo "===== test-brokers: broker $$b passed ($$((SECONDS - start))s) ====="; \
		else \
			echo "----- failures on broker $$b (full output: $$log) -----"; \
			grep -E -B40 -- '^\s*--- FAIL' "$$log" | tail -n 300; \
			echo "===== test-brokers: broker $$b FAILED ($$((SECONDS - start))s) ====="; failed="$$failed $$b"; \
		fi; \
	done; \
	if [ -n "$$failed" ]; then echo "test-brokers: failed on:$$failed"; exit 1; fi; \
	echo "test-brokers: passed on $(BROKERS)"

# Start (installing what is missing) / stop the brokers of scripts/brokers.sh.
# brokers-down never stops the machine's own broker.
brokers-up:
	bash scripts/brokers.sh up all

brokers-down:
	bash scripts/brokers.sh down all

demo: broker
	$(GO) run ./examples/quickstart
	$(GO) run ./examples/quickstart -backend=gochannel

bench: broker
	$(GO) run ./examples/bench

fuzz:
	GO="$(GO)" bash scripts/fuzz.sh

lint:
	@out="$$($(GOFMT) -l .)"; if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
