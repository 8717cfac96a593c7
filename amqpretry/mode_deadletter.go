package amqpretry

import (
	"context"
	"errors"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// DeadLetterFirst is the Tiers mode (same tiers, same defaults) in which a
// retry that falls in the first tier goes to the first wait queue by
// dead-lettering the original (a nack; Q's x-dead-letter-routing-key points
// there) instead of a published copy: no publish-confirm round trip is
// waited for in the handler, so a burst of failures drains much faster.
// The attempt is counted from x-death; that hop records no failure
// metadata (rabbitretry-first-failure is then the first failure that took
// the publish path). Requires Config.QueueType quorum, whose dead-lettering
// is at-least-once (a classic queue's is at-most-once); Validate refuses it
// otherwise.
//
// The nack gets no confirm, so before relying on it the Delayer checks
// that the route is in place, at most every 2 s per queue: the first wait
// queue exists (passive declare), and, with a management API
// (Config.ManagementURL), no policy or operator policy gives it a length
// limit (a full reject-publish target holds dead-letters unseen in Q's
// dead-letter buffer) and, for an adopted Q, the library's policy is the
// one that applies ("Policies", "Dead Letter Exchanges"). While a check
// fails, first retries take the publish path (confirmed copy, fallback
// behind it); the change is logged (Error, then Info when the route is
// back) and reported to an Observer that implements
// middleware.RouteObserver (metrics.Metrics.Observer's does). On an adopted queue
// (Config.AdoptQueue) it needs AdoptQueue.ManagementURL.
func DeadLetterFirst(tiers ...time.Duration) Mode {
	return deadLetterFirstMode{tiers: slices.Clone(tiers)}
}

type deadLetterFirstMode struct{ tiers []time.Duration }

func (deadLetterFirstMode) String() string { return "dead-letter-first" }

func (m deadLetterFirstMode) validate(c *Config) error {
	if err := validateTiers(m.String(), m.tiers); err != nil {
		return err
	}
	if c.QueueType != QueueTypeQuorum {
		return errors.New("amqpretry.Config.Mode DeadLetterFirst needs QueueType quorum (classic-queue dead-lettering is at-most-once)")
	}
	if a := c.AdoptQueue; a != nil && a.ManagementURL == "" {
		return errors.New("amqpretry.Config.AdoptQueue.ManagementURL is empty, and Mode DeadLetterFirst cannot work on an adopted queue until its policy applies: set ManagementURL so the library applies and checks it")
	}
	return nil
}

func (m deadLetterFirstMode) configure(c *Config, t *Topology) {
	t.tiers = waitTiers(c, m.tiers)
	t.deadLetterFirst = true // Q dead-letters into the first wait queue
}

func (deadLetterFirstMode) delayer(base *tiersDelayer, _ DelayerDeps) (middleware.Delayer, func() error, error) {
	return deadLetterFirstDelayer{base}, nil, nil
}

// deadLetterFirstDelayer returns chainerr.ErrDeadLetter, without
// publishing, for a retry the first tier holds in full, unless ctx is
// retrymeta.WithCopyRequired, the delivery carries foreign x-death
// entries for Q (foreignDeaths, marked by Retry.Middleware: the dead-letter
// path would keep them), or the route does not check out; everything else
// is published as in the Tiers mode.
type deadLetterFirstDelayer struct{ *tiersDelayer }

// Schedule implements middleware.Delayer.
func (d deadLetterFirstDelayer) Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error {
	p, err := d.plan(ctx, msg, delay)
	if err != nil {
		return err
	}
	// The dead-lettered original carries no header: only a delay the first
	// tier holds in full takes this path.
	if !p.back && p.remaining == 0 && p.tier == d.topology.tiers[0] && !retrymeta.CopyRequired(ctx) &&
		ctx.Value(foreignDeathsKey{}) == nil && d.routes.usable(p.queue) {
		return chainerr.ErrDeadLetter // Q's DLX routes to the first wait queue
	}
	return d.publishPlan(ctx, msg, p)
}
