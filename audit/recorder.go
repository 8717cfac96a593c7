package audit

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// Recorder records one Attempt per attempt the retry chain makes and
// publishes it, in the background, to the audit exchange, from which the
// Consumer writes it to the Store.
//
// Wiring (the order matters):
//
//	rec, _ := audit.NewRecorder(audit.RecorderConfig{URI: uri, QueueName: qn})
//	r.AddMiddleware(rec.Middleware)              // outside the retry chain
//	r.AddMiddleware(retry.Middleware)            // the chain; its Policy.Observer
//	                                             // includes rec.Observer() (middleware.Observers)
//	r.AddMiddleware(rec.HandlerMiddleware)       // inside: next to the handler
//
// or retry.Chain().AddTo(r, rec.HandlerMiddleware, ...). Without
// HandlerMiddleware, records have no duration or handler error, and an
// attempt the chain settled without running the handler (the
// RedeliveryGuard's requeue) is recorded as a success.
//
// Cost on the handler: the Middleware stores a small state in the message
// context and, after the chain returned, hands a record to a buffered
// channel (see BenchmarkRecorderMiddleware); no I/O. The record is in process
// memory only between the chain's return and the broker's confirm of its
// publish (milliseconds): a crash in that window loses that record (never
// the message, which the chain has settled). Records are published
// persistent (delivery mode 2) with mandatory and publisher confirms ("Publishers",
// "Consumer Acknowledgements and Publisher Confirms"); a batch that is not
// confirmed is republished with backoff (the record ID makes a duplicate
// harmless: Store.Write is idempotent).
type Recorder struct {
	cfg      RecorderConfig
	pub      *confirm.Publisher
	send     func(ctx context.Context, msgs []amqp.Publishing) error // pub's PublishRawBatch; tests replace it
	ownPub   bool
	records  chan Attempt
	mu       sync.RWMutex // held shared by senders, exclusively by Close
	closed   bool
	closing  chan struct{} // closed first by Close: blocked senders give up
	final    chan struct{} // closed once no sender is left: drain and stop
	abort    context.CancelFunc
	abortCtx context.Context
	flushed  chan struct{} // closed when the publisher goroutine ended
	inner    atomic.Bool   // HandlerMiddleware is in a chain
	inFlight atomic.Int64

	recorded, published, failures, rejected atomic.Uint64
	closeOnce                               sync.Once
	closeErr                                error
}

// observer is the middleware.Observer of a Recorder (Recorder.Observer).
type observer struct{ r *Recorder }

var _ middleware.Observer = observer{}

// NewRecorder validates cfg, connects (unless cfg.Publisher is set),
// declares the audit exchange and attempts queue (declareAttemptTopology) and
// starts the background publisher. It returns Validate's error, or the
// connection or declaration error.
func NewRecorder(cfg RecorderConfig) (*Recorder, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	r := newRecorder(cfg)
	r.pub = cfg.Publisher
	if r.pub == nil {
		pub, err := confirm.New(confirm.Config{URI: cfg.URI, ConnectionName: "rabbitretry-audit-recorder", Logger: cfg.Logger})
		if err != nil {
			return nil, fmt.Errorf("audit: connecting the recorder's publisher: %w", err)
		}
		r.pub, r.ownPub = pub, true
	}
	if err := r.declare(); err != nil {
		if r.ownPub {
			_ = r.pub.Close()
		}
		return nil, err
	}
	r.send = func(ctx context.Context, msgs []amqp.Publishing) error {
		return r.pub.PublishRawBatch(ctx, r.cfg.Naming.Exchange, attemptRoutingKey, msgs)
	}
	r.start()
	return r, nil
}

func newRecorder(cfg RecorderConfig) *Recorder {
	return &Recorder{cfg: cfg, records: make(chan Attempt, cfg.Buffer),
		closing: make(chan struct{}), final: make(chan struct{}), flushed: make(chan struct{})}
}

func (r *Recorder) start() {
	r.abortCtx, r.abort = context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for range r.cfg.Publishers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r.run()
		}()
	}
	go func() {
		wg.Wait()
		close(r.flushed)
	}()
}

func (r *Recorder) declare() error {
	return declareAttemptTopology(r.pub, r.cfg.Naming, r.cfg.QueueType)
}

type stateKey struct{}

