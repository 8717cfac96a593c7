package audit_test

import (
	"testing"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/audittest"
	"github.com/rabbitretry/rabbitretry/audit/internal/deliverylog"
	"github.com/rabbitretry/rabbitretry/audit/internal/memstore"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
)

// storeLog is a Store and its delivery log in one value: what the tests
// wrap to intercept both. A wrapper embedding it offers itself as the
// delivery log by embedding a selfOffer set with offerOf.
type storeLog interface {
	audit.Store
	deliveryLog
}

type (
	deliveryLog     = deliverylog.Log[audit.Arrival, audit.Attempt]
	unackedDelivery = deliverylog.Delivery
	// selfOffer, embedded in a test Store, offers the Consumer a delivery
	// log (offerOf).
	selfOffer = deliverylog.Offer[audit.Arrival, audit.Attempt]
)

// offerOf returns the offer of l.
func offerOf(l deliveryLog) selfOffer { return deliverylog.NewOffer(l) }

// logOf returns the delivery log s offers to the Consumer, nil if none.
func logOf(s audit.Store) deliveryLog { return deliverylog.Of[audit.Arrival, audit.Attempt](s) }

// joined is a Store joined with its delivery log.
type joined struct {
	audit.Store
	deliveryLog
}

// joinLog joins s with the delivery log it offers; it panics if s offers
// none.
func joinLog(s audit.Store) storeLog {
	l := logOf(s)
	if l == nil {
		panic("joinLog: the store offers no delivery log")
	}
	return joined{s, l}
}

// The stores of this module offer the Consumer their delivery log; a
// wrapper that hides the store behind the audit.Store interface does not.
func TestStoresOfferDeliveryLog(t *testing.T) {
	pg, _ := pgStore(t)
	for name, s := range map[string]audit.Store{
		"pgstore": pg, "audittest": audittest.NewMemoryStore(), "memstore": memstore.New(),
		"embedding pgstore": struct{ *pgstore.Store }{pg},
	} {
		if logOf(s) == nil {
			t.Errorf("%s: no delivery log offered", name)
		}
	}
	if logOf(plainStore{memstore.New()}) != nil {
		t.Error("plainStore: a delivery log offered")
	}
}
