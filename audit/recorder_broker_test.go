package audit_test

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// Records go to the attempts queue persistent; when the queue has been
// deleted (publishes return unroutable), the Recorder declares it again
// and republishes: the record is not lost.
func TestRecorderRedeclaresDeletedQueue(t *testing.T) {
	e := newBrokerEnv(t)
	rec, err := audit.NewRecorder(audit.RecorderConfig{URI: e.uri, Naming: e.naming})
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Close(context.Background())
	if _, err := e.ch.QueueDelete(e.naming.AttemptsQueue, false, false, false); err != nil {
		t.Fatal(err)
	}
	// A record made through the middleware path, outside any chain.
	h := rec.Middleware(rec.HandlerMiddleware(func(*message.Message) ([]*message.Message, error) { return nil, nil }))
	msg := newMessage("m-redeclare")
	if _, err := h(msg); err != nil {
		t.Fatal(err)
	}
	testkit.WaitFor(t, 20*time.Second, "the record published", func() bool { return rec.Stats().Published == 1 })
	if st := rec.Stats(); st.PublishFailures < 1 {
		t.Errorf("stats %+v: the first publish should have been returned unroutable", st)
	}
	d, ok, err := e.ch.Get(e.naming.AttemptsQueue, true)
	if err != nil || !ok {
		t.Fatalf("attempts queue: ok=%v err=%v", ok, err)
	}
	a, err := audit.UnmarshalAttempt(d.Body)
	if err != nil {
		t.Fatal(err)
	}
	if a.MessageID != "m-redeclare" || a.Outcome != audit.OutcomeSuccess || a.Attempt != 1 || d.DeliveryMode != 2 || d.MessageId != a.ID {
		t.Fatalf("record %+v, delivery mode %d, message-id %q", a, d.DeliveryMode, d.MessageId)
	}
}

func newMessage(id string) *message.Message {
	m := message.NewMessage(id, nil)
	m.SetContext(context.Background())
	return m
}

// An attempts queue that exists with another type is a clear error at
// NewRecorder (and the classic type can be chosen).
func TestRecorderQueueTypeMismatch(t *testing.T) {
	e := newBrokerEnv(t)
	rec, err := audit.NewRecorder(audit.RecorderConfig{URI: e.uri, Naming: e.naming, QueueType: audit.QueueTypeClassic})
	if err != nil {
		t.Fatal(err)
	}
	if err := rec.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	_, err = audit.NewRecorder(audit.RecorderConfig{URI: e.uri, Naming: e.naming}) // quorum by default
	if err == nil || !strings.Contains(err.Error(), e.naming.AttemptsQueue) || !strings.Contains(err.Error(), "exists with other arguments") {
		t.Fatalf("NewRecorder over a classic attempts queue: %v", err)
	}
}

// TestRecorderPublishThroughput measures how many attempt records per
// second the background publisher gets confirmed by the broker
// (AUDIT_RECORDER_N records, default 20,000, made by as many goroutines as
// CPUs through the Middleware).
func TestRecorderPublishThroughput(t *testing.T) {
	n := 20_000
	if v := os.Getenv("AUDIT_RECORDER_N"); v != "" {
		n, _ = strconv.Atoi(v)
	}
	e := newBrokerEnv(t)
	rec, err := audit.NewRecorder(audit.RecorderConfig{URI: e.uri, Naming: e.naming})
	if err != nil {
		t.Fatal(err)
	}
	h := rec.Middleware(rec.HandlerMiddleware(func(*message.Message) ([]*message.Message, error) { return nil, nil }))
	workers := runtime.GOMAXPROCS(0)
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			for i := w; i < n; i += workers {
				if _, err := h(newMessage(fmt.Sprintf("m-%d", i))); err != nil {
					t.Error(err)
					return
				}
			}
		}(w)
	}
	wg.Wait()
	made := time.Since(start)
	if err := rec.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	st := rec.Stats()
	if st.Published != uint64(n) {
		t.Fatalf("published %d of %d", st.Published, n)
	}
	testkit.WaitFor(t, 30*time.Second, "all records in the attempts queue", func() bool { return e.ready(e.naming.AttemptsQueue) == n })
	t.Logf("recorder: %d records made in %v, all confirmed after %v: %.0f records/s; %d publish failures",
		n, made.Round(time.Millisecond), took.Round(time.Millisecond), float64(n)/took.Seconds(), st.PublishFailures)
}