// attemptState is what the Recorder learns about one attempt while the
// chain runs. Observer events and the HandlerMiddleware run on the
// handler's goroutine, but a handler may hand its message to others: mu
// guards it anyway.
//
// It is also the message's context for the rest of the chain (the parent
// context plus itself under stateKey): one allocation instead of two.
type attemptState struct {
	context.Context
	mu        sync.Mutex
	start     time.Time
	ran       bool
	took      time.Duration
	errText   string
	class     string
	outcome   Outcome
	delay     time.Duration
	tier      time.Duration
	failText  string // why a retry or poison copy was not held
	failed    bool
	poisonCls string
}

// Value returns the state itself for stateKey, else the parent's value.
func (st *attemptState) Value(key any) any {
	if _, ok := key.(stateKey); ok {
		return st
	}
	return st.Context.Value(key)
}

func stateOf(msg *message.Message) *attemptState {
	st, _ := msg.Context().Value(stateKey{}).(*attemptState)
	return st
}

// Middleware records the attempt. Add it OUTSIDE the retry chain (before it
// with (*message.Router).AddMiddleware). It puts the attempt's state into
// the message context (msg.SetContext), runs the chain and, when the chain
// returned, emits exactly one Attempt record:
//   - the outcome an Observer event set (retry, poisoned, dropped);
//   - else OutcomeNacked after a failed retry or poison publish
//     (RetryFailed / PoisonFailed), or when the chain returned an error
//     (the message was nacked or requeued);
//   - else OutcomeSuccess if the handler ran (or without HandlerMiddleware);
//   - else OutcomeRequeued: the handler did not run (a redelivered message
//     the RedeliveryGuard copied back to its queue, or a delivery that came
//     back before its retry delay was over, retrymeta.RemainingDelayKey,
//     which the guard sent through the Delayer again).
//
// The record is queued for the background publisher; when Buffer records
// are waiting, this call blocks until there is room (never drops).
func (r *Recorder) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		st := &attemptState{Context: msg.Context(), start: time.Now()}
		msg.SetContext(st)
		out, err := h(msg)
		r.record(r.attemptFrom(msg, st, err))
		return out, err
	}
}

// HandlerMiddleware measures the handler and keeps its error. Add it
// INSIDE the retry chain, next to the handler (after the chain's
// middleware, or as Chain().AddTo's inner middleware). Without the outer
// Middleware it does nothing.
func (r *Recorder) HandlerMiddleware(h message.HandlerFunc) message.HandlerFunc {
	// Known from the moment the router builds its handler (before any
	// message), so the outer Middleware can tell "not run" from "not
	// measured".
	r.inner.Store(true)
	return func(msg *message.Message) ([]*message.Message, error) {
		st := stateOf(msg)
		if st == nil {
			return h(msg)
		}
		start := time.Now()
		out, err := h(msg)
		took := time.Since(start)
		var text, class string
		if err != nil {
			text = r.cfg.ErrorText(err)
			class = r.cfg.Classifier.Classify(err).Class
		}
		st.mu.Lock()
		st.ran, st.took, st.errText, st.class = true, took, text, class
		st.mu.Unlock()
		return out, err
	}
}

