package audit

import (
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

// The binding evaluation the to-exchange route check relies on, as
// RabbitMQ's exchange types route ("Exchanges" guide; topic: "*" one
// word, "#" zero or more).
func TestBindingMatches(t *testing.T) {
	for _, c := range []struct {
		typ, bkey, key string
		args           map[string]any
		headers        amqp.Table
		want           bool
	}{
		{"fanout", "x", "anything", nil, nil, true},
		{"direct", "a.b", "a.b", nil, nil, true},
		{"direct", "a.b", "a.c", nil, nil, false},
		{"topic", "#", "", nil, nil, true},
		{"topic", "#", "a.b.c", nil, nil, true},
		{"topic", "order.*", "order.created", nil, nil, true},
		{"topic", "order.*", "order.created.eu", nil, nil, false},
		{"topic", "order.#", "order", nil, nil, true},
		{"topic", "*.created", "order.created", nil, nil, true},
		{"topic", "a.#.z", "a.b.c.z", nil, nil, true},
		{"topic", "a.#.z", "a.b.c", nil, nil, false},
		{"topic", "a", "a.", nil, nil, false},
		{"headers", "", "", map[string]any{"x-match": "all", "tenant": "acme", "region": "eu"}, amqp.Table{"tenant": "acme", "region": "eu"}, true},
		{"headers", "", "", map[string]any{"x-match": "all", "tenant": "acme", "region": "eu"}, amqp.Table{"tenant": "acme"}, false},
		{"headers", "", "", map[string]any{"x-match": "any", "tenant": "acme", "region": "eu"}, amqp.Table{"region": "eu"}, true},
		{"headers", "", "", map[string]any{"tenant": "acme"}, amqp.Table{"tenant": "globex"}, false},
		{"headers", "", "", map[string]any{"x-match": "any", "n": float64(1)}, amqp.Table{"n": int64(1)}, true},
		{"x-consistent-hash", "1", "k", nil, nil, true},
	} {
		b := mgmtBinding{RoutingKey: c.bkey, Arguments: c.args}
		if got := bindingMatches(c.typ, b, c.key, c.headers); got != c.want {
			t.Errorf("%s %q %v with key %q headers %v: %v, want %v", c.typ, c.bkey, c.args, c.key, c.headers, got, c.want)
		}
	}
}

// The management URL derived from the AMQP URI carries its credentials
// only in the request's basic auth: never in an error.
func TestManagementURLNeverInErrors(t *testing.T) {
	u, err := managementURL("amqp://svc:S3cretPW@127.0.0.1:1/vh")
	if err != nil || u != "http://svc:S3cretPW@127.0.0.1:15672" {
		t.Fatalf("%q %v", u, err)
	}
	rc, err := newRouteChecker("http://svc:S3cretPW@127.0.0.1:1/", "vh", defaultArrivalsQueue)
	if err != nil {
		t.Fatal(err)
	}
	_, _, err = rc.reachesOtherQueue(t.Context(), "orders", "k", nil)
	if err == nil || strings.Contains(err.Error(), "S3cretPW") {
		t.Fatalf("error %v", err)
	}
	if _, err := newRouteChecker("ftp://svc:S3cretPW@x/", "/", "q"); err == nil || strings.Contains(err.Error(), "S3cretPW") {
		t.Fatalf("bad scheme: %v", err)
	}
}
