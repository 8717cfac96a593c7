package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/poison/admin"
)

// ownAdminConnections returns the broker pids of the connections named name
// (unique to the test: behind a load balancer the broker sees the proxy's
// ports, so connections are told apart by name, not by client port).
func ownAdminConnections(t *testing.T, name string) []string {
	t.Helper()
	out, err := testkit.Ctl(t, 30*time.Second, "-q", "list_connections", "--no-table-headers", "pid", "client_properties")
	if err != nil {
		t.Fatal(err)
	}
	var pids []string
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && strings.Contains(line, `{"connection_name","`+name+`"}`) {
			pids = append(pids, f[0])
		}
	}
	return pids
}

// closeOwnAdminConnection makes the broker close this process's admin
// connection and waits until the broker no longer lists it.
func closeOwnAdminConnection(t *testing.T, name string) {
	t.Helper()
	pids := ownAdminConnections(t, name)
	if len(pids) != 1 {
		t.Errorf("want exactly one %s connection, found %v", name, pids)
		return
	}
	if _, err := testkit.Ctl(t, 30*time.Second, "close_connection", pids[0], "poisonctl test: connection closed midway"); err != nil {
		t.Error(err)
		return
	}
	testkit.WaitFor(t, 20*time.Second, "the broker to drop the admin connection", func() bool {
		for _, pid := range ownAdminConnections(t, name) {
			if pid == pids[0] {
				return false
			}
		}
		return true
	})
}

// breakingWriter captures stderr and, when the progress line "replayed
// <at>/" is written (on the replay's goroutine, between two messages),
// closes the admin's connection before returning.
type breakingWriter struct {
	t    *testing.T
	at   string
	name string // the admin connection's name
	once sync.Once
	testkit.SyncBuffer
}

func (w *breakingWriter) Write(p []byte) (int, error) {
	if strings.Contains(string(p), w.at) {
		w.once.Do(func() { closeOwnAdminConnection(w.t, w.name) })
	}
	return w.SyncBuffer.Write(p)
}

// A replay whose connection the broker closes midway stops, says how many
// messages were replayed and how many are left, and exits 1.
func TestReplayConnectionClosedMidway(t *testing.T) {
	testkit.HaveCtl(t)
	const n = 500
	fx := newFixture(t, n)
	name := "poisonctl-test." + fx.Poison
	stderr := &breakingWriter{t: t, at: "replayed 200/", name: name}
	var stdout testkit.SyncBuffer
	code := run([]string{"--uri", fx.uri, "--connection-name", name, "--queue", fx.Poison, "replay"}, &stdout, stderr)
	t.Logf("exit %d\nstdout: %s\nstderr: %s", code, stdout.String(), stderr.String())
	if code != exitFail {
		t.Errorf("exit %d, want %d", code, exitFail)
	}
	if want := fmt.Sprintf("replayed 200 of %d matching message(s) from %s; 0 skipped, 0 failed; 300 left in %s", n, fx.Poison, fx.Poison); !strings.Contains(stdout.String(), want) {
		t.Errorf("stdout lacks %q", want)
	}
	if !strings.Contains(stderr.String(), "nothing more was published") || strings.Contains(stderr.String(), "replayed 300/") {
		t.Errorf("stderr does not say the replay stopped at once")
	}
	if strings.Contains(stderr.String(), "may be both") {
		t.Errorf("stderr reports duplicates, but nothing was in flight")
	}
	inQ, inPoison := fx.depth(t, fx.Q), fx.depth(t, fx.Poison)
	t.Logf("ACCOUNT op=poisonctl-replay published=%d replayed=200 left=300 in_queue=%d in_poison=%d lost=%d", n, inQ, inPoison, n-inQ-inPoison)
	if inQ != 200 || inPoison != 300 {
		t.Errorf("queue %d, poison queue %d; want 200 and 300", inQ, inPoison)
	}
}

func TestReportReplay(t *testing.T) {
	stopped := errors.New("poison/admin: replay stopped: the channel reading queue closed")
	dupErr := &admin.MessageError{UUID: "u250", Queue: "q", Err: admin.ErrMaybeDuplicated}
	for _, tc := range []struct {
		name     string
		json     bool
		res      admin.ReplayResult
		err      error
		code     int
		stdout   []string
		stderr   []string
		noStderr []string
	}{
		{
			name: "complete",
			res:  admin.ReplayResult{Matched: 3, Replayed: 3},
			code: exitOK, stdout: []string{"replayed 3 of 3 matching message(s) from p; 0 skipped, 0 failed; 0 left in p"},
		},
		{
			name: "interrupted with one in doubt",
			res:  admin.ReplayResult{Matched: 500, Replayed: 250, Left: 250, Duplicated: []string{"u250"}, Errors: []error{dupErr}},
			err:  stopped,
			code: exitFail, stdout: []string{"replayed 250 of 500 matching message(s) from p; 0 skipped, 1 failed; 250 left in p"},
			stderr:   []string{"1 message(s) may be both in their original queue and still in p", "u250", "replay stopped"},
			noStderr: []string{"u249"},
		},
		{
			name: "left behind without an error",
			res:  admin.ReplayResult{Matched: 5, Replayed: 4, Left: 1},
			code: exitFail, stdout: []string{"1 left in p"},
		},
		{
			name: "json",
			json: true,
			res:  admin.ReplayResult{Matched: 500, Replayed: 250, Left: 250, Duplicated: []string{"u250"}, Errors: []error{dupErr}},
			err:  stopped,
			code: exitFail, stdout: []string{`"left": 250`, `"replayed": 250`, `"duplicated": [`, `"error": "poison/admin: replay stopped`},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var stdout, stderr testkit.SyncBuffer
			code := reportReplay(&options{queue: "p", json: tc.json}, tc.res, tc.err, &stdout, &stderr)
			if code != tc.code {
				t.Errorf("exit %d, want %d", code, tc.code)
			}
			for _, s := range tc.stdout {
				if !strings.Contains(stdout.String(), s) {
					t.Errorf("stdout lacks %q:\n%s", s, stdout.String())
				}
			}
			for _, s := range tc.stderr {
				if !strings.Contains(stderr.String(), s) {
					t.Errorf("stderr lacks %q:\n%s", s, stderr.String())
				}
			}
			for _, s := range tc.noStderr {
				if strings.Contains(stderr.String(), s) {
					t.Errorf("stderr has %q:\n%s", s, stderr.String())
				}
			}
			if tc.json {
				var v map[string]any
				if err := json.Unmarshal([]byte(stdout.String()), &v); err != nil {
					t.Errorf("stdout is not JSON: %v", err)
				}
			}
		})
	}
}
