package admin

import (
	"encoding/json"
	"fmt"
	"math/big"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/wire"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// watermillUUIDHeader is the AMQP header in which watermill-amqp's default
// marshaler carries the Watermill message UUID.
const watermillUUIDHeader = "_watermill_message_uuid"

// Message is one message read from a poison queue, with the metadata the
// middleware.PoisonForwarder and the retry middlewares wrote parsed out of its headers.
// Missing or malformed headers leave the corresponding field at its zero
// value; the raw values stay available in Headers.
type Message struct {
	// UUID is the Watermill message UUID (header "_watermill_message_uuid"),
	// or the AMQP message-id property when that header is absent.
	UUID string `json:"uuid"`
	// Body is the message payload, unchanged. JSON encodes it as base64.
	Body []byte `json:"body"`
	// Headers holds every AMQP header as a string: strings and byte arrays
	// as-is, numbers and booleans in Go's decimal notation, timestamps in
	// RFC 3339 (UTC), nested tables and arrays (e.g. x-death) as JSON.
	Headers map[string]string `json:"headers"`

	// Reason is the error text the message was poisoned with
	// (reason_poisoned).
	Reason string `json:"reason,omitempty"`
	// Class is the error class of the last failure
	// (rabbitretry-error-class), e.g. "permanent", "malformed", "exhausted".
	Class string `json:"class,omitempty"`
	// Handler is the Watermill handler that failed (handler_poisoned).
	Handler string `json:"handler,omitempty"`
	// Topic is the subscribe topic of that handler (topic_poisoned).
	Topic string `json:"topic,omitempty"`
	// Subscriber is the Watermill subscriber name (subscriber_poisoned).
	Subscriber string `json:"subscriber,omitempty"`
	// LastError is the text of the last handler error
	// (rabbitretry-last-error).
	LastError string `json:"last_error,omitempty"`
	// OriginalQueue, OriginalExchange and OriginalRoutingKey say where the
	// message was first consumed from (rabbitretry-original-queue,
	// -original-exchange, -original-routing-key). Replay sends the message
	// back to OriginalQueue.
	OriginalQueue      string `json:"original_queue,omitempty"`
	OriginalExchange   string `json:"original_exchange,omitempty"`
	OriginalRoutingKey string `json:"original_routing_key,omitempty"`
	// Attempts is how many attempts were made before the message was
	// poisoned (rabbitretry-attempts; if absent, rabbitretry-attempt). 0 when
	// unknown or malformed.
	Attempts int `json:"attempts"`
	// FirstFailure and LastFailure are the times of the first and the last
	// failed attempt (rabbitretry-first-failure, rabbitretry-last-failure).
	FirstFailure time.Time `json:"first_failure,omitzero"`
	LastFailure  time.Time `json:"last_failure,omitzero"`
	// PoisonedAt is when the message was poisoned (rabbitretry-poisoned-at).
	PoisonedAt time.Time `json:"poisoned_at,omitzero"`

	// DeliveryTag is the delivery tag of the basic.get that read the message.
	// It is only meaningful inside the operation that read it (the channel
	// is closed when the operation returns); informational.
	DeliveryTag uint64 `json:"-"`
	// Redelivered is the AMQP redelivered flag: true if the message had been
	// delivered before, e.g. by an earlier List.
	Redelivered bool `json:"redelivered"`
}

// messageFromDelivery parses a delivery read from a poison queue. It never
// fails: missing or malformed metadata leaves fields at their zero values.
func messageFromDelivery(d amqp.Delivery) Message {
	m := Message{
		Body:        d.Body,
		Headers:     make(map[string]string, len(d.Headers)),
		DeliveryTag: d.DeliveryTag,
		Redelivered: d.Redelivered,
	}
	for k, v := range d.Headers {
		m.Headers[k] = stringify(v)
	}
	h := func(key string) string { return m.Headers[key] }
	m.UUID = h(watermillUUIDHeader)
	if m.UUID == "" {
		m.UUID = d.MessageId
	}
	m.Reason = h(retrymeta.PoisonReasonKey)
	m.Class = h(middleware.ErrorClassKey)
	m.Handler = h(retrymeta.PoisonHandlerKey)
	m.Topic = h(retrymeta.PoisonTopicKey)
	m.Subscriber = h(retrymeta.PoisonSubscriberKey)
	m.LastError = h(middleware.LastErrorKey)
	m.OriginalQueue = h(middleware.OriginalQueueKey)
	m.OriginalExchange = h(middleware.OriginalExchangeKey)
	m.OriginalRoutingKey = h(middleware.OriginalRoutingKeyKey)
	if deaths, err := wire.DeathRecordsFromTable(d.Headers[middleware.XDeathKey]); err == nil && len(deaths) > 0 {
		// Dead-lettered into the poison queue by the broker (a quorum Q's
		// dead-letter exchange: expiry, max-length, delivery limit), not
		// forwarded by the library: its rabbitretry-original-* headers are
		// the producer's, maybe forged. The broker's own record of the
		// queue it died in (the most recent x-death entry) is the origin.
		// The library's poison copies never carry x-death.
		m.OriginalQueue = deaths[0].Queue
		m.OriginalExchange = deaths[0].Exchange
		m.OriginalRoutingKey = ""
		if len(deaths[0].RoutingKeys) > 0 {
			m.OriginalRoutingKey = deaths[0].RoutingKeys[0]
		}
		if m.Class == "" && deaths[0].Reason != "" {
			m.Class = "dead-lettered:" + deaths[0].Reason
		}
	}
	if n, ok := parseAttempts(h(middleware.PoisonAttemptsKey)); ok {
		m.Attempts = n
	} else if n, ok := parseAttempts(h(middleware.AttemptKey)); ok {
		m.Attempts = n
	}
	m.FirstFailure = parseTime(d.Headers[middleware.FirstFailureKey])
	m.LastFailure = parseTime(d.Headers[middleware.LastFailureKey])
	m.PoisonedAt = parseTime(d.Headers[middleware.PoisonedAtKey])
	return m
}

// parseAttempts accepts a decimal in [0, middleware.MaxAttemptsCap]; larger
// values read as the cap.
func parseAttempts(s string) (int, bool) {
	if s == "" {
		return 0, false
	}
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil {
		if ne, ok := err.(*strconv.NumError); ok && ne.Err == strconv.ErrRange && s[0] != '-' {
			return middleware.MaxAttemptsCap, true
		}
		return 0, false
	}
	if n < 0 {
		return 0, false
	}
	if n > middleware.MaxAttemptsCap {
		n = middleware.MaxAttemptsCap
	}
	return int(n), true
}

// parseTime accepts an RFC 3339 string (with or without fractional
// seconds) or an AMQP timestamp; anything else yields the zero time.
func parseTime(v any) time.Time {
	switch x := v.(type) {
	case time.Time:
		return x.UTC()
	case string:
		t, err := time.Parse(time.RFC3339Nano, strings.TrimSpace(x))
		if err != nil {
			return time.Time{}
		}
		return t.UTC()
	case []byte:
		return parseTime(string(x))
	}
	return time.Time{}
}

// stringify renders an AMQP field value as documented on Message.Headers.
func stringify(v any) string {
	switch x := v.(type) {
	case nil:
		return ""
	case string:
		return x
	case []byte:
		return string(x)
	case bool:
		return strconv.FormatBool(x)
	case int, int8, int16, int32, int64, uint, uint8, uint16, uint32, uint64:
		return fmt.Sprint(x)
	case float32:
		return strconv.FormatFloat(float64(x), 'g', -1, 32)
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64)
	case time.Time:
		return x.UTC().Format(time.RFC3339)
	case amqp.Decimal:
		return formatDecimal(x)
	case amqp.Table, []any:
		b, err := json.Marshal(jsonable(x))
		if err != nil {
			return fmt.Sprint(x)
		}
		return string(b)
	default:
		return fmt.Sprint(x)
	}
}

// jsonable converts AMQP values to values encoding/json renders readably.
func jsonable(v any) any {
	switch x := v.(type) {
	case amqp.Table:
		m := make(map[string]any, len(x))
		for k, e := range x {
			m[k] = jsonable(e)
		}
		return m
	case []any:
		a := make([]any, len(x))
		for i, e := range x {
			a[i] = jsonable(e)
		}
		return a
	case []byte:
		return string(x)
	case time.Time:
		return x.UTC().Format(time.RFC3339)
	case amqp.Decimal:
		return formatDecimal(x)
	case float32:
		return float64(x)
	default:
		return x
	}
}

// formatDecimal renders Value * 10^-Scale exactly.
func formatDecimal(d amqp.Decimal) string {
	r := new(big.Rat).SetFrac(big.NewInt(int64(d.Value)), new(big.Int).Exp(big.NewInt(10), big.NewInt(int64(d.Scale)), nil))
	return r.FloatString(int(d.Scale))
}
