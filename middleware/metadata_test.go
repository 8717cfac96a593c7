package middleware_test

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

func TestRetryStateVocabulary(t *testing.T) {
	deliveryOnly := []string{
		middleware.XDeathKey, retrymeta.XDeliveryCountKey, retrymeta.XAcquiredCountKey,
		"x-first-death-queue", "x-first-death-reason", "x-first-death-exchange",
		"x-last-death-queue", "x-last-death-reason", "x-last-death-exchange",
		retrymeta.DeliveryExchangeKey, retrymeta.DeliveryRoutingKeyKey, retrymeta.DeliveryRedeliveredKey,
		retrymeta.DeliveryRetryPathKey, retrymeta.HeaderErrorKey,
	}
	counters := []string{
		middleware.AttemptKey, retrymeta.ProvenAttemptKey, retrymeta.RedeliveriesKey, middleware.DelayKey, retrymeta.RemainingDelayKey,
		middleware.PoisonAttemptsKey, middleware.PoisonedAtKey,
		"reason_poisoned", "topic_poisoned", "handler_poisoned", "subscriber_poisoned",
	}
	history := []string{
		middleware.FirstFailureKey, middleware.LastFailureKey, middleware.LastErrorKey, middleware.ErrorClassKey,
		middleware.OriginalExchangeKey, middleware.OriginalRoutingKeyKey, middleware.OriginalQueueKey,
		middleware.ReplayedKey, "_watermill_message_uuid", "x-match", "tenant",
	}
	for _, k := range deliveryOnly {
		if !retrymeta.IsDeliveryOnly(k) || !middleware.IsRetryState(k) {
			t.Errorf("%s: IsDeliveryOnly %v IsRetryState %v, want both", k, retrymeta.IsDeliveryOnly(k), middleware.IsRetryState(k))
		}
	}
	for _, k := range counters {
		if retrymeta.IsDeliveryOnly(k) || !middleware.IsRetryState(k) {
			t.Errorf("%s: IsDeliveryOnly %v IsRetryState %v, want retry state carried by copies", k, retrymeta.IsDeliveryOnly(k), middleware.IsRetryState(k))
		}
	}
	for _, k := range history {
		if retrymeta.IsDeliveryOnly(k) || middleware.IsRetryState(k) {
			t.Errorf("%s: IsDeliveryOnly %v IsRetryState %v, want neither", k, retrymeta.IsDeliveryOnly(k), middleware.IsRetryState(k))
		}
	}
	md := message.Metadata{}
	for _, k := range append(append(append([]string{}, deliveryOnly...), counters...), history...) {
		md.Set(k, "v")
	}
	retrymeta.StripDeliveryMetadata(md)
	for _, k := range deliveryOnly {
		if _, ok := md[k]; ok {
			t.Errorf("StripDeliveryMetadata kept %s", k)
		}
	}
	if len(md) != len(counters)+len(history) {
		t.Errorf("StripDeliveryMetadata left %d keys, want %d", len(md), len(counters)+len(history))
	}
}
