package audit

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/middleware"
)

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
	res.Status, res.Error = auditconst.StatusSkipped, why
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
	h[auditconst.ResentKey] = now.Format(time.RFC3339)
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
	if err := setProperties(&p, a.Properties); err != nil {
		return amqp.Publishing{}, err
	}
	return p, nil
}

// setProperties sets p's AMQP properties from an arrival's Properties (by
// their AMQP names); a message-id property counts only when p has none.
func setProperties(p *amqp.Publishing, props map[string]string) error {
	for k, v := range props {
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
				return fmt.Errorf("property %s %q is not a number 0..255", k, v)
			}
			if k == "priority" {
				p.Priority = uint8(n)
			} else {
				p.DeliveryMode = uint8(n)
			}
		}
	}
	return nil
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
