package audit

import (
	"errors"
	"fmt"
	"reflect"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/internal/redact"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// defaultLoopBackExchange is the default ResenderConfig.LoopBackExchange,
// the loop-back exchange amqpretry declares (amqpretry.Naming): a direct
// exchange to which every originating queue Q is bound with routing key Q.
const defaultLoopBackExchange = auditconst.LoopBackExchange

// defaultResenderConnectionName is the client-provided connection name
// (RabbitMQ "Connections" guide) of the Resender's publisher connection.
const defaultResenderConnectionName = "rabbitretry-audit-resend"

// Resend limits.
const (
	// defaultResendLimit is the number of messages Resend considers when
	// ResendOptions.Limit is 0.
	defaultResendLimit = 1000
	// maxResendLimit is the largest ResendOptions.Limit.
	maxResendLimit = auditconst.MaxResendLimit
	// defaultResendConfirmAbove is the default
	// ResenderConfig.ConfirmAbove: a filter that selects more messages
	// than this needs ResendOptions.AllowAll.
	defaultResendConfirmAbove = 10
)

// resendPageSize is the Search page size Resend reads with.
const resendPageSize = 1000

// resendBatch is the most messages published pipelined before their
// confirms are awaited (confirm.Publisher.PublishRawBatch).
const resendBatch = 256

// ResendMode says where Resend publishes a message.
type ResendMode string

// The two resend modes. They differ in who gets the message again.
const (
	// ResendToQueue sends the message to ONE queue only: published to the
	// loop-back exchange with routing key = the queue, so exactly that
	// queue receives it, whatever else is bound to the original exchange.
	// The queue is ResendOptions.Queue, else Filter.Queue, else the queue
	// the message's attempts were made in; a message with attempts in
	// several queues (fan-out) or none is skipped unless one is named.
	// The queue must be an originating queue of the retry topology (bound
	// to the loop-back exchange with its own name), else the broker returns
	// the message and Resend reports it as failed.
	ResendToQueue ResendMode = auditconst.ModeToQueue
	// ResendToExchange publishes the message again to its original
	// exchange with its original routing key: EVERY queue bound to it
	// receives it again (all consumers, and the audit's arrivals queue, so
	// the resent copy is recorded as a new arrival). A message the exchange
	// would route to the audit's arrivals queue only is not published and
	// is reported failed ("routes this message only to the audit's arrivals
	// queue"; ResenderConfig.ManagementURL).
	ResendToExchange ResendMode = auditconst.ModeToExchange
)

// Errors returned by Resend (test with errors.Is).
var (
	// ErrEmptyFilter: Resend was given a Filter that selects everything
	// (no field set except Limit/After) without ResendOptions.AllowAll.
	ErrEmptyFilter = errors.New("audit: resend: the filter selects every message; narrow it or set ResendOptions.AllowAll")
	// ErrBroadResend: the filter's result is broad, judged by the store's
	// answer whatever fields are set: it selects more than
	// ResenderConfig.ConfirmAbove messages (counting past Limit and
	// After: chunks do not hide breadth), or every message the store
	// holds (a time range from 1970 does), and ResendOptions.AllowAll is
	// false. Nothing was sent; the report's Matched says how many this
	// call would have considered.
	ErrBroadResend = errors.New("audit: resend: the filter selects too many messages")
	// ErrCountMismatch: ResendOptions.ExpectedCount is set and differs
	// from the messages matched (the store changed since the dry run the
	// count came from). Nothing was sent.
	ErrCountMismatch = errors.New("audit: resend: the matched count is not the expected count")
)

// ResenderConfig configures a Resender. Zero fields take the defaults
// documented on each.
type ResenderConfig struct {
	// URI is the AMQP URI of the broker to publish to, e.g.
	// "amqp://guest:guest@127.0.0.1:5672/". Required. The Resender connects
	// only on the first real (not DryRun) Resend.
	URI string
	// Store is where the messages are found. Required.
	Store Store
	// LoopBackExchange is the retry topology's loop-back exchange
	// (ResendToQueue). Default "rabbitretry.loopback", the same default as
	// amqpretry.Naming.LoopBackExchange.
	LoopBackExchange string
	// UUIDHeaderKey is the header holding the Watermill message UUID.
	// Default "_watermill_message_uuid" (watermill-amqp's default).
	UUIDHeaderKey string
	// ConfirmTimeout bounds the wait for each publisher confirm (default
	// 30 s, confirm.Config.ConfirmTimeout).
	ConfirmTimeout time.Duration
	// ConnectionName is the client-provided connection name. Default
	// "rabbitretry-audit-resend".
	ConnectionName string
	// ManagementURL is the RabbitMQ management HTTP API ("Management
	// Plugin"), e.g. "http://user:password@host:15672/", that a
	// ResendToExchange reads the exchange's bindings from before
	// publishing: a message the exchange would route to no queue but the
	// audit's own arrivals queue (its business binding is gone) is reported
	// failed ("routes this message only to the audit's arrivals queue")
	// and not published (a mandatory publish cannot tell: the audit's
	// binding alone makes it routed). The
	// user needs the management tag "monitoring" or above (or "management"
	// with access to the vhost). Default: derived from URI (same host and
	// credentials, http on port 15672; https on 15671 for amqps). When the
	// API cannot be read, ResendToExchange returns the error and publishes
	// nothing.
	ManagementURL string
	// SkipRouteCheck turns that check off: a ResendToExchange is then
	// reported sent as soon as the broker confirmed the mandatory publish,
	// even when only the audit's arrivals queue received it. For brokers
	// without the management plugin. Default false.
	SkipRouteCheck bool
	// ArrivalsQueue is the audit's arrivals queue, whose binding does not
	// count as a route. Default "rabbitretry.audit.arrivals" (the Consumer's
	// Naming.ArrivalsQueue).
	ArrivalsQueue string
	// Logger gets connection events. Default watermill.NopLogger{}.
	Logger watermill.LoggerAdapter
	// ConfirmAbove is how many messages a filter may select before a
	// resend needs ResendOptions.AllowAll (ErrBroadResend). Default
	// 10; at most 100,000.
	ConfirmAbove int
}

func (c *ResenderConfig) setDefaults() {
	if c.ConfirmAbove == 0 {
		c.ConfirmAbove = defaultResendConfirmAbove
	}
	if c.LoopBackExchange == "" {
		c.LoopBackExchange = defaultLoopBackExchange
	}
	if c.UUIDHeaderKey == "" {
		c.UUIDHeaderKey = wamqp.DefaultMessageUUIDHeaderKey
	}
	if c.ConnectionName == "" {
		c.ConnectionName = defaultResenderConnectionName
	}
	if c.ArrivalsQueue == "" {
		c.ArrivalsQueue = defaultArrivalsQueue
	}
	if c.ManagementURL == "" && !c.SkipRouteCheck {
		c.ManagementURL, _ = managementURL(c.URI)
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
}

// Validate reports the first invalid field (after defaults are filled in):
// URI missing or not an AMQP URI, Store nil, ConfirmTimeout negative, a
// name longer than 255 bytes.
func (c ResenderConfig) Validate() error {
	c.setDefaults()
	switch {
	case c.URI == "":
		return errors.New("audit: ResenderConfig.URI is required")
	case c.Store == nil || (reflect.ValueOf(c.Store).Kind() == reflect.Pointer && reflect.ValueOf(c.Store).IsNil()):
		return errors.New("audit: ResenderConfig.Store is required")
	case c.ConfirmTimeout < 0:
		return fmt.Errorf("audit: ResenderConfig.ConfirmTimeout %v is negative", c.ConfirmTimeout)
	case c.ConfirmAbove < 0 || c.ConfirmAbove > maxResendLimit:
		return fmt.Errorf("audit: ResenderConfig.ConfirmAbove %d: want 0 (default %d) to %d", c.ConfirmAbove, defaultResendConfirmAbove, maxResendLimit)
	case len(c.LoopBackExchange) > 255:
		return errors.New("audit: ResenderConfig.LoopBackExchange is longer than 255 bytes")
	}
	if _, err := amqp.ParseURI(c.URI); err != nil {
		return fmt.Errorf("audit: ResenderConfig.URI: %w", redact.Error(err, c.URI))
	}
	if !c.SkipRouteCheck {
		if _, err := newRouteChecker(c.ManagementURL, "/", c.ArrivalsQueue); err != nil {
			return err
		}
	}
	return nil
}

// ResendOptions says how Resend sends.
type ResendOptions struct {
	// Mode is ResendToQueue or ResendToExchange. Required.
	Mode ResendMode `json:"mode"`
	// Queue, with ResendToQueue, sends every message to this queue instead
	// of Filter.Queue or the queue of its attempts (needed for messages
	// without attempt records). Not allowed with ResendToExchange.
	Queue string `json:"queue,omitempty"`
	// DryRun reports what would be sent without connecting or publishing.
	DryRun bool `json:"dry_run,omitempty"`
	// Limit caps the messages considered (sent, skipped or failed), newest
	// first as Search returns them. Default 1000, at most 100,000;
	// Filter.Limit is ignored (Filter.After starts the walk).
	// ResendReport.Next continues after the last one.
	Limit int `json:"limit,omitempty"`
	// AllowAll must be true for a Filter that selects every message (no
	// field set: ErrEmptyFilter) or whose result is broad: more than
	// ResenderConfig.ConfirmAbove messages, or every message of the store
	// (ErrBroadResend). Not needed for DryRun.
	AllowAll bool `json:"allow_all,omitempty"`
	// ExpectedCount, when positive, is the number of messages this resend
	// must match (ResendReport.Matched of the dry run the operator
	// checked): another count stops it before anything is sent
	// (ErrCountMismatch). Default 0: not checked.
	ExpectedCount int `json:"expected_count,omitempty"`
}

// ResendResult is what Resend did with one message.
type ResendResult struct {
	// MessageID is the message's id (the Watermill UUID).
	MessageID string `json:"message_id"`
	// Exchange and RoutingKey are where it was (or would be) published;
	// Queue is the target queue of ResendToQueue.
	Exchange   string `json:"exchange"`
	RoutingKey string `json:"routing_key"`
	Queue      string `json:"queue,omitempty"`
	// Status is one of "sent" (published and confirmed by the broker),
	// "would-send" (DryRun: would be published), "failed" (returned,
	// nacked, or the publish failed), "skipped" (not sendable: no body,
	// truncated body, no queue), "unsent" (not tried: Resend stopped
	// before it, see its error); Error says why for all but the first two.
	Status string `json:"status"`
	Error  string `json:"error,omitempty"`
}

// ResendReport is Resend's account: Matched = Sent + Failed + Skipped +
// Unsent (in DryRun, Sent counts the messages that would be sent). Results
// has one entry per matched message, in the order they were published:
// oldest first.
type ResendReport struct {
	Mode    ResendMode `json:"mode"`
	DryRun  bool       `json:"dry_run"`
	Matched int        `json:"matched"`
	Sent    int        `json:"sent"`
	Failed  int        `json:"failed"`
	Skipped int        `json:"skipped"`
	// Unsent counts the messages not tried because Resend stopped (a
	// connection or confirm error, ctx): they were not published.
	Unsent  int            `json:"unsent"`
	Results []ResendResult `json:"results"`
	// Next, when not empty, is the Filter.After cursor of the messages the
	// Limit left out (only with a store that pages: SearchPage).
	Next string `json:"next,omitempty"`
}

// isEmptyFilter reports whether f selects every message (only Limit and
// After set, or nothing).
func isEmptyFilter(f Filter) bool {
	f.Limit, f.After = 0, ""
	if len(f.Headers) == 0 {
		f.Headers = nil
	}
	return reflect.ValueOf(f).IsZero()
}

// validate checks opts: a known Mode, Queue only with ResendToQueue,
// Limit and ExpectedCount within 0..100,000 (auditconst.CheckResendOptions,
// which the HTTP API shares).
func (o ResendOptions) validate() error {
	return auditconst.CheckResendOptions(string(o.Mode), o.Queue, o.Limit, o.ExpectedCount)
}

// errResenderClosed (middleware.ErrClosed) is returned by Resend after Close.
var errResenderClosed = fmt.Errorf("audit: resender: %w", middleware.ErrClosed)
