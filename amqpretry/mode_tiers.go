package amqpretry

import (
	"slices"
	"time"

	"github.com/rabbitretry/rabbitretry/middleware"
)

// Tiers is the default retry mode: a retry copy is published (confirmed,
// mandatory) to one of the originating queue's wait queues, one per delay
// tier, which dead-letters it back to the queue when its TTL expires.
//
// tiers are the wait-queue delays, each a whole number of milliseconds in
// [1 ms, MaxTTL], at most MaxTiers; order and duplicates do not matter. A
// computed backoff delay goes to the nearest tier on a logarithmic scale
// (Topology.TierFor), a handler's RetryAfter to the smallest tier at or
// above it; a delay beyond the longest tier is held
// in several hops. None given: DefaultTiers(Config.Backoff,
// Config.MaxAttempts), the delays of attempts 1..MaxAttempts-1 without
// jitter.
func Tiers(tiers ...time.Duration) Mode { return tiersMode{tiers: slices.Clone(tiers)} }

type tiersMode struct{ tiers []time.Duration }

func (tiersMode) String() string { return "tiers" }

func (m tiersMode) validate(*Config) error { return validateTiers(m.String(), m.tiers) }

func (m tiersMode) configure(c *Config, t *Topology) { t.tiers = waitTiers(c, m.tiers) }

func (tiersMode) delayer(base *tiersDelayer, _ DelayerDeps) (middleware.Delayer, func() error, error) {
	return base, nil, nil
}
