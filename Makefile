# Makefile for rabbitretry. Tests need a RabbitMQ broker on AMQP_URI
# (default amqp://guest:guest@127.0.0.1:5672/); `make broker` makes sure one runs.

GO ?= go
GOFMT ?= gofmt
export PATH := $(PATH):/usr/local/go/bin
SHELL := /bin/bash

.PHONY: all broker test test-faults demo bench fuzz lint

all: lint test

broker:
	bash scripts/ensure-broker.sh

test: broker
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 15m ./...

# Fault tests that stop and restart the broker's app: nothing else may use the
# broker meanwhile, so they run alone (-p 1), after `make test`.
test-faults: broker
	RABBITRETRY_FAULTS=1 $(GO) test -race -count=1 -p 1 -timeout 20m -run 'TestBrokerRestartMidStorm' -v ./faults/

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
