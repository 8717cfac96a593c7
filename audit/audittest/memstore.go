// Package audittest provides an in-memory audit.Store for tests: writes
// are idempotent on the record IDs, like pgstore's, it keeps the records
// it is asked to set aside (audit.SetAsider), and it keeps a delivery log
// as pgstore does (an arrival redelivered after a Consumer died between
// commit and ack is stored once: see audit.Arrival.ID), so an
// audit.Consumer or audit.Resender runs on it as on pgstore.
package audittest

import (
	"context"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/internal/deliverylog"
	"github.com/rabbitretry/rabbitretry/audit/internal/memstore"
)

// MemoryStore is an in-memory audit.Store. Safe for concurrent use.
type MemoryStore struct {
	logOffer
	s *memstore.Store
}

// logOffer offers the store's delivery log to the audit.Consumer.
type logOffer = deliverylog.Offer[audit.Arrival, audit.Attempt]

var _ audit.SetAsider = (*MemoryStore)(nil)

// NewMemoryStore returns an empty store.
func NewMemoryStore() *MemoryStore {
	s := memstore.New()
	return &MemoryStore{logOffer: deliverylog.NewOffer(s.DeliveryLog()), s: s}
}

// Write stores the records all or nothing; a record whose ID is stored
// already changes nothing.
func (m *MemoryStore) Write(ctx context.Context, arrivals []audit.Arrival, attempts []audit.Attempt) error {
	return m.s.Write(ctx, arrivals, attempts)
}

// Search supports Filter.MessageID only (and no filter: every message);
// messages come in message-id order, attempts by attempt number then
// start time.
func (m *MemoryStore) Search(ctx context.Context, f audit.Filter) ([]audit.Message, error) {
	return m.s.Search(ctx, f)
}

// SetAside keeps the records (idempotent on kind and record ID).
func (m *MemoryStore) SetAside(ctx context.Context, records []audit.SetAside) error {
	return m.s.SetAside(ctx, records)
}
