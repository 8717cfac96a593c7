package router

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// Policy is the retry policy: how many attempts, how long between them,
// which errors are retried, how errors are rendered and who is told. It is
// defined once and embedded in Config and in amqpretry.Config, so one value
// configures both a broker-free test chain (router.New with
// middleware.MemoryDelayer over gochannel) and amqpretry.New:
//
//	policy := router.Policy{MaxAttempts: 4, Observer: m.Observer()}
//	chain, err := router.New(router.Config{Policy: policy, Delayer: memDelayer, PoisonPublisher: pub})
//	retry, err := amqpretry.New(amqpretry.Config{Policy: policy, Subscriber: subCfg})
//
// Zero values take the defaults given on each field (the same in both).
type Policy struct {
	// MaxAttempts is the total number of attempts, the first included.
	// Default 5; range [1,
	// middleware.MaxAttemptsCap].
	MaxAttempts int
	// Backoff makes a fresh backoff policy for each delay computation.
	// Default: exponential from 1 s, factor 2,
	// ±50% jitter, 5 min cap.
	Backoff func() backoff.BackOff
	// Classifier configures error classification. Default: DefaultRules,
	// everything else transient.
	Classifier middleware.ClassifierConfig
	// QueueName names the originating queue of a message. Default: the
	// router's subscribe topic (amqpretry: Subscriber.Queue.GenerateName of
	// it).
	QueueName func(ctx context.Context) string
	// ErrorText renders errors into headers; use it to redact secrets.
	// Default: err.Error() cut to 1 KiB.
	ErrorText func(error) string
	// MaxRedeliveries bounds the broker redeliveries (crashes, consumer
	// timeouts, returns) a message may cause: the one that brings its count
	// to MaxRedeliveries poisons it with class
	// middleware.ClassRedeliveryLimit without running the handler again
	// (attributable ones only when the Delayer is a retrymeta.Quarantiner;
	// see middleware.RedeliveryGuard). Default
	// 3; range [1, 1000].
	MaxRedeliveries int
	// FallbackPause is how long a message whose retry or poison copy was not
	// held waits before the fallback copy (or the requeue), so a refusing
	// broker is not hammered. Default 1 s; negative:
	// no pause (tests). A failed retry whose handler asked for a longer
	// delay (middleware.RetryAfter) waits that delay instead, up to one
	// minute (the delivery stays unacked meanwhile): the fallback copy goes
	// straight back to the queue, so the next attempt never runs earlier
	// than asked. A longer RetryAfter is handed to the Delayer once more
	// after the pause; if that fails too, the copy goes back to the queue
	// carrying the remaining delay (retrymeta.RemainingDelayKey), and the
	// RedeliveryGuard holds it again before it runs.
	FallbackPause time.Duration
	// Pause, when set, pauses consumption while a dependency is down instead
	// of charging attempts (see middleware.Pause): it goes just inside the
	// Classifier. Its Delayer defaults to the chain's Delayer, its Counts to
	// "the Classifier would retry it", its Logger to the chain's Logger, and
	// its Observer to Observer when that implements middleware.PauseObserver
	// (metrics.Metrics.Observer's does). Default nil (off).
	Pause *middleware.PauseConfig
	// Tracing, when set, makes an OpenTelemetry span per attempt and keeps
	// all attempts of a message in one trace (see middleware.Tracing): it
	// goes outermost, and its span events are added to Observer. Its
	// MaxAttempts and QueueName default to this Policy's. Default nil (off).
	Tracing *middleware.TracingConfig
	// Observer is told of retries, poisonings and drops (e.g. metrics).
	Observer middleware.Observer
}

// withDefaults returns p with the zero MaxAttempts, Backoff,
// MaxRedeliveries and FallbackPause set to their defaults (see the fields);
// the others keep nil, which their users read as the default.
func (p Policy) withDefaults() Policy {
	retrymeta.FillPolicyDefaults(&p.MaxAttempts, &p.Backoff, &p.MaxRedeliveries, &p.FallbackPause)
	return p
}
