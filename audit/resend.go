package audit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/middleware"

	"github.com/rabbitretry/rabbitretry/internal/mgmt"
	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// DefaultLoopBackExchange is the default ResenderConfig.LoopBackExchange,
// the loop-back exchange amqpretry declares (amqpretry.Naming): a direct
// exchange to which every originating queue Q is bound with routing key Q.
const DefaultLoopBackExchange = "rabbitretry.loopback"

// ResentKey is the header every resent copy carries: the time of the
// resend, RFC 3339 in UTC.
const ResentKey = "rabbitretry-resent"

// DefaultResenderConnectionName is the client-provided connection name
// (RabbitMQ "Connections" guide) of the Resender's publisher connection.
const DefaultResenderConnectionName = "rabbitretry-audit-resend"

// Resend limits.
const (
	// DefaultResendLimit is the number of messages Resend considers when
	// ResendOptions.Limit is 0.
	DefaultResendLimit = 1000
	// MaxResendLimit is the largest ResendOptions.Limit.
	MaxResendLimit = 100000
	// DefaultResendConfirmAbove is the default
	// ResenderConfig.ConfirmAbove: a filter that selects more messages
	// than this needs ResendOptions.AllowAll.
	DefaultResendConfirmAbove = 10
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
	ResendToQueue ResendMode = "to-queue"
	// ResendToExchange publishes the message again to its original
	// exchange with its original routing key: EVERY queue bound to it
	// receives it again (all consumers, and the audit's arrivals queue, so
	// the resent copy is recorded as a new arrival). A message the exchange
	// would route to the audit's arrivals queue only is not published and
	// is reported failed (ErrRoutedOnlyToAudit; ResenderConfig.ManagementURL).
	ResendToExchange ResendMode = "to-exchange"
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
	// ErrExchangeNotFound: an exchange does not exist on the broker,
	// wrapped with its name: the loop-back exchange of a resend
	// (ResendToQueue; nothing was published), or an audited business
	// exchange in Consumer.Declare and Consumer.Run.
	ErrExchangeNotFound = errors.New("exchange not found")
)

// errResenderClosed: the Resender was closed (middleware.ErrClosed).
var errResenderClosed = fmt.Errorf("audit: resender: %w", middleware.ErrClosed)

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
	// (ResendToQueue). Default DefaultLoopBackExchange, the same default as
	// amqpretry.Naming.LoopBackExchange.
	LoopBackExchange string
	// UUIDHeaderKey is the header holding the Watermill message UUID.
	// Default "_watermill_message_uuid" (watermill-amqp's default).
	UUIDHeaderKey string
	// ConfirmTimeout bounds the wait for each publisher confirm (default
	// 30 s, confirm.Config.ConfirmTimeout).
	ConfirmTimeout time.Duration
	// ConnectionName is the client-provided connection name. Default
	// DefaultResenderConnectionName.
	ConnectionName string
	// ManagementURL is the RabbitMQ management HTTP API ("Management
	// Plugin"), e.g. "http://user:password@host:15672/", that a
	// ResendToExchange reads the exchange's bindings from before
	// publishing: a message the exchange would route to no queue but the
	// audit's own arrivals queue (its business binding is gone) is reported
	// failed with ErrRoutedOnlyToAudit and not published (a mandatory
	// publish cannot tell: the audit's binding alone makes it routed). The
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
	// count as a route. Default DefaultArrivalsQueue (the Consumer's
	// Naming.ArrivalsQueue).
	ArrivalsQueue string
	// Logger gets connection events. Default watermill.NopLogger{}.
	Logger watermill.LoggerAdapter
	// ConfirmAbove is how many messages a filter may select before a
	// resend needs ResendOptions.AllowAll (ErrBroadResend). Default
	// DefaultResendConfirmAbove (10); at most MaxResendLimit.
	ConfirmAbove int
}

