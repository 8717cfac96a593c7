package audit_test

import (
	"context"
	"strings"
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
