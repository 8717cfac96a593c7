package audit_test

import (
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// Headers that cannot be converted are recorded under the library's one
// header-error key (retrymeta.HeaderErrorKey), not a look-alike; the
// queue's own x-delivery-count and x-acquired-count are left out.
func TestArrivalHeaderErrorKey(t *testing.T) {
	loop := amqp.Table{}
	loop["self"] = loop // nested without end: not convertible
	a := audit.ArrivalFromDelivery(amqp.Delivery{Headers: amqp.Table{"loop": loop}}, "_watermill_message_uuid", 1024, time.Now())
	if _, ok := a.Headers[retrymeta.HeaderErrorKey]; !ok || len(a.Headers) != 1 {
		t.Fatalf("headers %v, want only %s", a.Headers, retrymeta.HeaderErrorKey)
	}
	a = audit.ArrivalFromDelivery(amqp.Delivery{Headers: amqp.Table{
		retrymeta.XDeliveryCountKey: int64(2), retrymeta.XAcquiredCountKey: int64(3), "tenant": "a",
	}}, "_watermill_message_uuid", 1024, time.Now())
	if len(a.Headers) != 1 || a.Headers["tenant"] != "a" {
		t.Fatalf("headers %v, want only tenant", a.Headers)
	}
}
