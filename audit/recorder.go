package audit

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/cenkalti/backoff/v4"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"

	"github.com/rabbitretry/rabbitretry/internal/redact"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// Recorder defaults.
const (
	// DefaultBuffer is the default number of attempt records held in memory
	// waiting for the background publisher.
	DefaultBuffer = 10_000
	// DefaultPublishBatch is the default number of records published back
	// to back (pipelined) before waiting for their confirms.
	DefaultPublishBatch = 256
)

// ErrRecorderClosed is counted (Stats.Rejected) and logged for a record
// made after Close: it is not published.
var ErrRecorderClosed = errors.New("audit: recorder closed")

// RecorderConfig configures a Recorder. Zero values take the defaults
// documented per field.
type RecorderConfig struct {
	// URI is the AMQP URI of the broker the records are published to.
	// Required unless Publisher is set.
	URI string
	// Publisher, when set, publishes the records (a ConfirmPublisher shared
	// with other code; amqpretry's own is made after the Recorder, which
	// its Config.Observer needs, so it cannot be passed here); the Recorder
	// does not close it. Default: the Recorder's own ConfirmPublisher on URI
	// (mandatory publishes with publisher confirms, reconnecting, connection
	// name "rabbitretry-audit-recorder"), closed by Close.
	Publisher *amqpretry.ConfirmPublisher
	// UserID is the AMQP user-id property of every record: the RabbitMQ
	// user the records are published as. RabbitMQ checks it against the
	// publishing connection's user and refuses a mismatch (channel error
	// 406 PRECONDITION_FAILED: "Validated User-ID", the "Publishers"
	// guide), so a record carrying it was published by that user; the
	// Consumer stores only records of its ConsumerConfig.RecorderUsers.
	// Default: the user of URI (amqp.ParseURI; "guest" if the URI names
	// none); set it when the connection authenticates otherwise (SASL
	// EXTERNAL: the certificate's user). Required when Publisher is set
	// without URI: the user that Publisher connects as.
	UserID string
	// Naming names the audit exchange and attempts queue; the Consumer must
	// use the same. Default: DefaultExchange, DefaultAttemptsQueue.
	Naming Naming
	// QueueType of the attempts queue: QueueTypeQuorum (default) or
	// QueueTypeClassic.
	QueueType string
	// Buffer is how many records may wait in memory for the publisher.
	// When it is full, the recording call (the Middleware, after the chain
	// returned) BLOCKS until there is room: backpressure on the consumer,
	// never a dropped record. Default DefaultBuffer (10,000); must be >= 1.
	Buffer int
	// PublishBatch is how many records are written back to back before
	// their confirms are awaited. Default DefaultPublishBatch (256); range
	// 1..512.
	PublishBatch int
	// Publishers is the number of goroutines publishing batches
	// concurrently (each waits for its batch's confirms), so that one
	// batch's confirm round trip does not stall the next. Default 2; range
	// 1..16.
	Publishers int
	// QueueName names the originating queue of a message. Default the
	// router's subscribe topic (message.SubscribeTopicFromCtx); with
	// amqpretry pass the same function as amqpretry.Config.QueueName.
	QueueName func(ctx context.Context) string
	// TierFor maps a scheduled retry's delay to the wait-queue tier that
	// holds it (Attempt.Tier), e.g. func(_ string, d time.Duration)
	// time.Duration { return retry.Topology().TierFor(d) }. Default: no
	// tier recorded (0).
	TierFor func(queue string, d time.Duration) time.Duration
	// ErrorText renders the handler error into Attempt.Error; use the same
	// redaction as the retry chain. Default retrymeta.ErrorText(err,
	// retrymeta.DefaultMaxErrorBytes), the chain's default.
	ErrorText func(error) string
	// Classifier gives Attempt.ErrorClass of a handler error. Default
	// middleware.DefaultClassifier; pass the chain's (Chain().Classifier)
	// when it has rules of its own. A poisoning's class (Observer.Poisoned)
	// and a classification the chain returned take precedence.
	Classifier *middleware.Classifier
	// RetryBackoff paces republishing a batch the broker did not confirm.
	// Default: exponential from 100 ms, factor 2, capped at 10 s, forever
	// (until Close gives up).
	RetryBackoff func() backoff.BackOff
	// Logger logs publish failures and their recovery. Default NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *RecorderConfig) setDefaults() {
	c.Naming = c.Naming.WithDefaults()
	if c.UserID == "" && c.URI != "" {
		if u, err := amqp.ParseURI(c.URI); err == nil {
			c.UserID = u.Username
		}
	}
	if c.QueueType == "" {
		c.QueueType = QueueTypeQuorum
	}
	if c.Buffer == 0 {
		c.Buffer = DefaultBuffer
	}
	if c.PublishBatch == 0 {
		c.PublishBatch = DefaultPublishBatch
	}
	if c.Publishers == 0 {
		c.Publishers = 2
	}
	if c.QueueName == nil {
		c.QueueName = message.SubscribeTopicFromCtx
	}
	if c.ErrorText == nil {
		c.ErrorText = func(err error) string { return retrymeta.ErrorText(err, retrymeta.DefaultMaxErrorBytes) }
	}
	if c.Classifier == nil {
		c.Classifier = middleware.DefaultClassifier
	}
	if c.RetryBackoff == nil {
		c.RetryBackoff = func() backoff.BackOff {
			b := backoff.NewExponentialBackOff()
			b.InitialInterval = 100 * time.Millisecond
			b.MaxInterval = 10 * time.Second
			b.MaxElapsedTime = 0
			b.Reset()
			return b
		}
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first bad field. NewRecorder calls it after filling
// in defaults.
func (c RecorderConfig) Validate() error {
	if c.Publisher == nil && c.URI == "" {
		return errors.New("audit: RecorderConfig.URI is empty and no Publisher is set")
	}
	if c.Publisher == nil {
		if _, err := amqp.ParseURI(c.URI); err != nil {
			return fmt.Errorf("audit: RecorderConfig.URI is invalid: %w", redact.Error(err, c.URI))
		}
	}
	if c.UserID == "" {
		return errors.New("audit: RecorderConfig.UserID is empty: set the user the Publisher connects as (the Consumer stores only records whose validated user-id it trusts)")
	}
	if c.Buffer < 1 {
		return fmt.Errorf("audit: RecorderConfig.Buffer %d is below 1", c.Buffer)
	}
	if c.PublishBatch < 1 || c.PublishBatch > 512 {
		return fmt.Errorf("audit: RecorderConfig.PublishBatch %d is outside 1..512", c.PublishBatch)
	}
	if c.Publishers < 1 || c.Publishers > 16 {
		return fmt.Errorf("audit: RecorderConfig.Publishers %d is outside 1..16", c.Publishers)
	}
	if err := checkQueueType("RecorderConfig", c.QueueType); err != nil {
		return err
	}
	return c.Naming.validate("RecorderConfig")
}

// RecorderStats are the Recorder's counters.
type RecorderStats struct {
	// Recorded is the number of attempt records made.
	Recorded uint64
	// Published is the number confirmed by the broker.
	Published uint64
	// Buffered is the number in memory now (queued or being published).
	Buffered int
	// PublishFailures counts failed publish rounds (each retried).
	PublishFailures uint64
	// Rejected counts records made after Close (not published).
	Rejected uint64
}

// Recorder records one Attempt per attempt the retry chain makes and
// publishes it, in the background, to the audit exchange, from which the
// Consumer writes it to the Store.
//
// Wiring (the order matters):
//
//	rec, _ := audit.NewRecorder(audit.RecorderConfig{URI: uri, QueueName: qn})
//	r.AddMiddleware(rec.Middleware)              // outside the retry chain
//	r.AddMiddleware(retry.Middleware)            // the chain; its Config.Observer
//	                                             // includes rec (middleware.Observers)
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
	pub      *amqpretry.ConfirmPublisher
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

var _ middleware.Observer = (*Recorder)(nil)

// NewRecorder validates cfg, connects (unless cfg.Publisher is set),
// declares the audit exchange and attempts queue (DeclareAttempts) and
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
		pub, err := amqpretry.NewConfirmPublisher(amqpretry.PublisherConfig{URI: cfg.URI, ConnectionName: "rabbitretry-audit-recorder", Logger: cfg.Logger})
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
		return r.pub.PublishRawBatch(ctx, r.cfg.Naming.Exchange, AttemptRoutingKey, msgs)
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
	return DeclareAttempts(r.pub, r.cfg.Naming, r.cfg.QueueType)
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
		CorrelationID: msg.Metadata.Get(amqpretry.PropCorrelationIDKey),
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
	var ce *middleware.ClassifiedError
	if chainErr != nil && errors.As(chainErr, &ce) && ce.Class != "" {
		a.ErrorClass = ce.Class // e.g. "interrupted": what the chain acted on
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
	r.cfg.Logger.Error("Attempt record made after Close; not published", ErrRecorderClosed, watermill.LogFields{
		"message_uuid": a.MessageID, "attempt": a.Attempt, "outcome": string(a.Outcome),
	})
}

// RetryScheduled implements middleware.Observer: the attempt's outcome is
// OutcomeRetry with the delay (and TierFor's tier).
func (r *Recorder) RetryScheduled(msg *message.Message, _ int, delay, _ time.Duration) {
	st := stateOf(msg)
	if st == nil {
		return
	}
	var tier time.Duration
	if r.cfg.TierFor != nil {
		tier = r.cfg.TierFor(r.cfg.QueueName(msg.Context()), delay)
	}
	st.mu.Lock()
	st.outcome, st.delay, st.tier = OutcomeRetry, delay, tier
	st.mu.Unlock()
}

// RetryFailed implements middleware.Observer: the error is kept; the
// attempt ends OutcomeNacked unless a later event settles it (an
// undelayable message is poisoned).
func (r *Recorder) RetryFailed(msg *message.Message, _ int, err error) {
	r.failedCopy(msg, "retry not scheduled", err)
}

// PoisonFailed implements middleware.Observer, like RetryFailed.
func (r *Recorder) PoisonFailed(msg *message.Message, _ int, err error) {
	r.failedCopy(msg, "poison publish failed", err)
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

// Poisoned implements middleware.Observer: OutcomePoisoned with class.
func (r *Recorder) Poisoned(msg *message.Message, _ int, class string) {
	st := stateOf(msg)
	if st == nil {
		return
	}
	st.mu.Lock()
	st.outcome, st.poisonCls = OutcomePoisoned, class
	st.mu.Unlock()
}

// Dropped implements middleware.Observer: OutcomeDropped.
func (r *Recorder) Dropped(msg *message.Message, _ int) {
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

// run is the background publisher.
func (r *Recorder) run() {
	batch := make([]Attempt, 0, r.cfg.PublishBatch)
	for {
		batch = batch[:0]
		select {
		case a := <-r.records:
			batch = append(batch, a)
		case <-r.final:
			// No sender is left: publish what is buffered, then stop.
			for {
				batch = batch[:0]
				r.fill(&batch)
				if len(batch) == 0 {
					return
				}
				if !r.publish(batch) {
					return
				}
			}
		}
		r.fill(&batch)
		if !r.publish(batch) {
			return
		}
	}
}

// fill appends what is buffered, up to PublishBatch, without waiting.
func (r *Recorder) fill(batch *[]Attempt) {
	for len(*batch) < r.cfg.PublishBatch {
		select {
		case a := <-r.records:
			*batch = append(*batch, a)
		default:
			return
		}
	}
}

// publish publishes batch until the broker confirmed all of it; false if
// Close gave up first.
func (r *Recorder) publish(batch []Attempt) bool {
	r.inFlight.Add(int64(len(batch)))
	msgs := make([]amqp.Publishing, 0, len(batch))
	now := time.Now()
	for i := range batch {
		if batch[i].ID == "" {
			batch[i].ID = watermill.NewUUID()
		}
		body, err := MarshalAttempt(batch[i])
		if err != nil { // cannot happen for these field types; never drop silently
			r.cfg.Logger.Error("Marshalling attempt record failed", err, watermill.LogFields{"message_uuid": batch[i].MessageID})
			continue
		}
		msgs = append(msgs, amqp.Publishing{
			ContentType: "application/json", DeliveryMode: amqp.Persistent, MessageId: batch[i].ID, UserId: r.cfg.UserID,
			Timestamp: now, Type: "rabbitretry.audit.attempt", Body: body,
		})
	}
	var bo backoff.BackOff
	for {
		err := r.send(r.abortCtx, msgs)
		if err == nil {
			r.published.Add(uint64(len(msgs)))
			r.inFlight.Add(-int64(len(batch)))
			if bo != nil {
				r.cfg.Logger.Info("Audit records published again", watermill.LogFields{"records": len(msgs)})
			}
			return true
		}
		r.failures.Add(1)
		if r.abortCtx.Err() != nil {
			return false
		}
		if bo == nil {
			bo = r.cfg.RetryBackoff()
		}
		wait := bo.NextBackOff()
		if wait == backoff.Stop {
			wait = 10 * time.Second
		}
		r.cfg.Logger.Error("Publishing audit records failed; retrying (records held in memory)", err, watermill.LogFields{
			"records": len(msgs), "retry_in": wait.String(),
		})
		if r.pub != nil && (errors.Is(err, amqpretry.ErrUnroutable) || errors.Is(err, amqpretry.ErrChannelClosed)) {
			// The audit queue or exchange may have been deleted: declare again.
			if derr := r.declare(); derr != nil {
				r.cfg.Logger.Error("Declaring the audit topology again failed", derr, nil)
			}
		}
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-r.abortCtx.Done():
			t.Stop()
			return false
		}
	}
}

// Close stops recording (records made later are counted in
// Stats.Rejected and logged, not published), publishes everything buffered
// and waits for the broker's confirms. Close the router first, so no
// handler is still running. If ctx ends first, it stops publishing and
// returns ctx's error with the number of records left unpublished (lost).
// It then closes the Recorder's own publisher (not a Config.Publisher).
// Later calls return the first call's result.
func (r *Recorder) Close(ctx context.Context) error {
	r.closeOnce.Do(func() {
		close(r.closing)
		r.mu.Lock()
		r.closed = true
		r.mu.Unlock()
		close(r.final)
		select {
		case <-r.flushed:
		case <-ctx.Done():
			r.abort()
			<-r.flushed
			left := len(r.records) + int(r.inFlight.Load())
			r.closeErr = fmt.Errorf("audit: Recorder.Close: %d attempt records not published: %w", left, ctx.Err())
		}
		r.abort()
		if r.ownPub {
			if err := r.pub.Close(); err != nil && r.closeErr == nil {
				r.closeErr = err
			}
		}
	})
	return r.closeErr
}
