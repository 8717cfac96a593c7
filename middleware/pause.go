package middleware

import (
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/sony/gobreaker"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// ErrDependencyUnavailable marks a handler error caused by a dependency that
// is down (a payment gateway, a database): wrap it (fmt.Errorf("charge: %w",
// ErrDependencyUnavailable)) or return DependencyUnavailable(err). With a
// Pause in the chain such an error is never charged as an attempt: it pauses
// consumption until the dependency answers again. Without a Pause it is an
// ordinary transient error.
var ErrDependencyUnavailable = errors.New("dependency unavailable")

// DependencyUnavailable wraps err so that errors.Is(result,
// ErrDependencyUnavailable) holds; errors.Is/As still see err. nil stays nil.
func DependencyUnavailable(err error) error {
	if err == nil {
		return nil
	}
	return &unavailableError{err: err}
}

type unavailableError struct{ err error }

func (e *unavailableError) Error() string   { return "dependency unavailable: " + e.err.Error() }
func (e *unavailableError) Unwrap() []error { return []error{ErrDependencyUnavailable, e.err} }

// IsDependencyOutage is the default PauseConfig.IsOutage: err wraps
// ErrDependencyUnavailable, or the open-state errors of Watermill's
// CircuitBreaker middleware (sony/gobreaker's ErrOpenState and
// ErrTooManyRequests): the breaker refused the call, so the handler's work
// was not even tried.
func IsDependencyOutage(err error) bool {
	return errors.Is(err, ErrDependencyUnavailable) ||
		errors.Is(err, gobreaker.ErrOpenState) || errors.Is(err, gobreaker.ErrTooManyRequests)
}

// Default values of PauseConfig.
const (
	defaultPauseProbeInterval    = time.Second
	defaultPauseMaxProbeInterval = 30 * time.Second
	defaultPauseMaxHold          = 5 * time.Minute
	defaultPauseWindow           = time.Minute
	defaultPauseMinRequests      = 20
)

// PauseObserver is told when consumption pauses and resumes (e.g. metrics).
// Calls are made with no lock held, from the handler goroutine that saw the
// transition.
type PauseObserver interface {
	// PauseStarted: consumption paused; reason is "dependency-unavailable"
	// or "failure-rate".
	PauseStarted(reason string)
	// PauseEnded: consumption resumed after being paused for d.
	PauseEnded(d time.Duration)
}

// PauseConfig configures a Pause. The zero value pauses on dependency errors
// (IsDependencyOutage) only, probing after 1 s, doubling up to 30 s.
type PauseConfig struct {
	// IsOutage reports whether a handler error means a dependency is down:
	// such an error pauses at once and is never charged as an attempt.
	// Default IsDependencyOutage.
	IsOutage func(error) bool
	// FailureRatio, when > 0, also pauses on a failure rate: when, over the
	// last Window, at least MinRequests handler runs ended and the share of
	// them that failed with an error Counts accepts is >= FailureRatio.
	// Range [0, 1]; default 0 (off). The run whose failure trips it is held
	// (not charged); the failures before it were ordinary attempts.
	FailureRatio float64
	// Window is the failure-rate window. Default 1 min.
	Window time.Duration
	// MinRequests is the fewest runs in Window before the rate can trip.
	// Default 20.
	MinRequests int
	// Counts reports whether a failure counts toward the failure rate (and,
	// while paused by the rate, keeps the pause when a probe fails). The
	// router passes its classifier: only failures that would be retried
	// count, so a malformed message cannot pause consumption. Default: every
	// error.
	Counts func(error) bool
	// ProbeInterval is the wait before the first probe after a pause; each
	// failed probe doubles it, up to MaxProbeInterval. Consumption resumes
	// at most MaxProbeInterval after the dependency recovers. Defaults
	// 1 s and 30 s.
	ProbeInterval    time.Duration
	MaxProbeInterval time.Duration
	// MaxHold bounds how long one message is held while paused: past it, the
	// message is handed back to its queue uncharged (a copy with the same
	// attempt number, through Delayer with delay 0, confirmed, then the
	// original is acked) and the next one is held instead. Keep it well
	// below the queue's consumer timeout (RabbitMQ "Delivery Acknowledgement
	// Timeout": 30 min by default), past which the broker would take the
	// delivery back. Default 5 min.
	MaxHold time.Duration
	// Delayer takes the uncharged copy at MaxHold. Required; router.New
	// passes its own.
	Delayer Delayer
	// Observer is told of pauses and resumes. Optional.
	Observer PauseObserver
	// Logger logs each transition (Info on resume, Error on pause). Default
	// NopLogger.
	Logger watermill.LoggerAdapter
}

func (c *PauseConfig) setDefaults() {
	if c.IsOutage == nil {
		c.IsOutage = IsDependencyOutage
	}
	if c.Window == 0 {
		c.Window = defaultPauseWindow
	}
	if c.MinRequests == 0 {
		c.MinRequests = defaultPauseMinRequests
	}
	if c.Counts == nil {
		c.Counts = func(error) bool { return true }
	}
	if c.ProbeInterval == 0 {
		c.ProbeInterval = defaultPauseProbeInterval
	}
	if c.MaxProbeInterval == 0 {
		c.MaxProbeInterval = max(defaultPauseMaxProbeInterval, c.ProbeInterval)
	}
	if c.MaxHold == 0 {
		c.MaxHold = defaultPauseMaxHold
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first bad field.
func (c PauseConfig) Validate() error {
	switch {
	case c.Delayer == nil:
		return errors.New("PauseConfig.Delayer is nil")
	case c.FailureRatio < 0 || c.FailureRatio > 1:
		return fmt.Errorf("PauseConfig.FailureRatio %v is outside [0, 1]", c.FailureRatio)
	case c.Window <= 0:
		return fmt.Errorf("PauseConfig.Window %v is not positive", c.Window)
	case c.MinRequests < 1:
		return fmt.Errorf("PauseConfig.MinRequests %d is below 1", c.MinRequests)
	case c.ProbeInterval <= 0:
		return fmt.Errorf("PauseConfig.ProbeInterval %v is not positive", c.ProbeInterval)
	case c.MaxProbeInterval < c.ProbeInterval:
		return fmt.Errorf("PauseConfig.MaxProbeInterval %v is below ProbeInterval %v", c.MaxProbeInterval, c.ProbeInterval)
	case c.MaxHold < c.ProbeInterval:
		return fmt.Errorf("PauseConfig.MaxHold %v is below ProbeInterval %v", c.MaxHold, c.ProbeInterval)
	}
	return nil
}

// Pause stops consuming while a dependency is down instead of burning
// attempts: the circuit-breaker pattern of MassTransit's kill switch or
// NServiceBus's consecutive-failures throttling, without charging the
// messages in hand.
//
// It sits just outside the handler (router.New puts it inside the
// Classifier). When a run fails with an outage error (IsOutage), or the
// failure rate trips, consumption pauses: the message in hand is held
// (unacked, not charged) and every other message that reaches the Pause is
// held before its handler runs. A watermill-amqp subscription hands over one
// delivery at a time and waits for its ack, so holding stops consumption;
// the rest stays in the broker (up to the prefetch in the client). After
// ProbeInterval one held message is run again as the probe: success resumes
// consumption (every held message runs); an outage error doubles the wait
// (up to MaxProbeInterval). A held message is never charged an attempt;
// at MaxHold it goes back to its queue uncharged. On shutdown (the message's
// context ends) a held message returns the context's error, which the
// Classifier turns into a nack without a copy (ClassInterrupted): the
// broker redelivers it later.
type Pause struct {
	cfg PauseConfig

	mu      sync.Mutex
	paused  bool
	reason  string
	since   time.Time
	resumed chan struct{} // closed on resume; replaced on each pause
	probe   chan struct{} // a token: the holder may probe
	wait    time.Duration // current probe interval
	next    time.Time     // earliest next probe
	window  rateWindow
}

// NewPause returns a Pause, or cfg.Validate's error after defaults are filled in.
func NewPause(cfg PauseConfig) (*Pause, error) {
	cfg.setDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	p := &Pause{cfg: cfg, probe: make(chan struct{}, 1)}
	p.probe <- struct{}{}
	p.window.init(cfg.Window)
	return p, nil
}

// Middleware holds messages while paused; see Pause.
func (p *Pause) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		var heldSince time.Time
		probing := false
		for {
			if resumed := p.pausedCh(); resumed != nil && !probing {
				if heldSince.IsZero() {
					heldSince = time.Now()
				}
				next, err := p.hold(msg, resumed, heldSince)
				switch {
				case next == holdRecycled:
					return nil, nil // the uncharged copy is held: ack the original
				case err != nil:
					return nil, err
				}
				probing = next == holdProbe
			}
			msg.SetContext(ctx) // an inner Timeout middleware replaced it on an earlier run
			out, err := h(msg)
			held := p.afterRun(err, probing, msg)
			if probing {
				p.releaseProbe()
				probing = false
			}
			if !held {
				return out, err
			}
			// Paused now: this run is not charged; the message waits.
			if heldSince.IsZero() {
				heldSince = time.Now()
			}
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
		}
	}
}

// What hold tells the Middleware to do next.
const (
	holdRun      = iota // the pause ended: run as usual
	holdProbe           // run as the probe (the probe token is taken)
	holdRecycled        // handed back uncharged: ack
)

// pausedCh returns the channel closed on resume while paused, else nil.
func (p *Pause) pausedCh() chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.paused {
		return nil
	}
	return p.resumed
}

