// Package auditconst holds the audit's defaults and limits that our own
// binaries (cmd/auditctl, examples/bench) and tests share with the audit
// packages, and the checks of a resend request that audit and audit/httpapi
// share (CheckResendOptions). The public API states each of them in the doc
// of the field or function it applies to; only the binaries need them as
// names (flag defaults, the same checks before a call). It imports only the
// standard library, so every audit package may import it.
package auditconst

import (
	"errors"
	"fmt"
	"time"
)

// Package audit.
const (
	// LoopBackExchange is audit.ResenderConfig.LoopBackExchange's default,
	// the same as amqpretry.Naming's loop-back exchange.
	LoopBackExchange = "rabbitretry.loopback"
	// MaxResendLimit is the largest audit.ResendOptions.Limit (and
	// ExpectedCount, ResenderConfig.ConfirmAbove).
	MaxResendLimit = 100000
	// BatchSize is audit.ConsumerConfig.BatchSize's default.
	BatchSize = 500
	// AttemptRoutingKey is the routing key of attempt records on the audit
	// exchange (the Recorder publishes with it).
	AttemptRoutingKey = "attempt"
)

// Package audit/pgstore.
const (
	// Schema is pgstore.Config.Schema's default.
	Schema = "rabbitretry_audit"
	// MaxSearchLimit is the largest audit.Filter.Limit pgstore accepts.
	MaxSearchLimit = 10000
	// PruneBatch is the rows per DELETE of pgstore.Store.Prune's default.
	PruneBatch = 5000
)

// ResendTimeout is audit/httpapi.Config.ResendTimeout's default: it bounds
// one POST /v1/resend.
const ResendTimeout = 5 * time.Minute

// Values of audit.SetAside.Kind.
const (
	KindArrival = "arrival"
	KindAttempt = "attempt"
)

// ResentKey is the header every copy audit.Resender.Resend publishes
// carries: the time of the resend, RFC 3339 in UTC.
const ResentKey = "rabbitretry-resent"

// Values of audit.ResendResult.Status.
const (
	StatusSent      = "sent"       // published and confirmed by the broker
	StatusWouldSend = "would-send" // DryRun: would be published
	StatusFailed    = "failed"     // returned, nacked, or the publish failed
	StatusSkipped   = "skipped"    // not sendable (no body, truncated body, no queue)
	StatusUnsent    = "unsent"     // not tried: Resend stopped before it (see its error)
)

// Values of audit.ResendOptions.Mode (audit.ResendToQueue,
// audit.ResendToExchange).
const (
	ModeToQueue    = "to-queue"
	ModeToExchange = "to-exchange"
)

// CheckResendOptions checks the fields of an audit.ResendOptions: a known
// Mode, Queue only with ModeToQueue (at most 255 bytes), Limit and
// ExpectedCount within 0..MaxResendLimit. audit.Resender.Resend refuses
// options it rejects; the HTTP API answers them with a 400 before calling
// it.
func CheckResendOptions(mode, queue string, limit, expectedCount int) error {
	switch mode {
	case ModeToQueue, ModeToExchange:
	case "":
		return fmt.Errorf("audit: ResendOptions.Mode is required (%q or %q)", ModeToQueue, ModeToExchange)
	default:
		return fmt.Errorf("audit: ResendOptions.Mode %q: want %q or %q", mode, ModeToQueue, ModeToExchange)
	}
	switch {
	case queue != "" && mode != ModeToQueue:
		return fmt.Errorf("audit: ResendOptions.Queue is only for mode %q", ModeToQueue)
	case len(queue) > 255:
		return errors.New("audit: ResendOptions.Queue is longer than 255 bytes")
	case limit < 0 || limit > MaxResendLimit:
		return fmt.Errorf("audit: ResendOptions.Limit %d: want 0..%d", limit, MaxResendLimit)
	case expectedCount < 0 || expectedCount > MaxResendLimit:
		return fmt.Errorf("audit: ResendOptions.ExpectedCount %d: want 0..%d", expectedCount, MaxResendLimit)
	}
	return nil
}
