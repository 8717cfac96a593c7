package amqpretry

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// Queue arguments of RabbitMQ 4.3's native delayed retry (quorum queues).
const (
	argDelayedRetryType = "x-delayed-retry-type"
	argDelayedRetryMin  = "x-delayed-retry-min"
	argDelayedRetryMax  = "x-delayed-retry-max"
)

// NativeDelayedRetry configures the native delayed retry mode
// (Config.NativeDelayedRetry): RabbitMQ 4.3+ quorum queues hold a returned
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

// validateNative checks Config.NativeDelayedRetry (nil: mode off).
func (c Config) validateNative() error {
	n := c.NativeDelayedRetry
	if n == nil {
		return nil // a user's own x-delayed-retry-* arguments are left alone
	}
	if c.QueueType != QueueTypeQuorum {
		return errors.New("amqpretry.Config.NativeDelayedRetry needs QueueType quorum (RabbitMQ's delayed retry is a quorum-queue feature); use the default wait-queue retries on classic queues")
	}
	if c.DeadLetterFirstRetry {
		return errors.New("amqpretry.Config.NativeDelayedRetry and DeadLetterFirstRetry are mutually exclusive (both make the nack the retry); choose one")
	}
	if n.Min < time.Millisecond || n.Min%time.Millisecond != 0 {
		return fmt.Errorf("amqpretry.Config.NativeDelayedRetry.Min %v is not a whole number of milliseconds >= 1ms (x-delayed-retry-min is in ms)", n.Min)
	}
	if n.Max != 0 && (n.Max < n.Min || n.Max%time.Millisecond != 0) {
		return fmt.Errorf("amqpretry.Config.NativeDelayedRetry.Max %v is not a whole number of milliseconds >= Min %v (x-delayed-retry-max is in ms)", n.Max, n.Min)
	}
	if n.max() > MaxTTL {
		return fmt.Errorf("amqpretry.Config.NativeDelayedRetry.Max %v is above %v", n.max(), MaxTTL)
	}
	for _, k := range []string{argDelayedRetryType, argDelayedRetryMin, argDelayedRetryMax} {
		if _, ok := c.Subscriber.Queue.Arguments[k]; ok {
			return fmt.Errorf("amqpretry.Config.Subscriber.Queue.Arguments sets %s, which NativeDelayedRetry manages", k)
		}
	}
	return nil
}

// checkNativeSupport refuses the native mode on a broker older than 4.3,
// from the server's "version" connection property. Before 4.3 the broker
// accepts the x-delayed-retry-* arguments silently and ignores them, so a
// declare cannot tell: every nack would requeue at once (a hot loop).
func checkNativeSupport(props amqp.Table) error {
	v, _ := props["version"].(string)
	major, minor, ok := parseMajorMinor(v)
	if !ok {
		return fmt.Errorf("amqpretry: Config.NativeDelayedRetry needs RabbitMQ 4.3 or later, and the broker's version %q cannot be read; leave NativeDelayedRetry nil (wait-queue retries, or DeadLetterFirstRetry on quorum queues)", v)
	}
	if major < 4 || (major == 4 && minor < 3) {
		return fmt.Errorf("amqpretry: Config.NativeDelayedRetry needs RabbitMQ 4.3 or later (quorum-queue delayed retry), and the broker is %s, which ignores the x-delayed-retry-* arguments (nacked messages would come back at once); leave NativeDelayedRetry nil (wait-queue retries, or DeadLetterFirstRetry on quorum queues)", v)
	}
	return nil
}

// parseMajorMinor reads "4.3.6", "4.3.0-rc.1", "4.3" and the like.
func parseMajorMinor(v string) (major, minor int, ok bool) {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return 0, 0, false
	}
	lead := func(s string) (int, bool) {
		i := 0
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
		n, err := strconv.Atoi(s[:i])
		return n, err == nil
	}
	major, ok1 := lead(parts[0])
	minor, ok2 := lead(parts[1])
	return major, minor, ok1 && ok2
}

// serverProperties returns the broker's connection properties, from the
// retry publisher's connection.
func serverProperties(p *confirm.Publisher) (amqp.Table, error) {
	c, err := p.Connection()
	if err != nil {
		return nil, err
	}
	return c.Properties, nil
}

// acquiredCount converts an x-acquired-count value like x-delivery-count.
func acquiredCount(v interface{}) (int64, error) {
	return amqpwire.Count(middleware.XAcquiredCountKey, v)
}
