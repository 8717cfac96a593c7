package amqpretry

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/chainerr"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// Queue arguments of RabbitMQ 4.3's native delayed retry (quorum queues).
const (
	argDelayedRetryType = "x-delayed-retry-type"
	argDelayedRetryMin  = "x-delayed-retry-min"
	argDelayedRetryMax  = "x-delayed-retry-max"
)

// NativeDelayed is the retry mode that hands short retries to the queue's
// own delayed retry (RabbitMQ 4.3+ quorum queues; see NativeDelayedRetry):
// the original is nacked with requeue and the queue holds it for n.Min,
// with no copy and no publish round trip; longer retries still take the
// wait queues (n.Tiers). Q is declared with the x-delayed-retry-* arguments
// (an existing Q declared without them gets a *DeclareError: add them by
// policy, or declare a new queue). Attempts are counted from the broker's
// x-acquired-count (middleware.AcquiredCountSource), so a consumer crash
// uses an attempt and Config.MaxRedeliveries is not used. The native hop
// records no failure metadata. Requires Config.QueueType quorum (Validate)
// and RabbitMQ 4.3+ (New refuses it otherwise, from the broker's version);
// on an adopted queue (Config.AdoptQueue) it needs
// AdoptQueue.ManagementURL, and the route is checked as DeadLetterFirst's.
func NativeDelayed(n NativeDelayedRetry) Mode {
	n.Tiers = slices.Clone(n.Tiers)
	return nativeMode{n: n}
}

type nativeMode struct{ n NativeDelayedRetry }

func (nativeMode) String() string { return "native-delayed" }

func (m nativeMode) validate(c *Config) error {
	n := m.n
	if err := validateTiers(m.String(), n.Tiers); err != nil {
		return err
	}
	if c.QueueType != QueueTypeQuorum {
		return errors.New("amqpretry.Config.Mode NativeDelayed needs QueueType quorum (RabbitMQ's delayed retry is a quorum-queue feature); use Mode Tiers on classic queues")
	}
	if n.Min < time.Millisecond || n.Min%time.Millisecond != 0 {
		return fmt.Errorf("amqpretry.Config.Mode NativeDelayedRetry.Min %v is not a whole number of milliseconds >= 1ms (x-delayed-retry-min is in ms)", n.Min)
	}
	if n.Max != 0 && (n.Max < n.Min || n.Max%time.Millisecond != 0) {
		return fmt.Errorf("amqpretry.Config.Mode NativeDelayedRetry.Max %v is not a whole number of milliseconds >= Min %v (x-delayed-retry-max is in ms)", n.Max, n.Min)
	}
	if n.max() > MaxTTL {
		return fmt.Errorf("amqpretry.Config.Mode NativeDelayedRetry.Max %v is above %v", n.max(), MaxTTL)
	}
	for _, k := range []string{argDelayedRetryType, argDelayedRetryMin, argDelayedRetryMax} {
		if _, ok := c.Subscriber.Queue.Arguments[k]; ok {
			return fmt.Errorf("amqpretry.Config.Subscriber.Queue.Arguments sets %s, which NativeDelayedRetry manages", k)
		}
	}
	if a := c.AdoptQueue; a != nil && a.ManagementURL == "" {
		return errors.New("amqpretry.Config.AdoptQueue.ManagementURL is empty, and Mode NativeDelayed cannot work on an adopted queue until its policy applies: set ManagementURL so the library applies and checks it")
	}
	return nil
}

func (m nativeMode) configure(c *Config, t *Topology) {
	t.tiers = waitTiers(c, m.n.Tiers)
	n := m.n
	t.native = &n // Q gets the x-delayed-retry-* arguments
}

// delayer refuses a broker older than 4.3 (checkNativeSupport).
func (m nativeMode) delayer(base *tiersDelayer, _ DelayerDeps) (middleware.Delayer, func() error, error) {
	props, err := serverProperties(base.publisher)
	if err == nil {
		err = checkNativeSupport(props)
	}
	if err != nil {
		return nil, nil, err
	}
	return nativeDelayer{tiersDelayer: base, n: base.topology.native}, nil, nil
}

// nativeDelayer returns chainerr.ErrNativeRetry, without publishing, for
// a retry in the native range (NativeDelayedRetry.fits) unless ctx is
// retrymeta.WithCopyRequired or the route does not check out (adopted
// queues); everything else is published as in the Tiers mode.
type nativeDelayer struct {
	*tiersDelayer
	n *NativeDelayedRetry
}

// Schedule implements middleware.Delayer.
func (d nativeDelayer) Schedule(ctx context.Context, msg *message.Message, delay time.Duration) error {
	p, err := d.plan(ctx, msg, delay)
	if err != nil {
		return err
	}
	if !p.back && !retrymeta.CopyRequired(ctx) && d.n.fits(delay, p.minimum) && d.routes.usable(p.queue) {
		return chainerr.ErrNativeRetry // the nack with requeue puts it into Q's delayed state
	}
	return d.publishPlan(ctx, msg, p)
}

// NativeDelayedRetry configures the native delayed retry mode
// (NativeDelayed): RabbitMQ 4.3+ quorum queues hold a returned
// message in the queue itself, in a delayed state, and deliver it again once
// the delay ends ("Quorum Queues", "Delayed Retry"). No copy is published,
// nothing is confirmed, and the message cannot reach another queue.
//
// Q is declared with x-delayed-retry-type "all" (every return is delayed:
// nacks, and also crashes and connection losses), x-delayed-retry-min = Min
// and x-delayed-retry-max = Max, in milliseconds. The broker holds a
// returned message for min(Min × max(1, c), Max), where c is the message's
// x-delivery-count: the returns that count as failures (consumer crashes,
// channel or connection losses; never the library's nacks). So a native
// retry waits Min, or longer (at most Max) for a message that already
// crashed its consumer.
//
// Which retries go native: a retryable failure with attempts left whose
// computed delay (the Backoff's) is at most Max, and whose handler-requested
// RetryAfter, if any, is at most Min (the hold the broker guarantees). It is
// nacked with requeue and waits Min, whatever the computed delay within
// (0, Max]: the broker knows one delay per queue, not the library's backoff.
// Every other retry (a computed delay above Max, a RetryAfter above Min)
// takes the wait-queue path as usual, so one queue uses both: fast,
// constant native retries first, longer backoff in the wait queues later.
type NativeDelayedRetry struct {
	// Min is the delay of a native retry: x-delayed-retry-min. Whole
	// milliseconds, at least 1 ms.
	Min time.Duration
	// Max is the longest computed delay handed to the native retry, and the
	// broker's cap on its hold (x-delayed-retry-max). Whole milliseconds, at
	// least Min. 0 means Min.
	Max time.Duration
	// Tiers are the wait-queue delays of the retries not handed to the
	// native retry, as in the Tiers mode (same rules and default).
	Tiers []time.Duration
}

func (n *NativeDelayedRetry) max() time.Duration {
	if n.Max == 0 {
		return n.Min
	}
	return n.Max
}

// fits reports whether a retry with computed delay d and handler-requested
// floor minimum (0: none) goes to the native delayed retry.
func (n *NativeDelayedRetry) fits(d, minimum time.Duration) bool {
	return d > 0 && d <= n.max() && minimum <= n.Min
}

func (n *NativeDelayedRetry) args() amqp.Table {
	return amqp.Table{
		argDelayedRetryType: "all",
		argDelayedRetryMin:  n.Min.Milliseconds(),
		argDelayedRetryMax:  n.max().Milliseconds(),
	}
}
