package amqpretry

import (
	"errors"
	"fmt"
	"maps"
	"sort"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpwire"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/wire"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// errEmptyDelivery is returned by Marshaler.Unmarshal for a zero
// amqp.Delivery (no acknowledger, tag, headers or body), which watermill-amqp
// v2.1.3 can read from a consumer channel closed under it.
var errEmptyDelivery = errors.New("amqpretry: empty delivery from a closed channel")

// defaultMaxHeaderBytes is the default of Marshaler.MaxHeaderBytes: 16 KiB.
//
// All headers of a message travel in one AMQP content header frame, which
// must fit in the connection's negotiated frame_max (RabbitMQ "Configuration",
// frame_max, default 131072 bytes); RabbitMQ closes the connection on a
// larger frame. 16 KiB leaves ample room for properties and for headers the
// library does not control.
const defaultMaxHeaderBytes = 16 * 1024

// truncatedSuffix marks a header value that Marshal shortened to respect
// Marshaler.MaxHeaderBytes.
const truncatedSuffix = "…(truncated)"

// poisonReasonKey is the metadata key under which watermill's Poison
// middleware stores the handler error (middleware.ReasonForPoisonedKey in
// github.com/ThreeDotsLabs/watermill/message/router/middleware).
const poisonReasonKey = "reason_poisoned"

// Marshaler wraps a watermill-amqp Marshaler (default wamqp.DefaultMarshaler{})
// so that broker-set, non-string headers become readable metadata instead of
// failing Unmarshal, so that broker-owned headers never travel on a
// republished or forwarded copy, and so that a copy keeps what the producer
// sent: the AMQP types of its headers (TypedHeadersKey), its properties
// (PropContentTypeKey, ..., PropDeliveryModeKey) and its identity (a message
// without one gets a UUID on its first delivery, carried by every copy).
//
// Why: wamqp.DefaultMarshaler.Unmarshal fails on any header that is not a
// string (watermill issue #65). RabbitMQ adds such headers itself: x-death,
// an array of tables, to every dead-lettered message ("Dead Letter
// Exchanges"), and x-delivery-count, a long integer, to messages redelivered
// by a quorum queue ("Quorum Queues"). Without this wrapper such a message
// can never be unmarshaled and is nacked forever.
//
// Use the same value for the subscriber's and the publisher's
// wamqp.Config.Marshaler. The zero value is ready to use. Marshaler
// implements wamqp.Marshaler.
type Marshaler struct {
	// Inner does the actual conversion; nil means wamqp.DefaultMarshaler{}.
	// Unmarshal hands it a delivery whose headers are all strings.
	Inner wamqp.Marshaler

	// MaxHeaderBytes bounds the total size, in bytes, of the headers (keys
	// plus values; a value that is not a string, such as a typed header
	// restored from TypedHeadersKey, counts with its AMQP encoding, see
	// fieldSize) of a publishing produced by Marshal. When the total
	// is larger, Marshal shortens the longest values among the library's own
	// keys (prefix "rabbitretry-") and watermill's "reason_poisoned" until it
	// fits, ending each shortened value with "…(truncated)"; other headers
	// are never touched, so the total may still exceed the bound if they
	// alone are too large. 0 means 16 KiB; a negative value
	// disables truncation.
	MaxHeaderBytes int

	// Topology names the retry topology (the loop-back exchange, each
	// queue's wait queues) by which Unmarshal recognises a delivery that came
	// back through the library's own retry path (see
	// retrymeta.DeliveryRetryPathKey). nil means the default Naming with any
	// tier: loop-back exchange "rabbitretry.loopback", wait queues
	// "<Q>.wait.<tier>". With a custom Config.Naming, set it to the Retry's
	// Topology (Retry.Topology()); otherwise copies that come back through a
	// renamed loop-back exchange record that exchange and Q as their origin
	// instead of keeping the origin recorded on the first failure. The same
	// holds with Config.DelayerFactory (e.g. the delay cascade): only the
	// Retry's Topology knows how to recognise its copies.
	Topology *Topology
}

var _ wamqp.Marshaler = Marshaler{}

func (m Marshaler) inner() wamqp.Marshaler {
	if m.Inner == nil {
		return wamqp.DefaultMarshaler{}
	}
	return m.Inner
}

// uuidHeaderKey returns the header Inner reads the message UUID from, when
// Inner is a watermill-amqp DefaultMarshaler; otherwise the default key.
func (m Marshaler) uuidHeaderKey() string {
	var key string
	switch d := m.inner().(type) {
	case wamqp.DefaultMarshaler:
		key = d.MessageUUIDHeaderKey
	case *wamqp.DefaultMarshaler:
		if d != nil {
			key = d.MessageUUIDHeaderKey
		}
	}
	if key == "" {
		key = wamqp.DefaultMessageUUIDHeaderKey
	}
	return key
}

// Unmarshal converts an AMQP delivery into a watermill message. It never
// modifies d (in particular not d.Headers). Before calling Inner, it
// replaces every header by a string:
//   - x-death (RabbitMQ "Dead Letter Exchanges") becomes the JSON written by
//     wire.EncodeXDeath under middleware.XDeathKey (see
//     DeathRecordsFromTable);
//   - x-delivery-count (RabbitMQ "Quorum Queues") becomes a decimal string
//     under retrymeta.XDeliveryCountKey (see DeliveryCount);
//   - x-acquired-count (RabbitMQ 4.x quorum queues: every return of the
//     message) becomes a decimal string under retrymeta.XAcquiredCountKey;
//   - every other non-string header, the message UUID header included,
//     becomes its string form (see headerToString for the formats: numbers in
//     decimal, timestamps in RFC 3339 UTC, tables and arrays as JSON).
//
// The typed values of the converted user headers are kept under
// TypedHeadersKey, from which Marshal restores them.
//
// A header that cannot be converted (a malformed x-death or x-delivery-count,
// say a forged one) is dropped, and a description of the problem is stored
// under retrymeta.HeaderErrorKey; it never makes Unmarshal fail. Headers that
// describe one publish or delivery only (PublishIDHeader, and any incoming
// retrymeta.HeaderErrorKey, DeliveryExchangeKey, DeliveryRoutingKeyKey,
// DeliveryRedeliveredKey, DeliveryRetryPathKey or TypedHeadersKey) are
// dropped. The x-first-death-* and x-last-death-* headers are strings and pass
// through as metadata.
//
// After Inner, the metadata gets retrymeta.DeliveryExchangeKey = d.Exchange,
// retrymeta.DeliveryRoutingKeyKey = d.RoutingKey, and the delivery's AMQP
// properties under the Prop*Key keys (restored by Marshal).
//
// Identity: the message UUID is the UUID header (Inner's key, default
// "_watermill_message_uuid"); without one (or with an empty one), the AMQP
// message-id property; with neither, a new random UUID (watermill.NewUUID).
// Every retry and poison copy carries the UUID in the UUID header, so
// attempts 1..n of one message share it and two messages never do. A message
// that comes back without a copy in between (requeued, or dead-lettered by the
// broker after a nack) is a new delivery of the original and gets a new UUID.
//
// Origin and attempts: retrymeta.DeliveryRetryRouteKey is set to "true"
// when the delivery reached its queue through one of the library's retry
// routes, and retrymeta.DeliveryRetryPathKey when, moreover, it is a copy
// the library published for that queue (see retryRoute): only then does
// the attempt counter read its attempt header (and, on a retry route, its
// x-death entries for the queue). On any other delivery the origin keys cannot have been written by the library,
// so a producer's middleware.OriginalQueueKey is removed and
// OriginalExchangeKey / OriginalRoutingKeyKey are set to d.Exchange and
// d.RoutingKey: no copy of the message (retry, poison, redelivery or fallback
// copy) can carry a producer's origin.
//
// It returns an error only if Inner does.
//
// Complexity (gocyclo 24): one case per header the broker or the library
// owns (x-death, x-delivery-count, x-acquired-count, the typed-header key,
// user headers), each with its own tolerance rule; see the list above.
func (m Marshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	if d.Acknowledger == nil && d.DeliveryTag == 0 && d.Headers == nil && d.Body == nil {
		// The zero Delivery that watermill-amqp v2.1.3 can read from a closed
		// deliveries channel: nobody published it. Refusing it makes the
		// subscriber's nack fail and reconnect, instead of handing the handler a
		// phantom message that a failure would republish for real.
		return nil, errEmptyDelivery
	}
	if onlyPlainStringHeaders(d.Headers) {
		// Fast path (the common case: no broker header, nothing to convert):
		// no copy of the headers.
		msg, err := m.inner().Unmarshal(d)
		if err != nil {
			return nil, fmt.Errorf("amqpretry: unmarshaling delivery: %w", err)
		}
		delete(msg.Metadata, confirm.PublishIDHeader)
		return m.finishUnmarshal(msg, d, nil, nil, nil), nil
	}
	var problems []string
	var deaths []amqpwire.DeathRecord
	var typed amqp.Table
	uuidKey := m.uuidHeaderKey()
	headers := make(amqp.Table, len(d.Headers))
	for k, v := range d.Headers {
		switch k {
		case middleware.XDeathKey:
			if v == nil {
				continue
			}
			recs, err := wire.DeathRecordsFromTable(v)
			if err != nil {
				problems = append(problems, middleware.XDeathKey+": "+err.Error())
				continue
			}
			if recs == nil {
				recs = []amqpwire.DeathRecord{}
			}
			deaths = recs
			headers[middleware.XDeathKey] = wire.EncodeXDeath(recs)
		case retrymeta.XDeliveryCountKey:
			n, err := wire.Count(retrymeta.XDeliveryCountKey, v)
			if err != nil {
				problems = append(problems, err.Error())
				continue
			}
			headers[retrymeta.XDeliveryCountKey] = strconv.FormatInt(n, 10)
		case retrymeta.XAcquiredCountKey:
			n, err := acquiredCount(v)
			if err != nil {
				problems = append(problems, err.Error())
				continue
			}
			headers[retrymeta.XAcquiredCountKey] = strconv.FormatInt(n, 10)
		default:
			if droppedOnUnmarshal(k) {
				continue
			}
			s, err := wire.HeaderString(v)
			if err != nil {
				problems = append(problems, fmt.Sprintf("header %q: %v", truncateForError(k), err))
				continue
			}
			headers[k] = s
			if _, isString := v.(string); !isString && len(k) <= 255 && keepsType(k, uuidKey) && wire.Encodable(v) {
				if typed == nil {
					typed = amqp.Table{}
				}
				typed[k] = v
			}
		}
	}

	sd := d // a shallow copy: d.Headers itself is not modified
	sd.Headers = headers
	msg, err := m.inner().Unmarshal(sd)
	if err != nil {
		return nil, fmt.Errorf("amqpretry: unmarshaling delivery: %w", err)
	}
	return m.finishUnmarshal(msg, d, problems, deaths, typed), nil
}

// keepsType reports whether the header k is a user header whose AMQP type
// Unmarshal records and Marshal restores (see TypedHeadersKey): not a broker
// header, not one of the keys the library and Watermill write as strings
// (middleware.IsRetryState, prefix "rabbitretry-", the UUID header).
func keepsType(k, uuidKey string) bool {
	return k != uuidKey && !middleware.IsRetryState(k) && !strings.HasPrefix(k, "rabbitretry-")
}

// onlyPlainStringHeaders reports whether every header is a string and none
// needs conversion or removal other than PublishIDHeader.
func onlyPlainStringHeaders(h amqp.Table) bool {
	for k, v := range h {
		if _, ok := v.(string); !ok {
			return false
		}
		switch k {
		case middleware.XDeathKey, retrymeta.XDeliveryCountKey, retrymeta.XAcquiredCountKey:
			return false
		case confirm.PublishIDHeader:
		default:
			if droppedOnUnmarshal(k) {
				return false
			}
		}
	}
	return true
}

// finishUnmarshal sets the identity, adds the delivery metadata, the origin
// keys, the typed headers and the header problems. deaths are the delivery's
// x-death records (nil if none or malformed).
func (m Marshaler) finishUnmarshal(msg *message.Message, d amqp.Delivery, problems []string, deaths []amqpwire.DeathRecord, typed amqp.Table) *message.Message {
	if msg.UUID == "" {
		msg.UUID = d.MessageId
	}
	if msg.UUID == "" {
		// Neither a UUID header nor a message-id: without an identity of its
		// own, two such messages could not be told apart in the poison tools.
		msg.UUID = watermill.NewUUID()
	}
	if msg.Metadata == nil {
		msg.Metadata = make(message.Metadata)
	}
	msg.Metadata.Set(retrymeta.DeliveryExchangeKey, d.Exchange)
	msg.Metadata.Set(retrymeta.DeliveryRoutingKeyKey, d.RoutingKey)
	if d.Redelivered {
		msg.Metadata.Set(retrymeta.DeliveryRedeliveredKey, "true")
	}
	route, copyOf := m.retryRoute(&d, deaths)
	if route {
		msg.Metadata.Set(retrymeta.DeliveryRetryRouteKey, "true")
	}
	if copyOf {
		msg.Metadata.Set(retrymeta.DeliveryRetryPathKey, "true")
	} else {
		// Whatever origin keys this message carries, the library did not
		// write them: replace them by the delivery's, so that no copy of it
		// (retry, poison, redelivery or fallback) carries a producer's.
		delete(msg.Metadata, middleware.OriginalQueueKey)
		msg.Metadata.Set(middleware.OriginalExchangeKey, d.Exchange)
		msg.Metadata.Set(middleware.OriginalRoutingKeyKey, d.RoutingKey)
	}
	if len(typed) > 0 {
		enc, err := wire.EncodeHeaderTable(typed)
		if err != nil { // wireTyped accepted every value: cannot happen
			problems = append(problems, "header types not kept: "+err.Error())
		} else {
			msg.Metadata.Set(retrymeta.TypedHeadersKey, enc)
		}
	}
	wire.PropertiesToMetadata(&d, msg.Metadata)
	if len(problems) > 0 {
		sort.Strings(problems) // map order is random; keep the text stable
		msg.Metadata.Set(retrymeta.HeaderErrorKey, strings.Join(problems, "; "))
	}
	return msg
}

// isBrokerOwnedOrDeliveryOnly reports whether a header must not travel on a
// publishing: the broker's dead-lettering and delivery-count headers and the
// metadata that describes one delivery (retrymeta.IsDeliveryOnly), and
// those of one publish (publishOnly).
func isBrokerOwnedOrDeliveryOnly(k string) bool {
	return retrymeta.IsDeliveryOnly(k) || publishOnly(k)
}

// publishOnly reports whether k belongs to one publish or one Unmarshal of
// this package: PublishIDHeader (confirm.Publisher's) and TypedHeadersKey.
func publishOnly(k string) bool {
	return k == confirm.PublishIDHeader || k == retrymeta.TypedHeadersKey
}

// droppedOnUnmarshal reports whether Unmarshal drops an incoming header k
// that it does not convert (x-death, x-delivery-count and x-acquired-count
// are converted): the delivery-only and publish-only keys, whose values can
// only come from an earlier publish or a producer, except the broker's
// x-first-death-* and x-last-death-* strings, which pass through.
func droppedOnUnmarshal(k string) bool {
	if strings.HasPrefix(k, retrymeta.XFirstDeathPrefix) || strings.HasPrefix(k, retrymeta.XLastDeathPrefix) {
		return false
	}
	return isBrokerOwnedOrDeliveryOnly(k)
}

// Marshal converts a watermill message into an AMQP publishing with Inner,
// then deletes from the publishing's headers (msg itself is not modified):
//   - x-death, every x-first-death-* and x-last-death-* header,
//     x-delivery-count and x-acquired-count: they belong to the broker and describe the consumed
//     delivery, not the copy. On RabbitMQ 3.13 a republished copy that still
//     carries x-death can be dropped by dead-letter cycle detection; RabbitMQ
//     4.x ignores a client-set x-death; and the string x-death that Unmarshal
//     produces could confuse a broker that does read it ("Dead Letter
//     Exchanges");
//   - retrymeta.DeliveryExchangeKey, retrymeta.DeliveryRoutingKeyKey,
//     retrymeta.DeliveryRedeliveredKey, retrymeta.DeliveryRetryPathKey,
//     retrymeta.HeaderErrorKey and PublishIDHeader, which describe one
//     delivery or one publish, and TypedHeadersKey.
//
// The headers recorded under TypedHeadersKey go out with their AMQP type
// (the same Go value amqp091-go decoded on the delivery), provided the
// metadata still holds the string Unmarshal gave the handler: a value the
// handler changed goes out as the handler's string, a key it deleted not at
// all. An unreadable TypedHeadersKey is ignored (every header goes out as a
// string).
//
// The AMQP properties recorded by Unmarshal (content-type, correlation-id,
// message-id, priority, timestamp, delivery mode, ...; see PropContentTypeKey
// and PropDeliveryModeKey) are restored as properties, not headers, so a
// retry or poison copy keeps them.
//
// Finally it truncates long library headers to MaxHeaderBytes (see
// Marshaler.MaxHeaderBytes). It returns an error only if Inner does.
func (m Marshaler) Marshal(msg *message.Message) (amqp.Publishing, error) {
	p, err := m.inner().Marshal(msg)
	if err != nil {
		return amqp.Publishing{}, fmt.Errorf("amqpretry: marshaling message: %w", err)
	}
	if p.Headers == nil {
		return p, nil
	}
	h := maps.Clone(p.Headers) // Inner may have returned a table it still holds
	for k := range h {
		if isBrokerOwnedOrDeliveryOnly(k) {
			delete(h, k)
		}
	}
	p.Headers = h
	m.restoreTypedHeaders(msg.Metadata, h)
	wire.MetadataToProperties(msg.Metadata, &p)
	maxBytes := m.MaxHeaderBytes
	if maxBytes == 0 {
		maxBytes = defaultMaxHeaderBytes
	}
	if maxBytes > 0 {
		truncateHeaders(h, maxBytes)
	}
	p.Headers = h
	return p, nil
}

// restoreTypedHeaders replaces, in h, the string headers recorded with their
// AMQP type under TypedHeadersKey in md by their typed values, where h[k]
// still is the string Unmarshal produced for it (the handler did not change
// it) and is md[k] (Inner wrote the metadata value).
func (m Marshaler) restoreTypedHeaders(md message.Metadata, h amqp.Table) {
	enc := md[retrymeta.TypedHeadersKey]
	if enc == "" {
		return
	}
	typed, err := wire.DecodeHeaderTable(enc)
	if err != nil {
		return
	}
	uuidKey := m.uuidHeaderKey()
	for k, v := range typed {
		cur, ok := h[k].(string)
		if !ok || cur != md[k] || !keepsType(k, uuidKey) || isBrokerOwnedOrDeliveryOnly(k) {
			continue
		}
		if s, err := wire.HeaderString(v); err == nil && s == cur {
			h[k] = v
		}
	}
}

// truncatable reports whether truncateHeaders may shorten the header k.
func truncatable(k string) bool {
	return strings.HasPrefix(k, "rabbitretry-") || k == poisonReasonKey
}

// truncateHeaders shortens string header values in h, in place, so that the
// total size of the headers (len(key)+len(value) summed, a non-string value
// counting as fieldSize(value)) is at most maxTotal. Only values of keys with
// prefix "rabbitretry-" and of "reason_poisoned" are shortened, longest
// first: it finds the largest length L such that cutting every such value
// longer than L+len(truncatedSuffix) to its first L bytes (at a UTF-8
// boundary) plus truncatedSuffix fits. If even L = 0 does not fit, every
// candidate is cut that far and the total stays above maxTotal. A
// maxTotal <= 0 disables truncation.
func truncateHeaders(h amqp.Table, maxTotal int) {
	if maxTotal <= 0 {
		return
	}
	total := 0
	var cand []string
	longest := 0
	for k, v := range h {
		s, ok := v.(string)
		if !ok {
			total += len(k) + wire.FieldSize(v)
			continue
		}
		total += len(k) + len(s)
		if truncatable(k) && len(s) > len(truncatedSuffix) {
			cand = append(cand, k)
			longest = max(longest, len(s))
		}
	}
	if total <= maxTotal || len(cand) == 0 {
		return
	}
	ms := len(truncatedSuffix)
	// sizeAt is the total after cutting candidates to level l; it is
	// non-decreasing in l.
	sizeAt := func(l int) int {
		t := total
		for _, k := range cand {
			n := len(h[k].(string))
			if n > l+ms {
				t -= n - (l + ms)
			}
		}
		return t
	}
	lo, hi := 0, longest // find the largest l in [0, longest] with sizeAt(l) <= maxTotal
	if sizeAt(0) > maxTotal {
		hi = 0
	}
	for lo < hi {
		mid := lo + (hi-lo+1)/2
		if sizeAt(mid) <= maxTotal {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	for _, k := range cand {
		s := h[k].(string)
		if len(s) > lo+ms {
			h[k] = cutUTF8(s, lo) + truncatedSuffix
		}
	}
}

// cutUTF8 returns the longest prefix of s of at most n bytes that does not
// split a UTF-8 encoded rune.
func cutUTF8(s string, n int) string {
	if n >= len(s) {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// truncateForError keeps error texts short when they quote a header value.
func truncateForError(s string) string {
	const max = 64
	if len(s) <= max {
		return s
	}
	return s[:max] + "..."
}