// hold waits while paused until the pause ends, this message's turn to
// probe comes, MaxHold passes (the message is handed back: holdRecycled, or
// an error if no copy could be held) or ctx ends (ctx's error).
func (p *Pause) hold(msg *message.Message, resumed chan struct{}, heldSince time.Time) (int, error) {
	ctx := msg.Context()
	maxHold := time.NewTimer(time.Until(heldSince.Add(p.cfg.MaxHold)))
	defer maxHold.Stop()
	for {
		p.mu.Lock()
		wait := time.Until(p.next)
		p.mu.Unlock()
		probeTimer := time.NewTimer(max(wait, 0))
		select {
		case <-resumed:
			probeTimer.Stop()
			return holdRun, nil
		case <-ctx.Done():
			probeTimer.Stop()
			return holdRun, ctx.Err()
		case <-maxHold.C:
			probeTimer.Stop()
			return p.recycle(msg, heldSince)
		case <-probeTimer.C:
		}
		select {
		case <-p.probe:
			p.mu.Lock()
			paused, due := p.paused, !time.Now().Before(p.next)
			p.mu.Unlock()
			if paused && due {
				return holdProbe, nil
			}
			p.releaseProbe()
			if !paused {
				return holdRun, nil
			}
		case <-resumed:
			return holdRun, nil
		case <-ctx.Done():
			return holdRun, ctx.Err()
		case <-maxHold.C:
			return p.recycle(msg, heldSince)
		}
	}
}

