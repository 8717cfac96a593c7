package middleware

import (
	"encoding/json"
	"fmt"
	"time"
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
