package audit

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
	"github.com/rabbitretry/rabbitretry/router"
)

// sink collects what a Recorder publishes, decoded.
type sink struct {
	mu   sync.Mutex
	recs []Attempt
	fail atomic.Int32 // fail this many sends
}

func (s *sink) send(_ context.Context, msgs []amqp.Publishing) error {
	if s.fail.Load() > 0 {
		s.fail.Add(-1)
		return errors.New("broker refused (test)")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range msgs {
		a, err := unmarshalAttempt(m.Body)
		if err != nil {
			return err
		}
		if m.DeliveryMode != amqp.Persistent || m.MessageId != a.ID || a.ID == "" {
			return fmt.Errorf("record published with delivery mode %d, message-id %q, ID %q", m.DeliveryMode, m.MessageId, a.ID)
		}
		s.recs = append(s.recs, a)
	}
	return nil
}

// of returns uuid's records in attempt order (attempt number, then start
// time), as the store lists them: the Recorder's publishers run
// concurrently, so records arrive in any order.
func (s *sink) of(uuid string) []Attempt {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []Attempt
	for _, a := range s.recs {
		if a.MessageID == uuid {
			out = append(out, a)
		}
	}
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].Attempt != out[j].Attempt {
			return out[i].Attempt < out[j].Attempt
		}
		return out[i].StartedAt.Before(out[j].StartedAt)
	})
	return out
}

func (s *sink) count() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.recs)
}

// newTestRecorder is a Recorder publishing into s instead of a broker.
func newTestRecorder(t testing.TB, cfg RecorderConfig, s *sink) *Recorder {
	t.Helper()
	cfg.URI = "amqp://unused/"
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	r := newRecorder(cfg)
	r.send = s.send
	r.start()
	return r
}