// recycle hands a held message back to its queue uncharged: a copy with the
// same attempt number through the Delayer (delay 0). holdRecycled once the
// copy is held; otherwise a *chainerr.ScheduleError whose HandlerErr wraps
// chainerr.ErrHandlerNotRun (the fallback returns the delivery to the broker).
func (p *Pause) recycle(msg *message.Message, heldSince time.Time) (int, error) {
	ctx := msg.Context()
	attempt := Attempt(msg)
	c := retrymeta.CloneMessage(msg)
	retrymeta.StripDeliveryMetadata(c.Metadata)
	c.Metadata.Set(AttemptKey, strconv.Itoa(attempt))
	if err := p.cfg.Delayer.Schedule(ctx, c, 0); err != nil {
		// Not held: give the delivery back to the broker unprocessed (the
		// fallback pauses, then nacks with requeue); never run uncounted.
		p.cfg.Logger.Error("Paused: copy of a held message not held; returning it to the broker", err, watermill.LogFields{
			"message_uuid": msg.UUID, "held": time.Since(heldSince).String(), "attempt": attempt,
		})
		return holdRun, &chainerr.ScheduleError{Err: err, HandlerErr: fmt.Errorf("held while paused: %w", chainerr.ErrHandlerNotRun), Attempt: attempt}
	}
	p.cfg.Logger.Info("Paused: held message handed back to its queue uncharged", watermill.LogFields{
		"message_uuid": msg.UUID, "held": time.Since(heldSince).String(), "attempt": attempt,
	})
	return holdRecycled, nil
}

