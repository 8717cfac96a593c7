package audit

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// A full buffer blocks the recording call (backpressure) instead of
// dropping; once the publisher catches up, everything is published.
func TestRecorderBackpressureBlocksNeverDrops(t *testing.T) {
	gate := make(chan struct{})
	s := &sink{}
	cfg := RecorderConfig{URI: "amqp://unused/", Buffer: 2, PublishBatch: 1, Publishers: 1}
	cfg.setDefaults()
	r := newRecorder(cfg)
	r.send = func(ctx context.Context, msgs []amqp.Publishing) error {
		<-gate
		return s.send(ctx, msgs)
	}
	r.start()
	for i := 1; i <= 3; i++ { // one in flight (held at the gate), two buffered
		r.record(Attempt{MessageID: "m", Attempt: i, Outcome: OutcomeRetry})
	}
	testkit.WaitFor(t, 5*time.Second, "1 in flight and 2 buffered", func() bool { return r.Stats().Buffered == 3 })
	returned := make(chan struct{})
	go func() {
		r.record(Attempt{MessageID: "m", Attempt: 4, Outcome: OutcomeSuccess})
		close(returned)
	}()
	testkit.WaitFor(t, 5*time.Second, "the 4th record made", func() bool { return r.Stats().Recorded == 4 })
	select {
	case <-returned:
		t.Fatal("the recording call returned with the buffer full")
	default:
	}
	close(gate)
	testkit.Recv(t, returned, 5*time.Second)
	if err := r.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	got := s.of("m")
	if len(got) != 4 {
		t.Fatalf("%d records published, want 4", len(got))
	}
	for i, a := range got {
		if a.Attempt != i+1 {
			t.Errorf("record %d is attempt %d: order not kept", i, a.Attempt)
		}
	}
	if st := r.Stats(); st.Published != 4 || st.Buffered != 0 || st.Rejected != 0 {
		t.Errorf("stats %+v", st)
	}
}

// A batch the broker does not confirm is published again, with the same
// record IDs, until it is.
func TestRecorderRepublishesUnconfirmedBatch(t *testing.T) {
	s := &sink{}
	s.fail.Store(3)
	var ids [][]string
	cfg := RecorderConfig{URI: "amqp://unused/", RetryBackoff: func() backoff.BackOff { return backoff.NewConstantBackOff(time.Millisecond) }}
	cfg.setDefaults()
	r := newRecorder(cfg)
	r.send = func(ctx context.Context, msgs []amqp.Publishing) error {
		var round []string
		for _, m := range msgs {
			round = append(round, m.MessageId)
		}
		ids = append(ids, round)
		return s.send(ctx, msgs)
	}
	r.start()
	r.record(Attempt{MessageID: "m", Attempt: 1, Outcome: OutcomeSuccess})
	if err := r.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if len(ids) != 4 {
		t.Fatalf("%d publish rounds, want 4 (3 refused)", len(ids))
	}
	for _, round := range ids {
		if len(round) != 1 || round[0] != ids[0][0] {
			t.Fatalf("rounds %v: the record ID changed between publishes", ids)
		}
	}
	if st := r.Stats(); st.Published != 1 || st.PublishFailures != 3 {
		t.Errorf("stats %+v", st)
	}
}

// Close gives up when its context ends, saying how many records are lost;
// a record made after Close is rejected and counted.
func TestRecorderCloseDeadlineAndLateRecords(t *testing.T) {
	cfg := RecorderConfig{URI: "amqp://unused/", RetryBackoff: func() backoff.BackOff { return backoff.NewConstantBackOff(time.Millisecond) }}
	cfg.setDefaults()
	r := newRecorder(cfg)
	r.send = func(context.Context, []amqp.Publishing) error { return errors.New("broker unreachable") }
	r.start()
	for i := 0; i < 5; i++ {
		r.record(Attempt{MessageID: "m", Attempt: i + 1})
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err := r.Close(ctx)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "5 attempt records not published") {
		t.Fatalf("Close: %v", err)
	}
	r.record(Attempt{MessageID: "late"})
	if st := r.Stats(); st.Rejected != 1 || st.Published != 0 {
		t.Errorf("stats %+v", st)
	}
	if err2 := r.Close(context.Background()); err2 != err {
		t.Errorf("second Close: %v, want the first result", err2)
	}
}

func TestRecorderConfigValidate(t *testing.T) {
	for _, c := range []struct {
		cfg  RecorderConfig
		want string
	}{
		{RecorderConfig{}, "URI is empty"},
		{RecorderConfig{URI: "http://x"}, "URI is invalid"},
		{RecorderConfig{URI: "amqp://x/", Buffer: -1}, "Buffer -1"},
		{RecorderConfig{URI: "amqp://x/", PublishBatch: 513}, "PublishBatch 513"},
		{RecorderConfig{URI: "amqp://x/", QueueType: "stream"}, `QueueType "stream"`},
		{RecorderConfig{URI: "amqp://x/", Naming: Naming{Exchange: strings.Repeat("x", 256)}}, "Naming.Exchange"},
		{RecorderConfig{Publisher: &confirm.Publisher{}}, "UserID is empty"},
	} {
		_, err := NewRecorder(c.cfg)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: error %v, want one containing %q", c.cfg.URI, err, c.want)
		}
	}
}
