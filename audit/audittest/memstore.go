// Package audittest provides an in-memory audit.Store for tests: writes
// are idempotent on the record IDs, like pgstore's, it keeps the records
// it is asked to set aside (audit.SetAsider), and it has a DeliveryLog
// (audit.DeliveryLog), so an audit.Consumer or audit.Resender runs on it
// as on pgstore.
package audittest

import (
	"context"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/internal/memstore"
)

// MemoryStore is an in-memory audit.Store. Safe for concurrent use.
type MemoryStore struct {
	s *memstore.Store
}

var _ audit.SetAsider = (*MemoryStore)(nil)

// NewMemoryStore returns an empty store.
func NewMemoryStore() *MemoryStore {
	return &MemoryStore{s: memstore.New()}
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

// DeliveryLog returns the store's audit.DeliveryLog, kept in memory with
// the records.
func (m *MemoryStore) DeliveryLog() audit.DeliveryLog { return m.s.DeliveryLog() }
