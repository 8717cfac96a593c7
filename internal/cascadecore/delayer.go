package cascadecore

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// core is what the Delayer and the Publisher share: the resolved Config,
// the publisher and what has been declared.
type core struct {
	cfg    Config
	pub    *confirm.Publisher
	ownPub bool

	mu       sync.Mutex
	declared bool
	bound    map[string]bool
	// legacy: the level queues were declared without x-delivery-limit (by
	// an earlier version); declare them as they are.
	legacy atomic.Bool
	// full: the levels that refused publishes (see full.go).
	full fullLevels

	// The topology check (Config.TopologyCheck): started by the first
	// declare, stopped by close.
	watchOnce sync.Once
	stopOnce  sync.Once
	stop      chan struct{}
	done      chan struct{}
}

// declare is Config.Declare on ch, with the level queues as found: if the
// broker refuses x-delivery-limit on a level queue declared without one
// (an earlier version's), it logs a warning and declares them without it
// from then on, on a new channel of the publisher (the refusal closed ch).
func (c *core) declare(ch *amqp.Channel) error {
	cfg := c.cfg
	cfg.legacyLevels = c.legacy.Load()
	err := cfg.Declare(ch)
	if err == nil || cfg.legacyLevels || !legacyLevelQueue(err) {
		return err
	}
	c.cfg.Logger.Error("Delay cascade level queues were declared without x-delivery-limit by an earlier version; "+
		"using them as they are (on RabbitMQ 4.x, a message returned 20 times by interrupted censuses moves on early). "+
		"Recreate the cascade once it is empty (README, delay cascade, upgrading)", err, watermill.LogFields{"prefix": c.cfg.Prefix})
	c.legacy.Store(true)
	cfg.legacyLevels = true
	ch2, cerr := c.pub.Channel()
	if cerr != nil {
		return errors.Join(err, cerr)
	}
	defer ch2.Close()
	return cfg.Declare(ch2)
}

func newCore(cfg Config) (*core, error) {
	cfg, err := cfg.resolved()
	if err != nil {
		return nil, err
	}
	c := &core{cfg: cfg, pub: cfg.Publisher, bound: map[string]bool{}, stop: make(chan struct{})}
	if c.pub == nil {
		if cfg.URI == "" {
			return nil, errors.New("cascade.Config: Publisher and URI are both empty; set one")
		}
		c.pub, err = confirm.New(confirm.Config{URI: cfg.URI, Logger: cfg.Logger})
		if err != nil {
			return nil, fmt.Errorf("cascade: connecting the publisher: %w", err)
		}
		c.ownPub = true
	}
	return c, nil
}

func (c *core) close() error {
	c.watchOnce.Do(func() {}) // no check starts after this
	c.stopOnce.Do(func() { close(c.stop) })
	if c.done != nil {
		<-c.done
	}
	if c.ownPub {
		return c.pub.Close()
	}
	return nil
}

// ensure declares the topology (once) and binds queue (once per queue),
// on a channel of its own.
func (c *core) ensure(queue string) error { return c.ensureBound(queue, false) }

// ensureBound is ensure; force binds queue even if it was bound before.
func (c *core) ensureBound(queue string, force bool) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.declared && c.bound[queue] && !force {
		return nil
	}
	ch, err := c.pub.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	if !c.declared {
		if err := c.declare(ch); err != nil {
			return err
		}
		c.declared = true
		c.startWatch()
		if ch.IsClosed() { // closed by a refused legacy level queue (core.declare)
			if ch, err = c.pub.Channel(); err != nil {
				return err
			}
			defer ch.Close()
		}
	}
	if err := c.cfg.BindDestination(ch, queue); err != nil {
		return err
	}
	c.bound[queue] = true
	return nil
}

// startWatch starts the topology check (once; not after close). Called
// with c.mu held.
func (c *core) startWatch() {
	if c.cfg.TopologyCheck < 0 {
		return
	}
	c.watchOnce.Do(func() {
		c.done = make(chan struct{})
		go c.watch()
	})
}

// watch checks the topology every TopologyCheck until close, and repairs it
// when a piece is missing.
func (c *core) watch() {
	defer close(c.done)
	t := time.NewTicker(c.cfg.TopologyCheck)
	defer t.Stop()
	warned := map[string]string{}
	for {
		select {
		case <-c.stop:
			return
		case <-t.C:
		}
		missing, err := c.checkTopology()
		if missing != "" {
			c.repair(missing, err)
			continue
		}
		if err != nil {
			c.cfg.Logger.Debug("Delay cascade topology check skipped", watermill.LogFields{"prefix": c.cfg.Prefix, "error": err.Error()})
			continue
		}
		c.checkFull()
		c.checkLengthLimits(warned)
	}
}

