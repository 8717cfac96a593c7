package audit

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/wire"
)

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "…"
}

// deliveryOnlyHeaders describe the audit queue's delivery, not the publish:
// left out of Arrival.Headers and of its ID (a redelivery must map to the
// same record).
var deliveryOnlyHeaders = map[string]bool{retrymeta.XDeliveryCountKey: true, retrymeta.XAcquiredCountKey: true}

// errUntrusted is logged for an attempt record whose user-id is not one
// of ConsumerConfig.RecorderUsers.
var errUntrusted = errors.New("audit: attempt record's user-id is absent or not one of ConsumerConfig.RecorderUsers")

// trusted reports whether an attempt record published with this
// (broker-validated) user-id is stored.
func (c *Consumer) trusted(userID string) bool {
	if userID == "" {
		return c.cfg.AcceptRecordsWithoutUserID
	}
	for _, u := range c.cfg.RecorderUsers {
		if u == userID {
			return true
		}
	}
	return false
}

// arrival converts a delivery of the arrivals queue and gives it its
// per-publish ID (publishIDs).
func (c *Consumer) arrival(d amqp.Delivery) Arrival {
	a := arrivalFromDelivery(d, c.cfg.UUIDHeader, c.cfg.BodyLimit, time.Now())
	if c.log != nil {
		a.ID = newArrivalID(a.contentID) // a redelivery's is resolved before its write (claimRedelivered)
	} else {
		c.ids.assign(&a, d.Redelivered)
	}
	return a
}

// timestampErrorProperty is the Arrival.Properties key noting an AMQP
// timestamp outside years 1-9999 (its value in seconds); PublishedAt is
// then zero (stored as absent), never a wrong date.
const timestampErrorProperty = "rabbitretry-timestamp-error"

// arrivalFromDelivery converts a delivery of the arrivals queue into an
// Arrival, arrived at now: the message id is the uuidHeader header (else
// the message-id property); PublishedAt the timestamp property, unless it
// is outside years 1-9999 (then zero, and timestampErrorProperty says
// why); headers become JSON values
// (wire.HeadersToJSON; a header that cannot be converted is recorded
// under retrymeta.HeaderErrorKey, "rabbitretry-header-error"), without the queue's x-delivery-count
// and x-acquired-count; HeaderTable keeps them with their AMQP types; the
// body is cut to bodyLimit bytes. contentID (and ID) is the hex SHA-256
// over exchange, routing key, message id, timestamp, headers (canonical
// JSON: keys sorted) and the whole body: the same for a redelivery and for
// an identical publish; the Consumer replaces ID with a per-publish one.
func arrivalFromDelivery(d amqp.Delivery, uuidHeader string, bodyLimit int, now time.Time) Arrival {
	a := Arrival{
		CorrelationID: d.CorrelationId, Exchange: d.Exchange, RoutingKey: d.RoutingKey,
		ArrivedAt: now.UTC(), BodySize: len(d.Body),
	}
	if s, ok := d.Headers[uuidHeader].(string); ok && s != "" {
		a.MessageID = s
	} else {
		a.MessageID = d.MessageId
	}
	var tsNote string
	if !d.Timestamp.IsZero() {
		if y := d.Timestamp.Year(); y >= 1 && y <= 9999 {
			a.PublishedAt = d.Timestamp.UTC()
		} else {
			// An AMQP timestamp is any 64-bit count of seconds; only years
			// 1-9999 are a date a store, JSON and RFC 3339 keep exactly.
			tsNote = fmt.Sprintf("AMQP timestamp %d s is outside years 1-9999; published_at left empty", d.Timestamp.Unix())
		}
	}
	var hdrs amqp.Table
	if len(d.Headers) > 0 {
		hdrs = make(amqp.Table, len(d.Headers))
		for k, v := range d.Headers {
			if !deliveryOnlyHeaders[k] {
				hdrs[k] = v
			}
		}
	}
	h, err := wire.HeadersToJSON(hdrs)
	if err != nil {
		h = map[string]any{retrymeta.HeaderErrorKey: err.Error()}
	}
	if len(h) > 0 {
		a.Headers, a.HeaderTable = h, hdrs
	}
	props := map[string]string{}
	set := func(k, v string) {
		if v != "" {
			props[k] = v
		}
	}
	set("content-type", d.ContentType)
	set("content-encoding", d.ContentEncoding)
	if d.DeliveryMode != 0 {
		set("delivery-mode", strconv.Itoa(int(d.DeliveryMode)))
	}
	if d.Priority != 0 {
		set("priority", strconv.Itoa(int(d.Priority)))
	}
	set("reply-to", d.ReplyTo)
	set("expiration", d.Expiration)
	set("type", d.Type)
	set("user-id", d.UserId)
	set("app-id", d.AppId)
	set(timestampErrorProperty, tsNote)
	if len(props) > 0 {
		a.Properties = props
	}
	a.Body = d.Body
	if bodyLimit < 0 {
		bodyLimit = 0
	}
	if len(a.Body) > bodyLimit {
		a.Body, a.BodyTruncated = bytes.Clone(a.Body[:bodyLimit]), true
	}
	if a.Body == nil {
		a.Body = []byte{}
	}
	hh, _ := json.Marshal(a.Headers) // maps marshal with sorted keys
	sum := sha256.New()
	var ts [8]byte
	binary.BigEndian.PutUint64(ts[:], uint64(d.Timestamp.Unix()))
	for _, f := range [][]byte{[]byte(d.Exchange), []byte(d.RoutingKey), []byte(a.MessageID), ts[:], hh, d.Body} {
		var n [8]byte
		binary.BigEndian.PutUint64(n[:], uint64(len(f)))
		sum.Write(n[:])
		sum.Write(f)
	}
	a.ID = hex.EncodeToString(sum.Sum(nil))
	a.contentID = a.ID
	return a
}
