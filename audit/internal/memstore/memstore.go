// Package memstore is the in-memory audit.Store behind
// audittest.MemoryStore, with the fault injection and inspection the
// audit packages' own tests need (an outage, records rejected for good,
// counts of rewrites and writes). Writes are idempotent on the record IDs,
// like pgstore's, and rewrites are counted, so a test can tell a
// redelivered record (harmless) from a record written twice under two IDs
// (a duplicate).
package memstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/internal/deliverylog"
)

// ErrDown is returned by Write and Search while the store is Down.
var ErrDown = errors.New("audittest: store down")

// Store is an in-memory audit.Store with a delivery log (offered to the
// audit.Consumer, see package audit/internal/deliverylog) and
// audit.SetAsider. Safe for concurrent use.
type Store struct {
	logOffer
	mu       sync.Mutex
	down     bool
	arrivals map[string]audit.Arrival
	attempts map[string]audit.Attempt
	rewrites int // records written again under an ID already stored
	writes   int // successful Write calls
	failed   int // Write calls refused while down
	reject   func(messageID string) bool
	aside    map[string]audit.SetAside
	unacked  map[string]deliverylog.Delivery
}

var _ audit.SetAsider = (*Store)(nil)

// deliveryLog is the Store's delivery log.
type deliveryLog Store

// logOffer offers the Store's deliveryLog to the audit.Consumer.
type logOffer = deliverylog.Offer[audit.Arrival, audit.Attempt]

// New returns an empty, up store.
func New() *Store {
	s := &Store{arrivals: map[string]audit.Arrival{}, attempts: map[string]audit.Attempt{}, unacked: map[string]deliverylog.Delivery{}}
	s.logOffer = deliverylog.NewOffer(s.DeliveryLog())
	return s
}

// SetDown makes Write and Search fail with ErrDown (true) or work again.
func (s *Store) SetDown(down bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.down = down
}

// Write stores the records all or nothing; a record whose ID is stored
// already is counted in Rewrites and changes nothing.
func (s *Store) Write(ctx context.Context, arrivals []audit.Arrival, attempts []audit.Attempt) error {
	return (*deliveryLog)(s).WriteDeliveries(ctx, arrivals, attempts, nil)
}

// DeliveryLog returns the store's delivery log, kept in memory with the
// records.
func (s *Store) DeliveryLog() deliverylog.Log[audit.Arrival, audit.Attempt] {
	return (*deliveryLog)(s)
}

// WriteDeliveries is Write, and records the deliveries (deliverylog.Log)
// with it, all or nothing.
func (s *deliveryLog) WriteDeliveries(ctx context.Context, arrivals []audit.Arrival, attempts []audit.Attempt, deliveries []deliverylog.Delivery) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		s.failed++
		return ErrDown
	}
	if s.reject != nil {
		for _, a := range arrivals {
			if s.reject(a.MessageID) {
				return fmt.Errorf("audittest: arrival of message %q: %w", a.MessageID, audit.ErrRecordRejected)
			}
		}
		for _, a := range attempts {
			if s.reject(a.MessageID) {
				return fmt.Errorf("audittest: attempt of message %q: %w", a.MessageID, audit.ErrRecordRejected)
			}
		}
	}
	s.writes++
	for _, a := range arrivals {
		if _, ok := s.arrivals[a.ID]; ok {
			s.rewrites++
			continue
		}
		a.Body = slices.Clone(a.Body)
		s.arrivals[a.ID] = a
	}
	for _, a := range attempts {
		if _, ok := s.attempts[a.ID]; ok {
			s.rewrites++
			continue
		}
		s.attempts[a.ID] = a
	}
	for _, d := range deliveries {
		d.Acking = false
		s.unacked[d.ArrivalID] = d
	}
	return nil
}

// UnackedDeliveries returns the recorded deliveries of these fingerprints,
// in arrival ID order (deliverylog.Log).
func (s *deliveryLog) UnackedDeliveries(ctx context.Context, fingerprints []string) ([]deliverylog.Delivery, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return nil, ErrDown
	}
	var out []deliverylog.Delivery
	for _, d := range s.unacked {
		if slices.Contains(fingerprints, d.Fingerprint) {
			out = append(out, d)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ArrivalID < out[j].ArrivalID })
	return out, nil
}

// ClaimDelivery moves a recorded delivery from session from to session to,
// unless it is Acking (deliverylog.Log).
func (s *deliveryLog) ClaimDelivery(ctx context.Context, arrivalID, from, to string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return false, ErrDown
	}
	d, ok := s.unacked[arrivalID]
	if !ok || d.Session != from || d.Acking {
		return false, nil
	}
	d.Session = to
	s.unacked[arrivalID] = d
	return true, nil
}

