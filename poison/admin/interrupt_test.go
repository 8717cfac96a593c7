package admin_test

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/poison/admin"
)

// Item 13 of "Nothing lost on any path": the broker closes the connection
// of an operation's scanning channel (the one holding the basic.get
// deliveries and acking them) in the middle of the operation. The
// operation must stop publishing at once, report exact counts, and lose
// nothing.

const interruptN = 500 // messages in the poison queue
const interruptAt = 250

// namedAdmin returns an Admin whose connection has a unique client-provided
// name, so that the test closes its own connection and nobody else's.
func namedAdmin(t *testing.T, uri string) (*admin.Admin, string) {
	t.Helper()
	name := uniqueName(t, "admintest.conn")
	a, err := admin.NewNamed(admin.Config{URI: uri}, name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.Close() })
	return a, name
}

// connectionPIDs returns the broker pids of the connections whose
// client-provided name is name.
func connectionPIDs(t testing.TB, name string) []string {
	t.Helper()
	out, err := testkit.Ctl(t, 30*time.Second, "-q", "list_connections", "--no-table-headers", "pid", "client_properties")
	if err != nil {
		t.Fatal(err)
	}
	var pids []string
	for _, line := range strings.Split(out, "\n") {
		if strings.Contains(line, `{"connection_name","`+name+`"}`) {
			pids = append(pids, strings.Fields(line)[0])
		}
	}
	return pids
}

// closeConnection makes the broker close the connection named name
// (rabbitmqctl close_connection) and waits until the broker no longer lists
// it, which is after it sent connection.close to the client.
func closeConnection(t testing.TB, name string) {
	t.Helper()
	pids := connectionPIDs(t, name)
	if len(pids) != 1 {
		t.Errorf("want exactly one connection named %q, found %v", name, pids)
		return
	}
	if _, err := testkit.Ctl(t, 30*time.Second, "close_connection", pids[0], "admin test: scan connection closed midway"); err != nil {
		t.Error(err)
		return
	}
	testkit.WaitFor(t, 20*time.Second, "the broker to drop connection "+name, func() bool {
		for _, pid := range connectionPIDs(t, name) {
			if pid == pids[0] {
				return false
			}
		}
		return true
	})
}

// account checks where every published message ended up after an
// interrupted copy operation (Replay, Move) and logs the ACCOUNT line.
type account struct {
	op     string
	uuids  []string // published to the source queue, in queue order
	source string
	target string
	// As reported by the operation:
	done    int      // copied and confirmed removed from source
	left    int      // not confirmed removed from source
	inDoubt []string // may be in both queues
	// stopped is the index of the message being handled when the
	// connection was closed (-1: unknown, the failure was asynchronous);
	// inFlight tells whether that message had been written or acked
	// already (then it may be in doubt), or the operation was between two
	// messages (nothing in flight: nothing may be published afterwards).
	stopped  int
	inFlight bool
}

func (ac account) check(t *testing.T, fx *fixture) {
	t.Helper()
	inTarget := map[string]int{}
	for _, d := range fx.drain(t, ac.target) {
		inTarget[uuidOf(d)]++
	}
	inSource := map[string]int{}
	for _, d := range fx.drain(t, ac.source) {
		inSource[uuidOf(d)]++
	}
	n := len(ac.uuids)
	var lost, dups, copiedAfter int
	errorf := func(format string, args ...any) {
		t.Helper()
		if lost+copiedAfter < 5 {
			t.Errorf(format, args...)
		}
	}
	var copied, remaining []string
	for i, u := range ac.uuids {
		if inTarget[u] > 1 || inSource[u] > 1 {
			t.Errorf("%s: message %s is %d times in %s and %d times in %s", ac.op, u, inTarget[u], ac.target, inSource[u], ac.source)
		}
		if inTarget[u] == 0 && inSource[u] == 0 {
			errorf("%s: message %d (%s) lost", ac.op, i, u)
			lost++
		}
		if inTarget[u] > 0 && inSource[u] > 0 {
			dups++
			if !slices.Contains(ac.inDoubt, u) {
				t.Errorf("%s: message %d (%s) is in both queues but not reported", ac.op, i, u)
			}
		}
		if inTarget[u] > 0 && !slices.Contains(ac.inDoubt, u) {
			copied = append(copied, u)
		}
		if inSource[u] > 0 && !slices.Contains(ac.inDoubt, u) {
			remaining = append(remaining, u)
		}
		if ac.stopped >= 0 && inTarget[u] > 0 && (i > ac.stopped || (i == ac.stopped && !ac.inFlight)) {
			errorf("%s: message %d (%s) was copied to %s after the connection was closed at message %d", ac.op, i, u, ac.target, ac.stopped)
			copiedAfter++
		}
	}
	doneLabel := "replayed"
	if strings.HasPrefix(ac.op, "move") {
		doneLabel = "moved"
	}
	t.Logf("ACCOUNT op=%s published=%d %s=%d left=%d duplicates=%d lost=%d (reported in doubt: %s; copied after the failure: %d)",
		ac.op, n, doneLabel, ac.done, ac.left, dups, lost, brief(ac.inDoubt), copiedAfter)
	if len(ac.inDoubt) > 1 {
		t.Errorf("%s: %d messages reported in doubt, want at most the one in flight", ac.op, len(ac.inDoubt))
	}
	if ac.done+ac.left != n {
		t.Errorf("%s: done %d + left %d != %d published", ac.op, ac.done, ac.left, n)
	}
	if len(copied) != ac.done {
		t.Errorf("%s: reported %d done, but %d messages (not in doubt) are in %s", ac.op, ac.done, len(copied), ac.target)
	}
	if want := ac.left - len(ac.inDoubt); len(remaining) != want {
		t.Errorf("%s: reported %d left (%d of them in doubt), but %d other messages are in %s", ac.op, ac.left, len(ac.inDoubt), len(remaining), ac.source)
	}
	if ac.stopped >= 0 && ac.done != ac.stopped {
		t.Errorf("%s: reported %d done, want %d: the connection was closed while message %d was handled", ac.op, ac.done, ac.stopped, ac.stopped)
	}
}