// checkLengthLimits logs an error for each level queue the management API
// (Config.ManagementURL) shows with a length limit, once per level and
// limit (warned remembers them), and has a stuck dead-letter backlog
// reported (checkBacklogs).
func (c *core) checkLengthLimits(warned map[string]string) {
	if c.cfg.ManagementURL == "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.cfg.TopologyCheck)
	defer cancel()
	stats, err := c.cfg.levelStats(ctx)
	if err != nil {
		c.cfg.Logger.Debug("Delay cascade length limit check skipped", watermill.LogFields{"prefix": c.cfg.Prefix, "error": err.Error()})
		return
	}
	for name, s := range stats {
		limit := s.lengthLimit()
		if limit != "" && warned[name] != limit {
			c.cfg.Logger.Error("Delay cascade level queue has a length limit (a policy?): once full it refuses scheduled messages "+
				"(they are held, Config.FullWait) and dead-lettering from the level above (those wait minutes in its dead-letter buffer); "+
				"exclude the level queues from length-limit policies", nil, watermill.LogFields{"queue": name, "limit": limit})
		}
		warned[name] = limit
	}
	c.checkBacklogs(stats)
}

// checkTopology passively declares the settings marker, the delivery
// exchange and each level's exchange and queue; it returns the name of the
// first one the broker reports missing (404 NOT_FOUND) with the error, or
// "" and an error that says nothing about the topology (no channel).
func (c *core) checkTopology() (missing string, err error) {
	ch, err := c.pub.Channel()
	if err != nil {
		return "", err
	}
	defer ch.Close()
	check := func(name string, err error) (string, error) {
		var aerr *amqp.Error
		if errors.As(err, &aerr) && aerr.Code == amqp.NotFound {
			return name, err
		}
		return "", err
	}
	cfg := &c.cfg
	if err := ch.ExchangeDeclarePassive(cfg.settingsExchange(), amqp.ExchangeFanout, true, false, true, false, nil); err != nil {
		return check("exchange "+cfg.settingsExchange(), err)
	}
	if err := ch.ExchangeDeclarePassive(cfg.DeliveryExchange(), amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
		return check("exchange "+cfg.DeliveryExchange(), err)
	}
	for n := cfg.Levels - 1; n >= 0; n-- {
		name := cfg.LevelName(n)
		if err := ch.ExchangeDeclarePassive(name, amqp.ExchangeTopic, true, false, false, false, nil); err != nil {
			return check("exchange "+name, err)
		}
		if _, err := ch.QueueDeclarePassive(name, true, false, false, false, nil); err != nil {
			return check("queue "+name, err)
		}
	}
	return "", nil
}

// repair declares the cascade again and binds again every destination
// bound so far, after checkTopology found missing missing. A destination
// that cannot be bound (its queue deleted) is dropped from the cache: the
// next publish to it binds it or reports why not.
func (c *core) repair(missing string, cause error) {
	c.cfg.Logger.Error("Delay cascade topology incomplete (deleted by an operator?); declaring it again", cause, watermill.LogFields{
		"prefix": c.cfg.Prefix, "missing": missing})
	c.mu.Lock()
	defer c.mu.Unlock()
	c.declared = false
	ch, err := c.pub.Channel()
	if err != nil {
		c.cfg.Logger.Error("Delay cascade redeclare failed; retrying at the next check", err, watermill.LogFields{"prefix": c.cfg.Prefix})
		return
	}
	defer func() { _ = ch.Close() }()
	if err := c.declare(ch); err != nil {
		c.cfg.Logger.Error("Delay cascade redeclare failed; retrying at the next check", err, watermill.LogFields{"prefix": c.cfg.Prefix})
		return
	}
	c.declared = true
	for q := range c.bound {
		if ch.IsClosed() {
			if ch, err = c.pub.Channel(); err != nil {
				c.declared = false // bind the rest at the next check
				return
			}
		}
		if err := c.cfg.BindDestination(ch, q); err != nil {
			c.cfg.Logger.Error("Delay cascade: binding a destination again failed", err, watermill.LogFields{"prefix": c.cfg.Prefix, "queue": q})
			delete(c.bound, q)
		}
	}
	// Messages that expired into the gap wait in a level's dead-letter
	// buffer for the worker's resend (minutes): with the management API,
	// have the workers resend now.
	if c.cfg.ManagementURL != "" && c.cfg.QueueType == amqpretry.QueueTypeQuorum {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := c.cfg.nudgeDeadLetterWorkers(ctx); err != nil {
			c.cfg.Logger.Error("Delay cascade: could not have the dead-letter workers resend now (management API; the user needs the policymaker tag); "+
				"messages that expired into the gap arrive at their next resend, minutes late", err, watermill.LogFields{"prefix": c.cfg.Prefix})
		}
	}
}

