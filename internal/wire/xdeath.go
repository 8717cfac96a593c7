package wire

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// DeathRecord is one entry of RabbitMQ's x-death header ("Dead Letter
// Exchanges"): the broker appends or updates one entry per {queue, reason}
// each time a message is dead-lettered (reason "rejected", "expired",
// "maxlen" or "delivery_limit"); the most recent entry comes first.
//
// The amqpretry Marshaler converts the AMQP table into a JSON array of
// DeathRecord under the metadata key XDeathKey, so that broker-agnostic
// middlewares can read it.
type DeathRecord struct {
	Queue       string    `json:"queue"`
	Reason      string    `json:"reason"`
	Count       int64     `json:"count"`
	Exchange    string    `json:"exchange,omitempty"`
	RoutingKeys []string  `json:"routing-keys,omitempty"`
	Time        time.Time `json:"time,omitzero"`
}

// MaxDeathRecords bounds how many x-death entries ParseXDeath accepts (a
// forged header cannot make the consumer parse an unbounded array). RabbitMQ
// itself keeps one entry per {queue, reason}.
const MaxDeathRecords = 256

// ParseXDeath decodes the JSON written by the amqpretry Marshaler under
// XDeathKey. An empty string yields no records and no error. It returns an
// error for malformed JSON or for more than MaxDeathRecords entries; it does
// not validate counts (see DeathCount).
func ParseXDeath(s string) ([]DeathRecord, error) {
	if s == "" {
		return nil, nil
	}
	var recs []DeathRecord
	if err := json.Unmarshal([]byte(s), &recs); err != nil {
		return nil, fmt.Errorf("x-death metadata is not a JSON array of death records: %w", err)
	}
	if len(recs) > MaxDeathRecords {
		return nil, fmt.Errorf("x-death metadata has %d records, more than the %d accepted", len(recs), MaxDeathRecords)
	}
	return recs, nil
}

// EncodeXDeath is the inverse of ParseXDeath.
func EncodeXDeath(recs []DeathRecord) string {
	b, err := json.Marshal(recs)
	if err != nil { // cannot happen for this type
		return "[]"
	}
	return string(b)
}

// DeathRecordsFromTable converts the value of RabbitMQ's x-death header, as
// github.com/rabbitmq/amqp091-go decodes it, into death records (RabbitMQ
// "Dead Letter Exchanges": one entry per {queue, reason}, most recent first,
// each a table with queue, reason, count, time, exchange, routing-keys and
// possibly original-expiration, which is ignored).
//
// The conversion is tolerant of the shapes a client library or a test may
// produce:
//   - the header may be []interface{} (what amqp091-go decodes), []amqp.Table
//     or []map[string]interface{}; nil yields no records and no error;
//   - an entry may be amqp.Table or map[string]interface{};
//   - count may be any Go integer type, a float without fraction, or a
//     decimal string ([]byte too); an entry without count counts as 1;
//   - routing-keys may be []interface{} of strings or []string;
//   - time may be time.Time (amqp091-go's decoding of an AMQP timestamp) or an
//     RFC 3339 string; it is returned in UTC. A missing time is the zero time;
//     a year outside 0-9999 is an error ("time out of range").
//
// It returns an error, naming the entry (0-based) and the problem, when the
// header is not an array, when it has more than MaxDeathRecords
// entries, when an entry is not a table, has no non-empty string queue, has a
// reason, exchange or routing key that is not a string, or has a count that
// is not a number, is negative or exceeds math.MaxInt32 ("count out of
// range"). A forged header therefore cannot inject an absurd count.
func DeathRecordsFromTable(v interface{}) ([]DeathRecord, error) {
	var entries []interface{}
	switch a := v.(type) {
	case nil:
		return nil, nil
	case []interface{}:
		entries = a
	case []amqp.Table:
		entries = make([]interface{}, len(a))
		for i := range a {
			entries[i] = a[i]
		}
	case []map[string]interface{}:
		entries = make([]interface{}, len(a))
		for i := range a {
			entries[i] = a[i]
		}
	default:
		return nil, fmt.Errorf("x-death header is %s, not an array of tables", typeName(v))
	}
	if len(entries) > MaxDeathRecords {
		return nil, fmt.Errorf("x-death header has %d entries, more than the %d accepted", len(entries), MaxDeathRecords)
	}
	recs := make([]DeathRecord, 0, len(entries))
	for i, e := range entries {
		var t map[string]interface{}
		switch tt := e.(type) {
		case amqp.Table:
			t = tt
		case map[string]interface{}:
			t = tt
		default:
			return nil, fmt.Errorf("x-death entry %d is %s, not a table", i, typeName(e))
		}
		rec, err := deathRecordFromEntry(t)
		if err != nil {
			return nil, fmt.Errorf("x-death entry %d: %w", i, err)
		}
		recs = append(recs, rec)
	}
	return recs, nil
}