// interruptions are the points where the scanning connection is closed:
// the step of the operation (see admin.SetHook; "progress" is Replay's
// Progress callback) when interruptAt messages were handled.
var interruptions = []struct {
	name     string
	step     string
	inFlight bool // the message being handled may be in doubt
}{
	{"between messages", "next", false},
	{"as the copy is published", "publish", true},
	{"copy confirmed, before its ack", "ack", true},
	{"ack sent, before it was confirmed", "acked", true},
}

func TestReplayScanConnectionClosed(t *testing.T) {
	testkit.HaveCtl(t)
	cases := append([]struct {
		name     string
		step     string
		inFlight bool
	}{{"in Progress", "progress", false}}, interruptions...)
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t)
			uuids := fx.publishPoisoned(t, interruptN)
			a, name := namedAdmin(t, fx.uri)
			var once sync.Once
			brk := func(step string, done int) {
				if step == tc.step && done == interruptAt {
					once.Do(func() { closeConnection(t, name) })
				}
			}
			admin.SetHook(a, brk)
			res, err := a.Replay(ctxT(t), fx.Poison, admin.Filter{}, admin.ReplayOptions{
				Progress: func(done, total int) { brk("progress", done) },
			})
			t.Logf("result: matched %d replayed %d left %d duplicated %s errors %d; err: %v",
				res.Matched, res.Replayed, res.Left, brief(res.Duplicated), len(res.Errors), err)
			if err == nil {
				t.Errorf("Replay returned no error after its connection was closed")
			}
			if res.Matched != interruptN {
				t.Errorf("Matched = %d", res.Matched)
			}
			if res.Left != res.Matched-res.Replayed {
				t.Errorf("Left = %d, want Matched - Replayed = %d", res.Left, res.Matched-res.Replayed)
			}
			if missing := slices.DeleteFunc(slices.Clone(res.Duplicated), func(u string) bool {
				return slices.ContainsFunc(res.Errors, func(e error) bool {
					var me *admin.MessageError
					return errors.As(e, &me) && me.UUID == u && errors.Is(e, admin.ErrMaybeDuplicated)
				})
			}); len(missing) > 0 {
				t.Errorf("%d duplicated messages have no MessageError matching ErrMaybeDuplicated in Errors", len(missing))
			}
			account{
				op: "replay", uuids: uuids, source: fx.Poison, target: fx.Q,
				done: res.Replayed, left: res.Left, inDoubt: res.Duplicated,
				stopped: interruptAt, inFlight: tc.inFlight,
			}.check(t, fx)
		})
	}
}

