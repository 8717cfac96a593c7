package amqpretry

import (
	"fmt"
	"slices"
	"time"

	"github.com/rabbitretry/rabbitretry/middleware"
)

// Mode is the retry mode: how a retry with a positive delay waits for its
// next attempt. Choose one in Config.Mode; each lives in its own file and
// validates itself, so the modes exclude each other by construction:
//
//	Tiers(d...)            one wait queue per delay tier (mode_tiers.go); the default
//	DeadLetterFirst(d...)  tiers, first-tier retries dead-lettered instead of
//	                       published (mode_deadletter.go; quorum queues)
//	NativeDelayed(n)       short retries held by the queue itself, longer ones in
//	                       wait queues (mode_native.go; RabbitMQ 4.3+ quorum queues)
//	Custom(factory)        another delay mechanism for every positive delay, e.g.
//	                       the delay cascade: cascade.Mode (mode_custom.go)
//
// Every mode counts attempts from the same evidence (router.Config.AttemptSources:
// the library's header, the queue's own x-death, the broker's count of returns, which
// NativeDelayed reads from x-acquired-count), so a deploy that switches modes keeps each
// message's count; and in every mode copies with no delay (the fallback's and the
// RedeliveryGuard's) go straight back to their queue through the loop-back exchange.
type Mode interface {
	// String names the mode: "tiers", "dead-letter-first", "native-delayed"
	// or "custom".
	String() string
	// validate reports what is wrong with the mode in Config c (defaults
	// not necessarily filled in), naming the field.
	validate(c *Config) error
	// configure sets what the mode needs of the topology (wait-queue tiers,
	// Q's arguments) from the defaulted, valid c.
	configure(c *Config, t *Topology)
	// delayer returns the Delayer the chain schedules retries with, built
	// on base (the wait-queue and loop-back publisher), and a close func
	// (nil: none) that Retry.Close calls.
	delayer(base *tiersDelayer, deps DelayerDeps) (middleware.Delayer, func() error, error)
}

// mode returns Config.Mode, or the default Tiers().
func (c *Config) mode() Mode {
	if c.Mode == nil {
		return Tiers()
	}
	return c.Mode
}

// waitTiers returns the tiers to declare: given ones sorted and
// deduplicated, or DefaultTiers of c's Backoff and MaxAttempts.
func waitTiers(c *Config, given []time.Duration) []time.Duration {
	if len(given) == 0 {
		return DefaultTiers(c.Backoff, c.MaxAttempts)
	}
	tiers := slices.Clone(given)
	slices.Sort(tiers)
	return slices.Compact(tiers)
}

// validateTiers checks wait-queue delays given to a mode (empty: the
// default tiers, always valid).
func validateTiers(mode string, tiers []time.Duration) error {
	if len(tiers) > MaxTiers {
		return fmt.Errorf("amqpretry.Config.Mode (%s): Tiers has %d tiers, more than %d", mode, len(tiers), MaxTiers)
	}
	for i, d := range tiers {
		if d < time.Millisecond || d > MaxTTL {
			return fmt.Errorf("amqpretry.Config.Mode (%s): Tiers[%d] = %v is outside [1ms, %v] (RabbitMQ's TTL range)", mode, i, d, MaxTTL)
		}
		if d%time.Millisecond != 0 {
			return fmt.Errorf("amqpretry.Config.Mode (%s): Tiers[%d] = %v is not a whole number of milliseconds (x-message-ttl is in ms)", mode, i, d)
		}
	}
	return nil
}
