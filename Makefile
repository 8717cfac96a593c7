# Makefile for rabbitretry. Tests need a RabbitMQ broker on AMQP_URI
# (default amqp://guest:guest@127.0.0.1:5672/); `make broker` makes sure one runs.

GO ?= go
GOFMT ?= gofmt
export PATH := $(PATH):/usr/local/go/bin
SHELL := /bin/bash

.PHONY: all broker test demo bench fuzz lint

all: lint test

broker:
	bash scripts/ensure-broker.sh

test: broker
	$(GO) vet ./...
	$(GO) test -race -count=1 -timeout 15m ./...

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