func TestRecorderOutcomes(t *testing.T) {
	const topic = "orders"
	s := &sink{}
	rec := newTestRecorder(t, RecorderConfig{
		TierFor: func(q string, d time.Duration) time.Duration {
			if q != topic {
				t.Errorf("TierFor got queue %q", q)
			}
			return 2 * d
		},
	}, s)
	logger := watermill.NopLogger{}
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 64}, logger)
	mem, err := middleware.NewMemoryDelayer(ps, nil, logger)
	if err != nil {
		t.Fatal(err)
	}
	var failSchedule sync.Map // uuid -> remaining forced Schedule failures
	delayer := testkit.DelayerFunc(func(ctx context.Context, msg *message.Message, d time.Duration) error {
		if v, ok := failSchedule.Load(msg.UUID); ok && v.(int) > 0 {
			failSchedule.Store(msg.UUID, v.(int)-1)
			return errors.New("wait queue refused the copy")
		}
		return mem.Schedule(ctx, msg, d)
	})
	chain, err := router.New(router.Config{
		Delayer: delayer, PoisonPublisher: gochannel.NewGoChannel(gochannel.Config{Persistent: true}, logger), Policy: router.Policy{MaxAttempts: 3, Backoff: testkit.ExactBackoff(20 * time.Millisecond), Observer: middleware.Observers(middleware.NopObserver{}, rec.Observer()), FallbackPause: -1},
		Logger: logger,
	})
	if err != nil {
		t.Fatal(err)
	}
	r, err := message.NewRouter(message.RouterConfig{}, logger)
	if err != nil {
		t.Fatal(err)
	}
	r.AddMiddleware(rec.Middleware)
	chain.AddTo(r, rec.HandlerMiddleware)

	type plan func(attempt int) error
	plans := map[string]plan{}
	var ran sync.Map // uuid -> handler runs
	r.AddConsumerHandler("svc", topic, ps, func(msg *message.Message) error {
		n, _ := ran.LoadOrStore(msg.UUID, new(atomic.Int32))
		n.(*atomic.Int32).Add(1)
		if p := plans[msg.UUID]; p != nil {
			return p(middleware.Attempt(msg))
		}
		return nil
	})
	newMsg := func(p plan) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte("x"))
		plans[m.UUID] = p
		return m
	}
	transient := errors.New("dependency unavailable")
	success := newMsg(nil)
	retryThenOK := newMsg(func(n int) error {
		if n == 1 {
			return transient
		}
		return nil
	})
	permanent := newMsg(func(int) error { return middleware.Permanent(errors.New("unknown customer")) })
	exhaustedNotRun := newMsg(func(int) error { return errors.New("must not run") })
	exhaustedNotRun.Metadata.Set(middleware.AttemptKey, "4")            // past MaxAttempts 3
	exhaustedNotRun.Metadata.Set(middleware.OriginalQueueKey, "orders") // a copy of this queue's chain (gochannel)
	dropped := newMsg(func(int) error { return middleware.Drop(errors.New("obsolete event")) })
	nacked := newMsg(func(n int) error {
		if n == 1 {
			return transient
		}
		return nil
	})
	failSchedule.Store(nacked.UUID, 1) // the retry copy is refused; the fallback copy is held
	redelivered := newMsg(nil)
	redelivered.Metadata.Set(retrymeta.DeliveryRedeliveredKey, "true")
	redelivered.Metadata.Set("rabbitretry-amqp-correlation-id", "corr-7")

	go func() { _ = r.Run(context.Background()) }()
	<-r.Running()
	defer r.Close()
	all := []*message.Message{success, retryThenOK, permanent, exhaustedNotRun, dropped, nacked, redelivered}
	if err := ps.Publish(topic, all...); err != nil {
		t.Fatal(err)
	}
	type want struct {
		outcome Outcome
		attempt int
		class   string
		ran     bool
	}
	cases := []struct {
		name string
		msg  *message.Message
		want []want
	}{
		{"success", success, []want{{OutcomeSuccess, 1, "", true}}},
		{"retry then success", retryThenOK, []want{{OutcomeRetry, 1, middleware.ClassTransient, true}, {OutcomeSuccess, 2, "", true}}},
		{"poisoned permanent", permanent, []want{{OutcomePoisoned, 1, middleware.ClassPermanent, true}}},
		{"poisoned exhausted, handler not run", exhaustedNotRun, []want{{OutcomePoisoned, 4, middleware.ClassExhausted, false}}},
		{"dropped", dropped, []want{{OutcomeDropped, 1, middleware.ClassDropped, true}}},
		{"nacked after a failed schedule", nacked, []want{{OutcomeNacked, 1, middleware.ClassTransient, true}, {OutcomeSuccess, 2, "", true}}},
		{"redelivered: guard requeues", redelivered, []want{{OutcomeRequeued, 1, "", false}, {OutcomeSuccess, 1, "", true}}},
	}
	total := 0
	for _, c := range cases {
		total += len(c.want)
	}
	testkit.WaitFor(t, 10*time.Second, fmt.Sprintf("%d attempt records", total), func() bool { return s.count() >= total })
	r.Close()
	if err := rec.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := s.count(); n != total {
		t.Errorf("%d records, want %d", n, total)
	}
	for _, c := range cases {
		got := s.of(c.msg.UUID)
		if len(got) != len(c.want) {
			t.Errorf("%s: %d records %+v, want %d", c.name, len(got), got, len(c.want))
			continue
		}
		for i, w := range c.want {
			a := got[i]
			if a.Outcome != w.outcome || a.Attempt != w.attempt || a.ErrorClass != w.class || a.Queue != topic {
				t.Errorf("%s record %d: outcome %s attempt %d class %q queue %q, want %s %d %q %q",
					c.name, i, a.Outcome, a.Attempt, a.ErrorClass, a.Queue, w.outcome, w.attempt, w.class, topic)
			}
			if w.ran != (a.Duration > 0) {
				t.Errorf("%s record %d: duration %v, handler ran %v", c.name, i, a.Duration, w.ran)
			}
			if a.StartedAt.IsZero() || time.Since(a.StartedAt) > time.Minute {
				t.Errorf("%s record %d: started at %v", c.name, i, a.StartedAt)
			}
			if (a.Outcome == OutcomeSuccess) != (a.Error == "") {
				t.Errorf("%s record %d: outcome %s with error %q", c.name, i, a.Outcome, a.Error)
			}
		}
	}
	if got := s.of(retryThenOK.UUID); len(got) == 2 {
		if got[0].Delay != 20*time.Millisecond || got[0].Tier != 40*time.Millisecond || got[0].Error != "dependency unavailable" {
			t.Errorf("retry record: delay %v tier %v error %q", got[0].Delay, got[0].Tier, got[0].Error)
		}
	}
	if got := s.of(nacked.UUID); len(got) == 2 {
		if want := "dependency unavailable; retry not scheduled: wait queue refused the copy"; got[0].Error != want {
			t.Errorf("nacked record error %q, want %q", got[0].Error, want)
		}
	}
	if got := s.of(redelivered.UUID); len(got) == 2 && (got[0].CorrelationID != "corr-7" || got[1].CorrelationID != "corr-7") {
		t.Errorf("correlation ids %q %q", got[0].CorrelationID, got[1].CorrelationID)
	}
	if v, _ := ran.Load(exhaustedNotRun.UUID); v != nil {
		t.Errorf("handler ran for the exhausted message")
	}
	st := rec.Stats()
	if st.Recorded != uint64(total) || st.Published != uint64(total) || st.Buffered != 0 || st.Rejected != 0 {
		t.Errorf("stats %+v", st)
	}
	t.Logf("accounting: published %d messages, %d attempt records, %d confirmed, 0 lost", len(all), total, st.Published)
}