func (c *ResenderConfig) setDefaults() {
	if c.ConfirmAbove == 0 {
		c.ConfirmAbove = DefaultResendConfirmAbove
	}
	if c.LoopBackExchange == "" {
		c.LoopBackExchange = DefaultLoopBackExchange
	}
	if c.UUIDHeaderKey == "" {
		c.UUIDHeaderKey = wamqp.DefaultMessageUUIDHeaderKey
	}
	if c.ConnectionName == "" {
		c.ConnectionName = DefaultResenderConnectionName
	}
	if c.ArrivalsQueue == "" {
		c.ArrivalsQueue = DefaultArrivalsQueue
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
	case c.ConfirmAbove < 0 || c.ConfirmAbove > MaxResendLimit:
		return fmt.Errorf("audit: ResenderConfig.ConfirmAbove %d: want 0 (default %d) to %d", c.ConfirmAbove, DefaultResendConfirmAbove, MaxResendLimit)
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
	// first as Search returns them. Default DefaultResendLimit, at most
	// MaxResendLimit; Filter.Limit is ignored (Filter.After starts the
	// walk). ResendReport.Next continues after the last one.
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

// Status of one message in a ResendReport.
const (
	StatusSent      = "sent"       // published and confirmed by the broker
	StatusWouldSend = "would-send" // DryRun: would be published
	StatusFailed    = "failed"     // returned, nacked, or the publish failed
	StatusSkipped   = "skipped"    // not sendable (no body, truncated body, no queue)
	StatusUnsent    = "unsent"     // not tried: Resend stopped before it (see its error)
)

// ResendResult is what Resend did with one message.
type ResendResult struct {
	// MessageID is the message's id (the Watermill UUID).
	MessageID string `json:"message_id"`
	// Exchange and RoutingKey are where it was (or would be) published;
	// Queue is the target queue of ResendToQueue.
	Exchange   string `json:"exchange"`
	RoutingKey string `json:"routing_key"`
	Queue      string `json:"queue,omitempty"`
	// Status is one of StatusSent, StatusWouldSend, StatusFailed,
	// StatusSkipped, StatusUnsent; Error says why for all but the first
	// two.
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

// Resender publishes audited messages again from their arrival records.
// It is safe for concurrent use.
type Resender struct {
	cfg ResenderConfig

	mu     sync.Mutex
	pub    *confirm.Publisher
	closed bool
}

// NewResender validates cfg and returns a Resender; it does not connect.
func NewResender(cfg ResenderConfig) (*Resender, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg.setDefaults()
	return &Resender{cfg: cfg}, nil
}

// Close closes the publisher connection, if one was opened.
func (r *Resender) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	if r.pub != nil {
		err := r.pub.Close()
		r.pub = nil
		return err
	}
	return nil
}

func (r *Resender) publisher() (*confirm.Publisher, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil, errResenderClosed
	}
	if r.pub == nil {
		p, err := confirm.New(confirm.Config{
			URI:            r.cfg.URI,
			ConnectionName: r.cfg.ConnectionName,
			ConfirmTimeout: r.cfg.ConfirmTimeout,
			Channels:       1,
			Logger:         r.cfg.Logger,
		})
		if err != nil {
			return nil, fmt.Errorf("audit: resend: connecting: %w", err)
		}
		r.pub = p
	}
	return r.pub, nil
}

// IsEmptyFilter reports whether f selects every message (only Limit and
// After set, or nothing).
func IsEmptyFilter(f Filter) bool {
	f.Limit, f.After = 0, ""
	if len(f.Headers) == 0 {
		f.Headers = nil
	}
	return reflect.ValueOf(f).IsZero()
}

// Validate checks opts: a known Mode, Queue only with ResendToQueue,
// Limit within 0..MaxResendLimit.
func (o ResendOptions) Validate() error {
	switch o.Mode {
	case ResendToQueue, ResendToExchange:
	case "":
		return fmt.Errorf("audit: ResendOptions.Mode is required (%q or %q)", ResendToQueue, ResendToExchange)
	default:
		return fmt.Errorf("audit: ResendOptions.Mode %q: want %q or %q", o.Mode, ResendToQueue, ResendToExchange)
	}
	switch {
	case o.Queue != "" && o.Mode != ResendToQueue:
		return fmt.Errorf("audit: ResendOptions.Queue is only for mode %q", ResendToQueue)
	case len(o.Queue) > 255:
		return errors.New("audit: ResendOptions.Queue is longer than 255 bytes")
	case o.Limit < 0 || o.Limit > MaxResendLimit:
		return fmt.Errorf("audit: ResendOptions.Limit %d: want 0..%d", o.Limit, MaxResendLimit)
	case o.ExpectedCount < 0 || o.ExpectedCount > MaxResendLimit:
		return fmt.Errorf("audit: ResendOptions.ExpectedCount %d: want 0..%d", o.ExpectedCount, MaxResendLimit)
	}
	return nil
}

// pager is the optional Store capability Resend pages with
// (pgstore.Store.SearchPage).
type pager interface {
	SearchPage(ctx context.Context, f Filter) ([]Message, string, error)
}

// Resend publishes again the messages f selects, from their arrival
// records (body byte-exact, headers and properties as they arrived), in
// the mode opts.Mode; see ResendToQueue and ResendToExchange.
//
// The copy carries the arrival's headers minus every "rabbitretry-*" key
// and the broker's x-death / x-first-death-* / x-last-death-* /
// x-delivery-count / x-acquired-count (so the retry chain starts again at
// attempt 1), plus ResentKey = the resend time (RFC 3339, UTC) and, with
// ResendToQueue, rabbitretry-original-exchange and
// rabbitretry-original-routing-key = the arrival's (the loop-back exchange
// is the retry chain's own path, so a later failure records the true
// origin, as after a poisonctl replay); the message
// UUID header (or, without one, message-id = the message id), the
// correlation-id, timestamp and the other properties of the arrival, except
// user-id (RabbitMQ refuses a user-id that is not the connection's user:
// "Validated User-ID"). Header values are published exactly as they
// arrived, each with its AMQP field type (Arrival.HeaderTable: int32 stays
// int32, int64 stays exact, decimals, timestamps and byte arrays keep
// their type). Only for an arrival recorded before that was stored (no
// HeaderTable) do they come back from their JSON form
// (amqpwire.HeadersToJSON): strings, booleans, integers (as int64,
// whatever their AMQP width), other numbers and AMQP decimals (float64),
// nested tables and arrays; timestamps (RFC 3339) and byte arrays
// (base64) recorded as strings stay strings.
//
// The message published is the arrival the filter matched
// (Message.Arrival: the first arrival of the message id that matches the
// Filter's Exchange, RoutingKey and Headers). A message id whose matching
// arrivals differ (Message.ArrivalVariants > 1: one id published with two
// contents, e.g. by two tenants on two exchanges) is never resent: it is
// skipped as ambiguous, with the counts, until the filter narrows it to
// one.
//
// Every publish is mandatory and waits for its publisher confirm
// (confirm.Publisher; RabbitMQ "Publishers" and "Consumer
// Acknowledgements and Publisher Confirms"): a message the broker returns
// (no queue bound for it: amqpretry.ErrUnroutable), nacks, or refuses for
// a missing exchange is reported as failed in its ResendResult and Resend
// goes on. Messages without an arrival record, with a truncated body, or
// (ResendToQueue) without a queue are skipped with the reason.
//
// Resend refuses a filter that selects everything (ErrEmptyFilter) unless
// opts.AllowAll. Breadth is also judged by the result, whatever fields the
// filter sets (a time range from 1970 selects everything): a filter that
// selects more than ResenderConfig.ConfirmAbove messages (10 by default),
// or every message of the store, is refused with ErrBroadResend unless
// opts.AllowAll; opts.ExpectedCount, when set, must equal the matched
// count (ErrCountMismatch). Both are checked before anything is sent.
// DryRun reports what would be sent without connecting and is never
// refused for breadth: it tells the count to pass as ExpectedCount.
//
// Messages are published oldest first (Limit keeps the newest matches),
// runs of consecutive messages to the same exchange and routing key
// pipelined on one channel (up to 256 awaiting confirms,
// confirm.Publisher.PublishRawBatch), so a queue receives them in their
// original order.
//
// Errors (with the partial report): ErrEmptyFilter, ErrBroadResend,
// ErrCountMismatch (Matched set, nothing sent), a ResendOptions Validate
// error; the Store's; ErrExchangeNotFound (loop-back exchange
// missing, nothing sent); a connection, confirm-timeout or channel error
// (amqpretry.ErrConfirmTimeout, ErrChannelClosed, ...), which stops Resend
// after the batch in flight: its messages that failed so are reported
// failed and may or may not have been delivered, the ones not tried
// StatusUnsent; ctx.Err() (checked between batches); middleware.ErrClosed (wrapped).
func (r *Resender) Resend(ctx context.Context, f Filter, opts ResendOptions) (ResendReport, error) {
	rep := ResendReport{Mode: opts.Mode, DryRun: opts.DryRun, Results: []ResendResult{}}
	if err := opts.Validate(); err != nil {
		return rep, err
	}
	if IsEmptyFilter(f) && !opts.AllowAll {
		return rep, ErrEmptyFilter
	}
	limit := opts.Limit
	if limit == 0 {
		limit = DefaultResendLimit
	}
	msgs, next, err := r.collect(ctx, f, limit)
	if err != nil {
		return rep, err
	}
	rep.Next = next
	rep.Matched = len(msgs)
	if !opts.DryRun {
		if err := r.checkBreadth(ctx, f, len(msgs), opts); err != nil {
			return rep, err
		}
	}

	var pub *confirm.Publisher
	if !opts.DryRun {
		if pub, err = r.publisher(); err != nil {
			return rep, err
		}
		if opts.Mode == ResendToQueue {
			if err := checkExchange(pub, r.cfg.LoopBackExchange); err != nil {
				return rep, err
			}
		}
	}
	now := time.Now().UTC()
	// Oldest first: a queue receives them in their original order.
	slices.Reverse(msgs)
	rep.Matched = len(msgs)
	rep.Results = make([]ResendResult, len(msgs))
	pubs := make([]amqp.Publishing, len(msgs))
	sendable := make([]bool, len(msgs))
	for i, m := range msgs {
		res, p, ok := r.plan(m, f.Queue, opts, now)
		rep.Results[i], pubs[i], sendable[i] = res, p, ok
		switch {
		case !ok:
			rep.Skipped++
		case opts.DryRun:
			rep.Results[i].Status = StatusWouldSend
			rep.Sent++
		}
	}
	// Exchanges the management API does not know: missing, or the API is
	// another broker's (then the broker has them: not published).
	var unknown map[string]bool
	if opts.Mode == ResendToExchange && !r.cfg.SkipRouteCheck {
		var err error
		if unknown, err = r.checkRoutes(ctx, &rep, pubs, sendable); err != nil {
			return rep, err
		}
	}
	if opts.DryRun {
		return rep, nil
	}
	exchangeOK := map[string]error{}
	for i := 0; i < len(msgs); {
		if !sendable[i] {
			i++
			continue
		}
		// A run of consecutive messages to the same exchange and key is
		// published pipelined on one channel, in order.
		ex, key := rep.Results[i].Exchange, rep.Results[i].RoutingKey
		j := i + 1
		for j < len(msgs) && j-i < resendBatch && sendable[j] && rep.Results[j].Exchange == ex && rep.Results[j].RoutingKey == key {
			j++
		}
		if err := ctx.Err(); err != nil {
			return r.stopped(rep, sendable, i, err)
		}
		if opts.Mode == ResendToExchange && ex != "" {
			exErr, seen := exchangeOK[ex]
			if !seen {
				exErr = checkExchange(pub, ex)
				if exErr == nil && unknown[ex] {
					exErr = fmt.Errorf("audit: resend: the management API (ResenderConfig.ManagementURL) has no exchange %q, which the broker has: it is another broker's or vhost's, so where the exchange routes is unknown; not published", ex)
				}
				exchangeOK[ex] = exErr
			}
			if exErr != nil {
				for k := i; k < j; k++ {
					rep.Results[k].Status, rep.Results[k].Error = StatusFailed, exErr.Error()
					rep.Failed++
				}
				i = j
				continue
			}
		}
		errs := batchErrors(pub.PublishRawBatch(ctx, ex, key, pubs[i:j]), j-i)
		var stop error
		for k := i; k < j; k++ {
			if err := errs[k-i]; err != nil {
				rep.Results[k].Status, rep.Results[k].Error = StatusFailed, err.Error()
				rep.Failed++
				if !perMessage(err) && stop == nil {
					stop = fmt.Errorf("audit: resend stopped at message %s: %w", rep.Results[k].MessageID, err)
				}
				continue
			}
			rep.Results[k].Status = StatusSent
			rep.Sent++
		}
		if stop != nil {
			return r.stopped(rep, sendable, j, stop)
		}
		i = j
	}
	return rep, nil
}

// checkBreadth refuses a resend whose result is broad without
// opts.AllowAll (ErrBroadResend) and one whose matched count is not
// opts.ExpectedCount (ErrCountMismatch). Breadth is the store's answer:
// the filter's matches from the start (After and Limit cleared), counted
// up to ConfirmAbove+1, and, when that many or fewer, compared with the
// store's first messages: the same number means the filter selects every
// message. A filter naming a message id is never "every message".
func (r *Resender) checkBreadth(ctx context.Context, f Filter, matched int, opts ResendOptions) error {
	if opts.ExpectedCount > 0 && matched != opts.ExpectedCount {
		return fmt.Errorf("%w: %d matched, %d expected; nothing was sent", ErrCountMismatch, matched, opts.ExpectedCount)
	}
	if opts.AllowAll || matched == 0 {
		return nil
	}
	above := r.cfg.ConfirmAbove
	whole := f
	whole.After, whole.Limit = "", above+1
	sel, err := r.cfg.Store.Search(ctx, whole)
	if err != nil {
		return fmt.Errorf("audit: resend: search: %w", err)
	}
	if len(sel) > above {
		return fmt.Errorf("%w: more than %d messages match (ResenderConfig.ConfirmAbove); nothing was sent: set ResendOptions.AllowAll (auditctl --yes, HTTP allow_all with expected_count) or narrow the filter", ErrBroadResend, above)
	}
	if f.MessageID != "" {
		return nil
	}
	all, err := r.cfg.Store.Search(ctx, Filter{Limit: len(sel) + 1})
	if err != nil {
		return fmt.Errorf("audit: resend: search: %w", err)
	}
	if len(all) <= len(sel) {
		return fmt.Errorf("%w: the filter selects every message of the audit (%d); nothing was sent: set ResendOptions.AllowAll (auditctl --yes, HTTP allow_all with expected_count) or narrow the filter", ErrBroadResend, len(sel))
	}
	return nil
}

// checkRoutes marks failed (ErrRoutedOnlyToAudit) every sendable message
// whose exchange would route it to no queue but the audit's arrivals
// queue (ResenderConfig.ManagementURL); an error if the bindings cannot be
// read (then nothing is published).
func (r *Resender) checkRoutes(ctx context.Context, rep *ResendReport, pubs []amqp.Publishing, sendable []bool) (map[string]bool, error) {
	u, err := amqp.ParseURI(r.cfg.URI)
	if err != nil {
		return nil, err
	}
	rc, err := newRouteChecker(r.cfg.ManagementURL, u.Vhost, r.cfg.ArrivalsQueue)
	if err != nil {
		return nil, err
	}
	unknown := map[string]bool{}
	for i := range sendable {
		res := &rep.Results[i]
		if !sendable[i] || res.Exchange == "" {
			continue
		}
		other, toAudit, err := rc.reachesOtherQueue(ctx, res.Exchange, res.RoutingKey, pubs[i].Headers)
		if mgmt.IsNotFound(err) {
			unknown[res.Exchange] = true // the publish loop tells missing from another broker's API
			continue
		}
		if ctx.Err() != nil {
			return unknown, nil // the publish loop reports the rest unsent
		}
		if err != nil {
			return nil, fmt.Errorf("audit: resend: checking where exchange %q routes (set ResenderConfig.ManagementURL, or SkipRouteCheck): %w", res.Exchange, err)
		}
		// Routed nowhere: the mandatory publish reports it (unroutable).
		if !other && toAudit {
			if rep.DryRun {
				rep.Sent--
			}
			sendable[i] = false
			res.Status, res.Error = StatusFailed, ErrRoutedOnlyToAudit.Error()
			rep.Failed++
		}
	}
	return unknown, nil
}

// stopped marks the sendable messages from index from on as not tried.
func (r *Resender) stopped(rep ResendReport, sendable []bool, from int, err error) (ResendReport, error) {
	for k := from; k < len(sendable); k++ {
		if sendable[k] {
			rep.Results[k].Status, rep.Results[k].Error = StatusUnsent, "not tried: resend stopped"
			rep.Unsent++
		}
	}
	return rep, err
}

// batchErrors splits PublishRawBatch's result into one error per message
// (its errors.Join of "message <index>: <error>"); an error without an
// index (the publisher closed before anything was written) applies to all.
func batchErrors(err error, n int) []error {
	out := make([]error, n)
	if err == nil {
		return out
	}
	joined, ok := err.(interface{ Unwrap() []error })
	if ok {
		all := true
		for _, e := range joined.Unwrap() {
			var i int
			if _, serr := fmt.Sscanf(e.Error(), "message %d:", &i); serr != nil || i < 0 || i >= n {
				all = false
				break
			}
			out[i] = e
		}
		if all {
			return out
		}
	}
	for i := range out {
		out[i] = err
	}
	return out
}

// collect reads up to limit messages matching f, paging when the store can.
func (r *Resender) collect(ctx context.Context, f Filter, limit int) ([]Message, string, error) {
	pg, canPage := r.cfg.Store.(pager)
	if !canPage {
		f.Limit = min(limit, 10000)
		msgs, err := r.cfg.Store.Search(ctx, f)
		if err != nil {
			return nil, "", fmt.Errorf("audit: resend: search: %w", err)
		}
		if len(msgs) > limit {
			msgs = msgs[:limit]
		}
		return msgs, "", nil
	}
	var out []Message
	for len(out) < limit {
		f.Limit = min(resendPageSize, limit-len(out))
		page, next, err := pg.SearchPage(ctx, f)
		if err != nil {
			return nil, "", fmt.Errorf("audit: resend: search: %w", err)
		}
		out = append(out, page...)
		if next == "" {
			return out, "", nil
		}
		f.After = next
	}
	// Limit reached: is there more?
	f.Limit = 1
	more, _, err := pg.SearchPage(ctx, f)
	if err != nil {
		return nil, "", fmt.Errorf("audit: resend: search: %w", err)
	}
	if len(more) == 0 {
		return out, "", nil
	}
	return out, f.After, nil
}

// perMessage: errors caused by the message or its destination, after
// which Resend goes on with the next message.
func perMessage(err error) bool {
	if errors.Is(err, confirm.ErrUnroutable) || errors.Is(err, confirm.ErrNacked) {
		return true
	}
	var ae *amqp.Error
	return errors.As(err, &ae) && ae.Code == amqp.NotFound
}

// checkExchange passively declares exchange on a fresh channel
// (exchange.declare passive=true: 404 NOT_FOUND closes that channel only).
func checkExchange(pub *confirm.Publisher, exchange string) error {
	if exchange == "" {
		return nil // the default exchange always exists
	}
	ch, err := pub.Channel()
	if err != nil {
		return fmt.Errorf("audit: resend: opening a channel: %w", err)
	}
	defer ch.Close()
	if err := ch.ExchangeDeclarePassive(exchange, "direct", true, false, false, false, nil); err != nil {
		var ae *amqp.Error
		if errors.As(err, &ae) && ae.Code == amqp.NotFound {
			return fmt.Errorf("audit: resend: %w: %q", ErrExchangeNotFound, exchange)
		}
		return fmt.Errorf("audit: resend: checking exchange %q: %w", exchange, err)
	}
	return nil
}

// targetQueue picks the ResendToQueue target: opts.Queue, else
// Filter.Queue, else the one queue m's attempts were made in. A message
// with attempts in several queues (a fan-out: the same message id consumed
// from each queue bound to its exchange) has no single original queue, so
// it gets "" and the reason; so does one without attempts.
func targetQueue(m Message, filterQueue string, opts ResendOptions) (string, string) {
	switch {
	case opts.Queue != "":
		return opts.Queue, ""
	case filterQueue != "":
		return filterQueue, ""
	}
	var queues []string
	seen := map[string]bool{}
	for _, a := range m.Attempts {
		if !seen[a.Queue] {
			seen[a.Queue] = true
			queues = append(queues, a.Queue)
		}
	}
	switch len(queues) {
	case 0:
		return "", "no attempt records, so no queue is known: name one (ResendOptions.Queue, or filter by queue)"
	case 1:
		return queues[0], ""
	}
	sort.Strings(queues)
	return "", fmt.Sprintf("attempts in several queues (%s): name one (ResendOptions.Queue, or filter by queue)", strings.Join(queues, ", "))
}

// plan builds the result skeleton and the publishing for m; ok=false means
// skipped (res says why).
func (r *Resender) plan(m Message, filterQueue string, opts ResendOptions, now time.Time) (ResendResult, amqp.Publishing, bool) {
	res := ResendResult{MessageID: m.MessageID}
	a := m.Arrival
	if a != nil {
		res.Exchange, res.RoutingKey = a.Exchange, a.RoutingKey
	}
	if opts.Mode == ResendToQueue {
		q, why := targetQueue(m, filterQueue, opts)
		res.Exchange, res.RoutingKey, res.Queue = r.cfg.LoopBackExchange, q, q
		if q == "" && a != nil {
			return skip(res, why)
		}
	}
	switch {
	case a == nil:
		return skip(res, "no arrival record (no body): the message arrived before auditing began or not through an audited exchange")
	case m.ArrivalVariants > 1:
		return skip(res, fmt.Sprintf("ambiguous: %d arrivals of this message id match, %d different (exchange, routing key, headers, properties or body); narrow the filter (exchange, routing key, headers) to one", m.ArrivalCount, m.ArrivalVariants))
	case a.BodyTruncated || len(a.Body) < a.BodySize:
		return skip(res, fmt.Sprintf("body truncated in the audit (%d of %d bytes stored)", len(a.Body), a.BodySize))
	}
	p, err := r.publishing(m, opts.Mode, now)
	if err != nil {
		return skip(res, err.Error())
	}
	return res, p, true
}

func skip(res ResendResult, why string) (ResendResult, amqp.Publishing, bool) {
	res.Status, res.Error = StatusSkipped, why
	return res, amqp.Publishing{}, false
}

// stripHeader reports whether a header must not be carried to a resent
// copy: retry state of rabbitretry and of the broker
// (middleware.IsRetryState), and every other key of the library's (prefix
// "rabbitretry-": its failure history, an earlier resend's or replay's
// marks), so that the copy is the arrival as its producer sent it.
func stripHeader(k string) bool {
	return middleware.IsRetryState(k) || strings.HasPrefix(k, "rabbitretry-")
}

// publishing rebuilds the AMQP message of m's arrival.
func (r *Resender) publishing(m Message, mode ResendMode, now time.Time) (amqp.Publishing, error) {
	a := m.Arrival
	h := amqp.Table{}
	if a.HeaderTable != nil {
		// Exact: every value with its AMQP field type, as it arrived.
		for k, v := range a.HeaderTable {
			if !stripHeader(k) {
				h[k] = v
			}
		}
	} else {
		for k, v := range a.Headers {
			if stripHeader(k) {
				continue
			}
			av, err := amqpValue(v, 0)
			if err != nil {
				return amqp.Publishing{}, fmt.Errorf("header %q: %v", k, err)
			}
			h[k] = av
		}
	}
	h[ResentKey] = now.Format(time.RFC3339)
	if mode == ResendToQueue && a.Exchange != "" {
		// Through the loop-back exchange the retry chain trusts these
		// (its own retry path): a later failure records the true origin,
		// not the loop-back exchange.
		h[middleware.OriginalExchangeKey] = a.Exchange
		h[middleware.OriginalRoutingKeyKey] = a.RoutingKey
	}
	p := amqp.Publishing{
		Headers:       h,
		CorrelationId: a.CorrelationID,
		Timestamp:     a.PublishedAt,
		Body:          a.Body,
	}
	if _, ok := h[r.cfg.UUIDHeaderKey]; !ok && m.MessageID != "" {
		p.MessageId = m.MessageID
	}
	if p.CorrelationId == "" {
		p.CorrelationId = a.Properties["correlation-id"]
	}
	for k, v := range a.Properties {
		switch k {
		case "content-type":
			p.ContentType = v
		case "content-encoding":
			p.ContentEncoding = v
		case "reply-to":
			p.ReplyTo = v
		case "expiration":
			p.Expiration = v
		case "type":
			p.Type = v
		case "app-id":
			p.AppId = v
		case "message-id":
			if p.MessageId == "" {
				p.MessageId = v
			}
		case "delivery-mode", "priority":
			n, err := strconv.ParseUint(v, 10, 8)
			if err != nil {
				return amqp.Publishing{}, fmt.Errorf("property %s %q is not a number 0..255", k, v)
			}
			if k == "priority" {
				p.Priority = uint8(n)
			} else {
				p.DeliveryMode = uint8(n)
			}
		}
	}
	return p, nil
}

// amqpValue converts a header value from its JSON form to an AMQP field.
func amqpValue(v any, depth int) (any, error) {
	if depth > 64 {
		return nil, errors.New("nested too deeply")
	}
	switch x := v.(type) {
	case nil, bool, string, int64, int32, int16, int8, int, float32, []byte, time.Time:
		return x, nil
	case float64:
		if x == math.Trunc(x) && math.Abs(x) < 1<<53 {
			return int64(x), nil
		}
		return x, nil
	case json.Number:
		if n, err := x.Int64(); err == nil {
			return n, nil
		}
		f, err := x.Float64()
		if err != nil {
			return nil, fmt.Errorf("number %q: %v", x, err)
		}
		return f, nil
	case map[string]any:
		t := amqp.Table{}
		for k, e := range x {
			ev, err := amqpValue(e, depth+1)
			if err != nil {
				return nil, err
			}
			t[k] = ev
		}
		return t, nil
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			ev, err := amqpValue(e, depth+1)
			if err != nil {
				return nil, err
			}
			out[i] = ev
		}
		return out, nil
	}
	return nil, fmt.Errorf("unsupported value of type %T", v)
}