// forget drops what ensure cached, after the broker showed the topology or
// the binding missing.
func (c *core) forget(queue string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.declared = false
	delete(c.bound, queue)
}

// send marshals msg and publishes it with n grains for queue, mandatory and
// confirmed; if the broker shows the topology missing (returned as
// unroutable, or 404 NOT_FOUND) it redeclares and tries once more.
func (c *core) send(ctx context.Context, msg *message.Message, n uint64, queue string) error {
	key, err := c.cfg.routingKey(n, queue)
	if err != nil {
		return err
	}
	p, err := c.cfg.Marshaler.Marshal(msg)
	if err != nil {
		return fmt.Errorf("cascade: marshaling: %w", err)
	}
	// A per-message TTL would expire the message out of a level queue
	// early, skipping the rest of that level's wait (the lower of the two
	// TTLs applies, "Time-To-Live and Expiration"). Dead-lettering removes
	// it anyway after the first hop.
	p.Expiration = ""
	// The due time, for Census: publish time + the delay in grains. The
	// Marshaler returned a private copy of the headers.
	if p.Headers == nil {
		p.Headers = amqp.Table{}
	}
	due := time.Now().Add(time.Duration(n) * c.cfg.Grain)
	p.Headers[dueHeader] = formatDue(due)
	delete(p.Headers, censusHeader)
	if size, limit := headerBytes(p.Headers), c.headerLimit(queue); size > limit {
		return fmt.Errorf("%w: the delayed copy's headers take about %d bytes, more than the %d that stay deliverable once the broker adds an x-death entry per level",
			middleware.ErrCannotDelay, size, limit)
	}
	// The highest set bit's level (or, n = 0, the delivery exchange:
	// straight to the queue, mandatory checks its binding).
	exchange := c.cfg.EntryExchange(n)
	if err := c.ensure(queue); err != nil {
		return fmt.Errorf("cascade: declaring the cascade for %q: %w", queue, err)
	}
	if c.pathFull(n) && c.cfg.FullWait >= 0 && !due.After(time.Now().Add(c.cfg.FullWait)) {
		// A level on its way is full: it would refuse the message, or
		// refuse it from the level above, where it would wait minutes.
		return c.holdRefused(ctx, p, n, due, queue, nil)
	}
	err = c.pub.PublishRaw(ctx, exchange, key, p)
	if err != nil && topologyMissing(err) {
		c.cfg.Logger.Error("Delay cascade publish found no route; redeclaring", err, watermill.LogFields{
			"queue": queue, "exchange": exchange, "routing_key": key})
		c.forget(queue)
		if rerr := c.ensure(queue); rerr != nil {
			return errors.Join(err, fmt.Errorf("cascade: redeclaring the cascade for %q: %w", queue, rerr))
		}
		err = c.pub.PublishRaw(ctx, exchange, key, p)
	}
	if n > 0 && errors.Is(err, confirm.ErrNacked) {
		// A full level (a length limit: x-overflow reject-publish).
		return c.holdRefused(ctx, p, n, due, queue, err)
	}
	if err == nil && n > 0 {
		c.admitted(entryLevel(n))
	}
	return err
}

func topologyMissing(err error) bool {
	if errors.Is(err, confirm.ErrUnroutable) {
		return true
	}
	var aerr *amqp.Error
	return errors.As(err, &aerr) && aerr.Code == amqp.NotFound
}

// headerLimit is the largest header table a delayed copy may have:
// amqpwire.MaxCopyHeaderBytes less what the broker adds on the way, an
// x-death entry per level (queue, exchange, routing key, reason, count,
// time) and the x-first-death-* / x-last-death-* headers.
func (c *core) headerLimit(queue string) int {
	keyLen := 2*c.cfg.Levels + len(queue)
	nameLen := len(c.cfg.LevelName(0))
	perLevel := 160 + 2*nameLen + keyLen
	return amqpwire.MaxCopyHeaderBytes - c.cfg.Levels*perLevel - 6*(40+nameLen)
}

// Delayer implements middleware.Delayer with the delay cascade: a retry
// copy waits exactly its delay (rounded up to the grain) in the shared level
// queues instead of a per-queue tier, then goes back to its originating
// queue. Safe for concurrent use. Make it with NewDelayer; Close it after
// the router.
type Delayer struct {
	c *core
}

var _ middleware.Delayer = (*Delayer)(nil)

