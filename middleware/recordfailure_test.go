package middleware_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// RecordFailure never lets a producer choose where a message "came from":
// the original queue is always the consuming queue, and the original
// exchange and routing key are the delivery's unless the delivery came back
// through the library's retry path (DeliveryRetryPathKey), where the values
// the library recorded on the first failure are kept.
func TestRecordFailureOrigin(t *testing.T) {
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	forged := func() message.Metadata {
		return message.Metadata{
			middleware.OriginalQueueKey:      "other-queue",
			middleware.OriginalExchangeKey:   "forged-ex",
			middleware.OriginalRoutingKeyKey: "forged.key",
			retrymeta.DeliveryExchangeKey:    "orders",
			retrymeta.DeliveryRoutingKeyKey:  "order.created",
		}
	}
	cases := []struct {
		name                string
		md                  message.Metadata
		queue               string
		wantQ, wantX, wantK string
		wantQueuePresent    bool
	}{
		{"forged, from the business exchange", forged(), "inbox", "inbox", "orders", "order.created", true},
		{"forged, retry path claimed by a header but not by the delivery", func() message.Metadata {
			md := forged()
			md[retrymeta.DeliveryRetryPathKey] = "yes"
			return md
		}(), "inbox", "inbox", "orders", "order.created", true},
		{"library values on the retry path", func() message.Metadata {
			md := forged()
			md[middleware.OriginalExchangeKey], md[middleware.OriginalRoutingKeyKey] = "orders", "order.created"
			md[retrymeta.DeliveryExchangeKey], md[retrymeta.DeliveryRoutingKeyKey] = "", "inbox"
			md[retrymeta.DeliveryRetryPathKey] = "true"
			return md
		}(), "inbox", "inbox", "orders", "order.created", true},
		{"retry path without recorded origin", message.Metadata{
			retrymeta.DeliveryExchangeKey: "rabbitretry.loopback", retrymeta.DeliveryRoutingKeyKey: "inbox",
			retrymeta.DeliveryRetryPathKey: "true",
		}, "inbox", "inbox", "rabbitretry.loopback", "inbox", true},
		{"queue unknown: a forged queue is removed", forged(), "", "", "orders", "order.created", false},
		{"no delivery keys (not AMQP)", message.Metadata{middleware.OriginalExchangeKey: "forged-ex"}, "topic", "topic", "", "", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			retrymeta.RecordFailure(tc.md, now, "boom", middleware.ClassTransient, tc.queue)
			q, ok := tc.md[middleware.OriginalQueueKey]
			if q != tc.wantQ || ok != tc.wantQueuePresent {
				t.Errorf("original queue %q (present %v), want %q (present %v)", q, ok, tc.wantQ, tc.wantQueuePresent)
			}
			if x, ok := tc.md[middleware.OriginalExchangeKey]; !ok || x != tc.wantX {
				t.Errorf("original exchange %q (present %v), want %q", x, ok, tc.wantX)
			}
			if k, ok := tc.md[middleware.OriginalRoutingKeyKey]; !ok || k != tc.wantK {
				t.Errorf("original routing key %q (present %v), want %q", k, ok, tc.wantK)
			}
			if tc.md[middleware.FirstFailureKey] == "" || tc.md[middleware.LastErrorKey] != "boom" {
				t.Errorf("failure metadata not written: %v", tc.md)
			}
		})
	}
}
