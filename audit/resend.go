package audit

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/internal/mgmt"
)

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
// attempt 1), plus the header "rabbitretry-resent" = the resend time (RFC 3339, UTC) and, with
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
// (wire.HeadersToJSON): strings, booleans, integers (as int64,
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
// (no queue bound for it: confirm.ErrUnroutable), nacks, or refuses for
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
// ErrCountMismatch (Matched set, nothing sent), invalid opts (an unknown
// Mode, Queue without ResendToQueue, Limit or ExpectedCount outside
// 0..100,000); the Store's; ErrExchangeNotFound (loop-back exchange
// missing, nothing sent); a connection, confirm-timeout or channel error
// (confirm.ErrConfirmTimeout, ErrChannelClosed, ...), which stops Resend
// after the batch in flight: its messages that failed so are reported
// failed and may or may not have been delivered, the ones not tried
// "unsent"; ctx.Err() (checked between batches); middleware.ErrClosed (wrapped).
func (r *Resender) Resend(ctx context.Context, f Filter, opts ResendOptions) (ResendReport, error) {
	rep := ResendReport{Mode: opts.Mode, DryRun: opts.DryRun, Results: []ResendResult{}}
	if err := opts.validate(); err != nil {
		return rep, err
	}
	if isEmptyFilter(f) && !opts.AllowAll {
		return rep, ErrEmptyFilter
	}
	limit := opts.Limit
	if limit == 0 {
		limit = defaultResendLimit
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
			rep.Results[i].Status = auditconst.StatusWouldSend
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
	return r.send(ctx, rep, pub, pubs, sendable, unknown, opts.Mode)
}

// exchangeError is why a ResendToExchange cannot publish to ex (nil if it
// can), checked once per exchange (checked caches it): the exchange is
// missing, or the management API does not know it (unknown).
func exchangeError(pub *confirm.Publisher, ex string, unknown map[string]bool, checked map[string]error) error {
	if err, seen := checked[ex]; seen {
		return err
	}
	err := checkExchange(pub, ex)
	if err == nil && unknown[ex] {
		err = fmt.Errorf("audit: resend: the management API (ResenderConfig.ManagementURL) has no exchange %q, which the broker has: it is another broker's or vhost's, so where the exchange routes is unknown; not published", ex)
	}
	checked[ex] = err
	return err
}

// send publishes the sendable pubs (rep.Results in the same order) for
// Resend: runs of consecutive messages to the same exchange and routing
// key pipelined on one channel, each exchange of a ResendToExchange
// checked once first (unknown: the exchanges the management API does not
// know). It stops at the first error that is not the message's own.
func (r *Resender) send(ctx context.Context, rep ResendReport, pub *confirm.Publisher, pubs []amqp.Publishing, sendable []bool, unknown map[string]bool, mode ResendMode) (ResendReport, error) {
	exchangeOK := map[string]error{}
	for i := 0; i < len(pubs); {
		if !sendable[i] {
			i++
			continue
		}
		// A run of consecutive messages to the same exchange and key is
		// published pipelined on one channel, in order.
		ex, key := rep.Results[i].Exchange, rep.Results[i].RoutingKey
		j := i + 1
		for j < len(pubs) && j-i < resendBatch && sendable[j] && rep.Results[j].Exchange == ex && rep.Results[j].RoutingKey == key {
			j++
		}
		if err := ctx.Err(); err != nil {
			return r.stopped(rep, sendable, i, err)
		}
		if mode == ResendToExchange && ex != "" {
			if exErr := exchangeError(pub, ex, unknown, exchangeOK); exErr != nil {
				for k := i; k < j; k++ {
					rep.Results[k].Status, rep.Results[k].Error = auditconst.StatusFailed, exErr.Error()
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
				rep.Results[k].Status, rep.Results[k].Error = auditconst.StatusFailed, err.Error()
				rep.Failed++
				if !perMessage(err) && stop == nil {
					stop = fmt.Errorf("audit: resend stopped at message %s: %w", rep.Results[k].MessageID, err)
				}
				continue
			}
			rep.Results[k].Status = auditconst.StatusSent
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

// checkRoutes marks failed (errRoutedOnlyToAudit) every sendable message
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
			res.Status, res.Error = auditconst.StatusFailed, errRoutedOnlyToAudit.Error()
			rep.Failed++
		}
	}
	return unknown, nil
}

// stopped marks the sendable messages from index from on as not tried.
func (r *Resender) stopped(rep ResendReport, sendable []bool, from int, err error) (ResendReport, error) {
	for k := from; k < len(sendable); k++ {
		if sendable[k] {
			rep.Results[k].Status, rep.Results[k].Error = auditconst.StatusUnsent, "not tried: resend stopped"
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