// TakeAckingDelivery forgets a recorded delivery of session if it is
// Acking (deliverylog.Log).
func (s *deliveryLog) TakeAckingDelivery(ctx context.Context, arrivalID, session string) (bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return false, ErrDown
	}
	d, ok := s.unacked[arrivalID]
	if !ok || d.Session != session || !d.Acking {
		return false, nil
	}
	delete(s.unacked, arrivalID)
	return true, nil
}

// DeliveriesAcking forgets session's Acking deliveries, then marks
// session's deliveries of these arrival IDs Acking (deliverylog.Log).
func (s *deliveryLog) DeliveriesAcking(ctx context.Context, session string, arrivalIDs []string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return ErrDown
	}
	for id, d := range s.unacked {
		if d.Session == session && d.Acking {
			delete(s.unacked, id)
		}
	}
	s.markLocked(session, arrivalIDs, true)
	return nil
}

// DeliveriesNotAcked clears Acking on session's deliveries of these
// arrival IDs (deliverylog.Log).
func (s *deliveryLog) DeliveriesNotAcked(ctx context.Context, session string, arrivalIDs []string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return ErrDown
	}
	s.markLocked(session, arrivalIDs, false)
	return nil
}

func (s *deliveryLog) markLocked(session string, arrivalIDs []string, acking bool) {
	for _, id := range arrivalIDs {
		if d, ok := s.unacked[id]; ok && d.Session == session {
			d.Acking = acking
			s.unacked[id] = d
		}
	}
}

// Unacked returns how many deliveries are recorded (deliverylog.Log):
// unacked, not yet Acking; and acking, marked Acking (their ack sent or
// about to be).
func (s *Store) Unacked() (unacked, acking int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, d := range s.unacked {
		if d.Acking {
			acking++
		} else {
			unacked++
		}
	}
	return unacked, acking
}

// Search supports Filter.MessageID only (and no filter: every message);
// messages come in message-id order, attempts by attempt number then
// start time.
func (s *Store) Search(ctx context.Context, f audit.Filter) ([]audit.Message, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return nil, ErrDown
	}
	byID := s.messagesLocked()
	var out []audit.Message
	for id, m := range byID {
		if f.MessageID == "" || f.MessageID == id {
			out = append(out, *m)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].MessageID < out[j].MessageID })
	return out, nil
}

func (s *Store) messagesLocked() map[string]*audit.Message {
	byID := map[string]*audit.Message{}
	get := func(id string) *audit.Message {
		m := byID[id]
		if m == nil {
			m = &audit.Message{MessageID: id}
			byID[id] = m
		}
		return m
	}
	for _, a := range s.arrivals {
		m := get(a.MessageID)
		a := a
		m.Arrival = &a
	}
	for _, a := range s.attempts {
		m := get(a.MessageID)
		m.Attempts = append(m.Attempts, a)
	}
	for _, m := range byID {
		sort.Slice(m.Attempts, func(i, j int) bool {
			if m.Attempts[i].Attempt != m.Attempts[j].Attempt {
				return m.Attempts[i].Attempt < m.Attempts[j].Attempt
			}
			return m.Attempts[i].StartedAt.Before(m.Attempts[j].StartedAt)
		})
	}
	return byID
}

// Arrivals returns the stored arrivals per message id (a message with
// more than one arrival record has more than one entry).
func (s *Store) Arrivals() map[string][]audit.Arrival {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string][]audit.Arrival{}
	for _, a := range s.arrivals {
		out[a.MessageID] = append(out[a.MessageID], a)
	}
	return out
}

// Attempts returns the stored attempts per message id, ordered like Search.
func (s *Store) Attempts() map[string][]audit.Attempt {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string][]audit.Attempt{}
	for id, m := range s.messagesLocked() {
		if len(m.Attempts) > 0 {
			out[id] = m.Attempts
		}
	}
	return out
}

// SetReject makes Write reject for good (audit.ErrRecordRejected), all or
// nothing, a batch holding a record whose message id f accepts; nil
// accepts every record again.
func (s *Store) SetReject(f func(messageID string) bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reject = f
}

// SetAside keeps the records (idempotent on kind and record ID); it fails
// with ErrDown while the store is down.
func (s *Store) SetAside(ctx context.Context, records []audit.SetAside) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return ErrDown
	}
	if s.aside == nil {
		s.aside = map[string]audit.SetAside{}
	}
	for _, r := range records {
		s.aside[r.Kind+":"+r.RecordID] = r
	}
	return nil
}

// SetAsideRecords returns the records set aside, in no order.
func (s *Store) SetAsideRecords() []audit.SetAside {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]audit.SetAside, 0, len(s.aside))
	for _, r := range s.aside {
		out = append(out, r)
	}
	return out
}

// Counts returns the numbers of stored arrivals and attempts, rewrites
// (idempotent re-writes), successful Write calls and refused ones.
func (s *Store) Counts() (arrivals, attempts, rewrites, writes, failed int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.arrivals), len(s.attempts), s.rewrites, s.writes, s.failed
}
