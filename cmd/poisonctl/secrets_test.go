package main

import (
	"bytes"
	"context"
	"sync"
	"testing"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// Every command, with every failing kind of --uri (and $AMQP_URI), prints
// no password on stdout or stderr (issue 19 item 14).
func TestNoPasswordInOutput(t *testing.T) {
	testkit.URI(t)
	cmds := [][]string{
		{"list"}, {"show", "u1"}, {"replay"}, {"move", "--to", "elsewhere"}, {"purge", "--yes"}, {"stats"},
	}
	type result struct {
		what, out, errOut string
		code              int
	}
	var mu sync.Mutex
	var results []result
	var wg sync.WaitGroup
	for _, uri := range testkit.SentinelURIs() {
		for _, cmd := range cmds {
			wg.Add(1)
			go func() { // a refused login takes the broker seconds
				defer wg.Done()
				var out, errb bytes.Buffer
				code := runContext(context.Background(), append([]string{"--uri", uri, "--queue", "secrets-test.poison"}, cmd...), &out, &errb)
				mu.Lock()
				results = append(results, result{cmd[0], out.String(), errb.String(), code})
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	for _, uri := range testkit.SentinelURIs() {
		t.Setenv("AMQP_URI", uri)
		code, out, errOut := runCLI(t, "--queue", "secrets-test.poison", "list")
		results = append(results, result{"$AMQP_URI list", out, errOut, code})
	}
	for _, r := range results {
		if r.code == exitOK {
			t.Errorf("%s: exit 0", r.what)
		}
		testkit.CheckNoSentinel(t, r.what, r.out, r.errOut)
	}
	t.Logf("%d command outputs checked, e.g. %s", len(results), results[0].errOut)
}
