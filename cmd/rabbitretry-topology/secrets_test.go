package main

import (
	"bytes"
	"context"
	"sync"
	"testing"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// Every command, with every failing kind of --uri, --management-url (and
// $AMQP_URI), prints no password on stdout or stderr (issue 19 item 14).
func TestNoPasswordInOutput(t *testing.T) {
	good := testkit.URI(t)
	mgmt := "http://guest:" + testkit.SentinelPassword + "@127.0.0.1:1/"
	var runs [][]string
	for _, uri := range testkit.SentinelURIs() {
		for _, cmd := range [][]string{
			{"show", "--queue", "secrets-test"}, {"tidy", "--queue", "secrets-test"},
			{"cascade", "waiting"}, {"cascade", "census"}, {"cascade", "redirect", "--from", "a", "--to", "b"},
		} {
			runs = append(runs, append([]string{"--uri", uri}, cmd...))
		}
	}
	// A management URL with a password, reached (refused) and not parsed.
	runs = append(runs,
		[]string{"--uri", good, "--management-url", mgmt, "show", "--queue", "secrets-test"},
		[]string{"--uri", good, "--management-url", "http://guest:" + testkit.SentinelPassword + "@127.0.0.1:15x72/", "show", "--queue", "secrets-test"},
		[]string{"--uri", good, "--management-url", mgmt, "cascade", "waiting"})
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
		go func() { // a refused login takes the broker seconds
			defer wg.Done()
			var out, errb bytes.Buffer
			code := runContext(context.Background(), args, &out, &errb)
			mu.Lock()
			results = append(results, result{args, out.String(), errb.String(), code})
			mu.Unlock()
		}()
	}
	wg.Wait()
	for _, uri := range testkit.SentinelURIs() {
		t.Setenv("AMQP_URI", uri)
		code, out, errOut := runArgs("show", "--queue", "secrets-test")
		results = append(results, result{[]string{"$AMQP_URI", "show"}, out, errOut, code})
	}
	for _, r := range results {
		if r.code == exitOK {
			t.Errorf("%v: exit 0", r.args)
		}
		testkit.CheckNoSentinel(t, r.args[len(r.args)-1], r.out, r.errOut)
	}
	t.Logf("%d command outputs checked", len(results))
}