func (p *Pause) releaseProbe() {
	select {
	case p.probe <- struct{}{}:
	default:
	}
}

// afterRun records the outcome of a run and reports whether the message is
// to be held (paused, not charged).
func (p *Pause) afterRun(err error, probing bool, msg *message.Message) bool {
	now := time.Now()
	outage := err != nil && p.cfg.IsOutage(err)
	counted := err != nil && !outage && p.cfg.Counts(err)
	p.mu.Lock()
	if p.paused {
		keep := outage || (p.reason == pauseReasonRate && counted)
		if !keep {
			if !probing {
				// A message that ran because the pause ended meanwhile, or a
				// run that started before the pause: its result stands.
				p.mu.Unlock()
				return false
			}
			d := now.Sub(p.since)
			p.paused = false
			close(p.resumed)
			p.window.reset()
			p.mu.Unlock()
			p.cfg.Logger.Info("Dependency answered: consumption resumed", watermill.LogFields{
				"paused": d.String(), "message_uuid": msg.UUID,
			})
			if p.cfg.Observer != nil {
				p.cfg.Observer.PauseEnded(d)
			}
			return false
		}
		if probing {
			p.wait = min(2*p.wait, p.cfg.MaxProbeInterval)
			p.next = now.Add(p.wait)
			p.cfg.Logger.Info("Paused: probe failed", watermill.LogFields{
				"message_uuid": msg.UUID, "next_probe_in": p.wait.String(), "error": err.Error(),
			})
		}
		p.mu.Unlock()
		return true
	}
	reason := ""
	switch {
	case outage:
		reason = pauseReasonOutage
	case p.cfg.FailureRatio > 0:
		p.window.add(now, counted)
		if counted && p.window.trips(now, p.cfg.MinRequests, p.cfg.FailureRatio) {
			reason = pauseReasonRate
		}
	}
	if reason == "" {
		p.mu.Unlock()
		return false
	}
	p.paused, p.reason, p.since = true, reason, now
	p.resumed = make(chan struct{})
	p.wait = p.cfg.ProbeInterval
	p.next = now.Add(p.wait)
	p.mu.Unlock()
	p.cfg.Logger.Error("Dependency unavailable: consumption paused", err, watermill.LogFields{
		"reason": reason, "message_uuid": msg.UUID, "probe_in": p.cfg.ProbeInterval.String(),
	})
	if p.cfg.Observer != nil {
		p.cfg.Observer.PauseStarted(reason)
	}
	return true
}

const (
	pauseReasonOutage = "dependency-unavailable"
	pauseReasonRate   = "failure-rate"
)

// rateWindow counts runs and counted failures per second over a window.
type rateWindow struct {
	buckets []rateBucket
	width   time.Duration
}

type rateBucket struct {
	sec            int64
	runs, failures int
}

func (w *rateWindow) init(window time.Duration) {
	n := int(window/time.Second) + 1
	w.buckets = make([]rateBucket, n)
	w.width = window
}

func (w *rateWindow) reset() { clear(w.buckets) }

func (w *rateWindow) add(now time.Time, failed bool) {
	sec := now.Unix()
	b := &w.buckets[int(sec%int64(len(w.buckets)))]
	if b.sec != sec {
		*b = rateBucket{sec: sec}
	}
	b.runs++
	if failed {
		b.failures++
	}
}

func (w *rateWindow) trips(now time.Time, minRuns int, ratio float64) bool {
	oldest := now.Add(-w.width).Unix()
	runs, failures := 0, 0
	for _, b := range w.buckets {
		if b.sec > oldest && b.sec <= now.Unix() {
			runs += b.runs
			failures += b.failures
		}
	}
	return runs >= minRuns && float64(failures) >= ratio*float64(runs)
}
