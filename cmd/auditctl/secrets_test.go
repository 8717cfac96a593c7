package main

import (
	"bytes"
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// Every command, with every failing kind of --dsn and --uri (and
// $RABBITRETRY_PG_DSN, $AMQP_URI), prints no password on stdout or stderr
// (issue 19 item 14).
func TestNoPasswordInOutput(t *testing.T) {
	goodURI, goodDSN := testkit.URI(t), testkit.HavePG(t)
	fx := newFixture(t, "orders", "order.created", "billing") // a migrated schema with m-00..m-09
	t.Setenv(tokenEnv, "0123456789abcdef0123")
	t.Setenv(readTokenEnv, "")
	var runs [][]string
	for _, dsn := range testkit.SentinelDSNs() {
		for _, cmd := range [][]string{
			{"migrate"}, {"search"}, {"show", "m1"}, {"stats"}, {"prune", "--older-than", "1h"},
			{"resend", "--to-exchange", "--message-id", "m1", "--yes"}, {"serve", "--listen", "127.0.0.1:0"},
		} {
			runs = append(runs, append([]string{"--dsn", dsn, "--uri", goodURI}, cmd...))
		}
	}
	for _, uri := range testkit.SentinelURIs() {
		runs = append(runs,
			append(slices.Clone(fx.base), "--uri", uri, "resend", "--to-exchange", "--message-id", "m-05", "--yes"),
			append(slices.Clone(fx.base), "--uri", uri, "resend", "--to-queue", "--target-queue", "q", "--message-id", "m-05", "--yes"),
			append(slices.Clone(fx.base), "--uri", uri, "serve", "--listen", "127.0.0.1:0", "--enable-resend"))
	}
	type result struct {
		args        []string
		out, errOut string
		code        int
	}
	var mu sync.Mutex
	var results []result
	var wg sync.WaitGroup
	for _, args := range runs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// serve runs until its context ends; the others fail first.
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			var out, errb bytes.Buffer
			code := runContext(ctx, args, &out, &errb)
			mu.Lock()
			results = append(results, result{args, out.String(), errb.String(), code})
			mu.Unlock()
		}()
	}
	wg.Wait()
	for _, dsn := range testkit.SentinelDSNs() {
		t.Setenv("RABBITRETRY_PG_DSN", dsn)
		code, out, errOut := runCtl(t, "search")
		results = append(results, result{[]string{"$RABBITRETRY_PG_DSN", "search"}, out, errOut, code})
	}
	t.Setenv("RABBITRETRY_PG_DSN", goodDSN)
	for _, uri := range testkit.SentinelURIs() {
		t.Setenv("AMQP_URI", uri)
		code, out, errOut := runCtl(t, append(slices.Clone(fx.base), "resend", "--to-exchange", "--message-id", "m-05", "--yes")...)
		results = append(results, result{[]string{"$AMQP_URI", "resend"}, out, errOut, code})
	}
	for _, r := range results {
		if r.code == exitOK && r.args[len(r.args)-1] != "--enable-resend" {
			t.Errorf("%v: exit 0", r.args)
		}
		testkit.CheckNoSentinel(t, r.args[len(r.args)-1], r.out, r.errOut)
	}
	t.Logf("%d command outputs checked", len(results))
}