// NewDelayer returns a Delayer for cfg (defaults applied). With
// cfg.Publisher set it uses that publisher (an amqpretry.Retry's
// Publisher(), say) and never closes it; with cfg.URI it dials its own. It
// declares nothing yet: the cascade is declared on the first Schedule, and
// each destination is bound on its first use. Errors: Validate's, neither
// Publisher nor URI set, or the dial error.
func NewDelayer(cfg Config) (*Delayer, error) {
	c, err := newCore(cfg)
	if err != nil {
		return nil, err
	}
	return &Delayer{c: c}, nil
}

// config returns the config in use, with its defaults.
func (d *Delayer) config() Config { return d.c.cfg }

// Schedule publishes msg to the cascade so that it reaches its originating
// queue (Config.QueueName(ctx)) after delay, and returns nil once the
// broker confirmed it (publisher confirms, mandatory; RabbitMQ "Consumer
// Acknowledgements and Publisher Confirms").
//
// The delay used is max(delay, middleware.MinimumDelay(ctx)) (a handler's
// RetryAfter is a floor), rounded up to the grain. A delay above MaxDelay
// is held for MaxDelay (77.7 days by default) and the copy carries the rest
// (retrymeta.SetRemainingDelay, logged at Info): when it comes back, the
// RedeliveryGuard sends it through the cascade again, so it never runs
// earlier than asked. A delay of 0 grains is published straight to the
// delivery exchange. The first Schedule declares the cascade (Declare), the
// first for a queue binds it (BindDestination); if a publish shows either
// missing (unroutable, or 404), it redeclares and tries once more. It does
// not stop when ctx is cancelled (router shutdown): the publish is bounded
// by the publisher's ConfirmTimeout instead, so a retry in flight is not
// lost.
//
// Errors: wrapping middleware.ErrCannotDelay for a queue name the cascade
// cannot route (ErrBadQueueName) or headers too large to survive the
// x-death entries the levels add; a declare error
// (*amqpretry.DeclareError); or the publisher's (confirm.ErrNacked,
// ErrConfirmTimeout, ErrChannelClosed, ...), after which the republisher
// nacks the original.
func (d *Delayer) Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error {
	cfg := &d.c.cfg
	q := cfg.QueueName(ctx)
	if err := cfg.checkQueue(q); err != nil {
		return fmt.Errorf("%w: %w", middleware.ErrCannotDelay, err)
	}
	if minimum, ok := middleware.MinimumDelay(ctx); ok {
		delay = max(delay, minimum)
	}
	n, ok := cfg.grains(delay)
	var remaining time.Duration
	if !ok {
		n = uint64(1)<<uint(cfg.Levels) - 1
		remaining = delay - cfg.maxDelay()
		cfg.Logger.Info("Requested retry delay exceeds the delay cascade's maximum; held in several hops", watermill.LogFields{
			"queue": q, "requested": delay.String(), "max_delay": cfg.maxDelay().String(), "remaining": remaining.String()})
	}
	if n > 0 {
		// A copy sent straight back keeps what its maker set.
		retrymeta.SetRemainingDelay(msg.Metadata, remaining)
	}
	return d.c.send(context.WithoutCancel(ctx), msg, n, q)
}

// Bind declares the cascade (if this Delayer has not yet) and binds queue
// to it now (always: bindings are idempotent), instead of on the first
// Schedule for queue. Call it at startup to fail early (a missing queue, a
// cascade declared with other arguments), and after recreating a queue:
// the Delayer binds each queue once per process, and a deleted queue loses
// its binding. Errors: ErrBadQueueName (wrapped), *amqpretry.DeclareError,
// or the publisher's channel error.
func (d *Delayer) Bind(queue string) error { return d.c.bind(queue) }

func (c *core) bind(queue string) error {
	if err := c.cfg.checkQueue(queue); err != nil {
		return err
	}
	return c.ensureBound(queue, true)
}

// Waiting reports per level how many messages wait (see Config.Waiting), on
// a channel of the Delayer's publisher.
func (d *Delayer) Waiting(ctx context.Context) ([]LevelCount, error) {
	return d.c.waiting(ctx)
}

func (c *core) waiting(ctx context.Context) ([]LevelCount, error) {
	ch, err := c.pub.Channel()
	if err != nil {
		return nil, err
	}
	defer ch.Close()
	counts, err := c.cfg.Waiting(ctx, ch)
	for i := range counts {
		refused, full := c.markedFull(counts[i].Level)
		counts[i].Refused = refused
		counts[i].Full = counts[i].Full || full
	}
	return counts, err
}

// Close closes the publisher if NewDelayer dialled it (Config.URI), waiting
// for publishes in flight; a Config.Publisher is left open. Close the
// router first.
func (d *Delayer) Close() error { return d.c.close() }