func (r *Recorder) attemptFrom(msg *message.Message, st *attemptState, chainErr error) Attempt {
	ctx := msg.Context()
	a := Attempt{
		MessageID:     msg.UUID,
		CorrelationID: msg.Metadata.Get(retrymeta.PropCorrelationIDKey),
		Queue:         r.cfg.QueueName(ctx),
		Attempt:       middleware.Attempt(msg),
		StartedAt:     st.start,
	}
	if a.CorrelationID == "" {
		a.CorrelationID = msg.Metadata.Get(wmw.CorrelationIDMetadataKey)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	a.Duration, a.Error, a.ErrorClass = st.took, st.errText, st.class
	if _, class, ok := chainerr.Classified(chainErr); chainErr != nil && ok && class != "" {
		a.ErrorClass = class // e.g. "interrupted": what the chain acted on
	}
	switch {
	case st.outcome != "":
		a.Outcome = st.outcome
		if st.outcome == OutcomeRetry {
			a.Delay, a.Tier = st.delay, st.tier
		}
		if st.outcome == OutcomePoisoned {
			a.ErrorClass = st.poisonCls
			if a.Error == "" && chainErr == nil {
				a.Error = "handler not run"
			}
		}
		if st.failText != "" {
			a.Error = joinText(a.Error, st.failText)
		}
	case st.failed:
		a.Outcome = OutcomeNacked
		a.Error = joinText(a.Error, st.failText)
	case chainErr != nil:
		a.Outcome = OutcomeNacked
		if !st.ran || a.Error == "" {
			a.Error = joinText(a.Error, r.cfg.ErrorText(chainErr))
		}
	case retrymeta.RemainingDelay(msg) > 0:
		// The RedeliveryGuard never runs such a delivery (with or without
		// HandlerMiddleware).
		a.Outcome = OutcomeRequeued
		a.Error = "back before its retry delay was over: handler not run, copy held again for the rest"
	case st.ran || !r.inner.Load():
		if st.errText != "" {
			// The handler failed and the chain settled it without an event
			// (a fallback copy back to the queue, or a user middleware).
			a.Outcome = OutcomeNacked
		} else {
			a.Outcome = OutcomeSuccess
		}
	default:
		a.Outcome = OutcomeRequeued
		a.Error = "redelivered: handler not run, copy requeued"
	}
	return a
}

func joinText(a, b string) string {
	switch {
	case a == "":
		return b
	case b == "":
		return a
	}
	return a + "; " + b
}

// record queues a, blocking while the buffer is full.
func (r *Recorder) record(a Attempt) {
	r.recorded.Add(1)
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.closed {
		r.reject(a)
		return
	}
	select {
	case r.records <- a:
	case <-r.closing:
		r.reject(a)
	}
}

func (r *Recorder) reject(a Attempt) {
	r.rejected.Add(1)
	r.cfg.Logger.Error("Attempt record made after Close; not published", errRecorderClosed, watermill.LogFields{
		"message_uuid": a.MessageID, "attempt": a.Attempt, "outcome": string(a.Outcome),
	})
}

// Observer returns the middleware.Observer that tells the Recorder how the
// retry chain settled each attempt (a scheduled or failed retry, a poisoned,
// dropped or nacked message): pass it as router.Policy.Observer (with
// metrics, middleware.Observers(m.Observer(), rec.Observer())). Without it
// scheduled retries, poisonings and drops are not recorded as such
// (OutcomeRetry, OutcomePoisoned, OutcomeDropped). Every call returns an
// observer of the same Recorder.
func (r *Recorder) Observer() middleware.Observer { return observer{r} }

// RetryScheduled (middleware.Observer): the attempt's outcome is
// OutcomeRetry with the delay (and TierFor's tier).
func (o observer) RetryScheduled(msg *message.Message, _ int, delay, _ time.Duration) {
	st := stateOf(msg)
	if st == nil {
		return
	}
	var tier time.Duration
	if o.r.cfg.TierFor != nil {
		tier = o.r.cfg.TierFor(o.r.cfg.QueueName(msg.Context()), delay)
	}
	st.mu.Lock()
	st.outcome, st.delay, st.tier = OutcomeRetry, delay, tier
	st.mu.Unlock()
}

// RetryFailed (middleware.Observer): the error is kept; the
// attempt ends OutcomeNacked unless a later event settles it (an
// undelayable message is poisoned).
func (o observer) RetryFailed(msg *message.Message, _ int, err error) {
	o.r.failedCopy(msg, "retry not scheduled", err)
}

// PoisonFailed (middleware.Observer), like RetryFailed.
func (o observer) PoisonFailed(msg *message.Message, _ int, err error) {
	o.r.failedCopy(msg, "poison publish failed", err)
}

func (r *Recorder) failedCopy(msg *message.Message, what string, err error) {
	st := stateOf(msg)
	if st == nil {
		return
	}
	text := what + ": " + r.cfg.ErrorText(err)
	st.mu.Lock()
	st.failed, st.failText = true, joinText(st.failText, text)
	st.mu.Unlock()
}

// Poisoned (middleware.Observer): OutcomePoisoned with class.
func (o observer) Poisoned(msg *message.Message, _ int, class string) {
	st := stateOf(msg)
	if st == nil {
		return
	}
	st.mu.Lock()
	st.outcome, st.poisonCls = OutcomePoisoned, class
	st.mu.Unlock()
}

// Dropped (middleware.Observer): OutcomeDropped.
func (o observer) Dropped(msg *message.Message, _ int) {
	st := stateOf(msg)
	if st == nil {
		return
	}
	st.mu.Lock()
	st.outcome = OutcomeDropped
	st.mu.Unlock()
}

// Stats returns the counters.
func (r *Recorder) Stats() RecorderStats {
	return RecorderStats{
		Recorded: r.recorded.Load(), Published: r.published.Load(),
		Buffered:        len(r.records) + int(r.inFlight.Load()),
		PublishFailures: r.failures.Load(), Rejected: r.rejected.Load(),
	}
}