// deathRecordFromEntry converts one x-death entry (see DeathRecordsFromTable).
// Complexity (gocyclo 30): one check per x-death field and per accepted Go
// shape of it, each with its own error; split, the checks would only move.
func deathRecordFromEntry(t map[string]interface{}) (DeathRecord, error) {
	var rec DeathRecord
	q, ok := t["queue"]
	if !ok || q == nil {
		return rec, errors.New("missing queue")
	}
	qs, ok := stringField(q)
	if !ok {
		return rec, fmt.Errorf("queue is %s, not a string", typeName(q))
	}
	if qs == "" {
		return rec, errors.New("queue is empty")
	}
	rec.Queue = qs

	if r, ok := t["reason"]; ok && r != nil {
		rs, ok := stringField(r)
		if !ok {
			return rec, fmt.Errorf("reason is %s, not a string", typeName(r))
		}
		rec.Reason = rs
	}
	if x, ok := t["exchange"]; ok && x != nil {
		xs, ok := stringField(x)
		if !ok {
			return rec, fmt.Errorf("exchange is %s, not a string", typeName(x))
		}
		rec.Exchange = xs
	}

	rec.Count = 1
	if c, ok := t["count"]; ok && c != nil {
		n, err := toInt64(c)
		if err != nil {
			return rec, fmt.Errorf("count: %w", err)
		}
		if n < 0 {
			return rec, fmt.Errorf("count %d is negative", n)
		}
		if n > math.MaxInt32 {
			return rec, fmt.Errorf("count out of range: %d exceeds %d", n, math.MaxInt32)
		}
		rec.Count = n
	}

	if rk, ok := t["routing-keys"]; ok && rk != nil {
		switch keys := rk.(type) {
		case []string:
			if len(keys) > 0 {
				rec.RoutingKeys = append([]string(nil), keys...)
			}
		case []interface{}:
			for j, k := range keys {
				ks, ok := stringField(k)
				if !ok {
					return rec, fmt.Errorf("routing key %d is %s, not a string", j, typeName(k))
				}
				rec.RoutingKeys = append(rec.RoutingKeys, ks)
			}
		default:
			return rec, fmt.Errorf("routing-keys is %s, not an array of strings", typeName(rk))
		}
	}

	if tv, ok := t["time"]; ok && tv != nil {
		switch tm := tv.(type) {
		case time.Time:
			rec.Time = tm.UTC()
		case string:
			p, err := time.Parse(time.RFC3339Nano, tm)
			if err != nil {
				return rec, fmt.Errorf("time %q is not an RFC 3339 time", tm)
			}
			rec.Time = p.UTC()
		default:
			return rec, fmt.Errorf("time is %s, not a timestamp", typeName(tv))
		}
		// EncodeXDeath writes JSON, which holds years 0-9999 only.
		if y := rec.Time.Year(); y < 0 || y > 9999 {
			return rec, fmt.Errorf("time out of range: year %d", y)
		}
	}
	return rec, nil
}