// The connection is closed from another goroutine while Replay runs: the
// failure lands wherever Replay happens to be. Whatever the outcome, the
// account must balance.
func TestReplayScanConnectionClosedWhileRunning(t *testing.T) {
	testkit.HaveCtl(t)
	fx := newFixture(t)
	const n = 3000
	uuids := fx.publishPoisoned(t, n)
	a, name := namedAdmin(t, fx.uri)
	started := make(chan struct{})
	var once sync.Once
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		<-started
		closeConnection(t, name)
	}()
	var replayedAtClose atomic.Int64
	res, err := a.Replay(ctxT(t), fx.Poison, admin.Filter{}, admin.ReplayOptions{
		Progress: func(done, total int) {
			replayedAtClose.Store(int64(done))
			once.Do(func() { close(started) })
		},
	})
	<-closed
	t.Logf("result: matched %d replayed %d left %d duplicated %s; err: %v", res.Matched, res.Replayed, res.Left, brief(res.Duplicated), err)
	if err == nil {
		t.Logf("Replay finished before the connection was closed; checking the account only")
	}
	account{
		op: "replay-running", uuids: uuids, source: fx.Poison, target: fx.Q,
		done: res.Replayed, left: res.Left, inDoubt: res.Duplicated, stopped: -1,
	}.check(t, fx)
}

// inDoubt returns the UUID of the *MessageError in err if err matches
// target.
func inDoubt(err, target error) []string {
	var me *admin.MessageError
	if errors.Is(err, target) && errors.As(err, &me) {
		return []string{me.UUID}
	}
	return nil
}

func TestMoveScanConnectionClosed(t *testing.T) {
	testkit.HaveCtl(t)
	for _, tc := range interruptions {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t)
			uuids := fx.publishPoisoned(t, interruptN)
			a, name := namedAdmin(t, fx.uri)
			var once sync.Once
			admin.SetHook(a, func(step string, done int) {
				if step == tc.step && done == interruptAt {
					once.Do(func() { closeConnection(t, name) })
				}
			})
			moved, err := a.Move(ctxT(t), fx.Poison, fx.Q2, admin.Filter{}, false)
			t.Logf("moved %d; err: %v", moved, err)
			if err == nil {
				t.Errorf("Move returned no error after its connection was closed")
			}
			account{
				op: "move", uuids: uuids, source: fx.Poison, target: fx.Q2,
				done: moved, left: interruptN - moved, inDoubt: inDoubt(err, admin.ErrMaybeDuplicated),
				stopped: interruptAt, inFlight: tc.inFlight,
			}.check(t, fx)
		})
	}
}

func TestPurgeScanConnectionClosed(t *testing.T) {
	testkit.HaveCtl(t)
	for _, tc := range []struct {
		name     string
		step     string
		inFlight bool
	}{
		{"between messages", "next", false},
		{"before the ack", "ack", false},
		{"ack sent, before it was confirmed", "acked", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := newFixture(t)
			uuids := fx.publishPoisoned(t, interruptN)
			a, name := namedAdmin(t, fx.uri)
			var once sync.Once
			admin.SetHook(a, func(step string, done int) {
				if step == tc.step && done == interruptAt {
					once.Do(func() { closeConnection(t, name) })
				}
			})
			purged, err := a.Purge(ctxT(t), fx.Poison, admin.Filter{}, false)
			t.Logf("purged %d; err: %v", purged, err)
			if err == nil {
				t.Errorf("Purge returned no error after its connection was closed")
			}
			doubt := inDoubt(err, admin.ErrRemovalUnconfirmed)
			left := map[string]bool{}
			for _, d := range fx.drain(t, fx.Poison) {
				left[uuidOf(d)] = true
			}
			var removed, removedUnreported int
			for i, u := range uuids {
				if left[u] {
					continue
				}
				removed++
				if i >= purged && !slices.Contains(doubt, u) {
					removedUnreported++
					t.Errorf("message %d (%s) was removed but not reported", i, u)
				}
			}
			t.Logf("ACCOUNT op=purge published=%d purged=%d left=%d removed=%d unconfirmed=%v removed_unreported=%d",
				interruptN, purged, len(left), removed, doubt, removedUnreported)
			if purged != interruptAt {
				t.Errorf("purged = %d, want %d", purged, interruptAt)
			}
			if len(doubt) > 1 || (!tc.inFlight && len(doubt) > 0) {
				t.Errorf("in doubt: %v", doubt)
			}
			if removed != purged && removed != purged+len(doubt) {
				t.Errorf("%d removed, %d reported (+%d unconfirmed)", removed, purged, len(doubt))
			}
			if removed+len(left) != interruptN {
				t.Errorf("removed %d + left %d != %d", removed, len(left), interruptN)
			}
		})
	}
}

// brief renders a UUID list for the log: its length and the first few.
func brief(uuids []string) string {
	if len(uuids) <= 3 {
		return fmt.Sprint(len(uuids), uuids)
	}
	return fmt.Sprint(len(uuids), uuids[:3], "...")
}
