package amqpretry_test

import (
	"context"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"

	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// A message whose context ended before the chain got it (the router is
// stopping: watermill-amqp's plain subscriber can still hand one out, and
// nacks it on close whatever the chain decides) is neither run nor copied:
// the chain returns an error, so it goes back to the queue unprocessed.
// Before, a redelivered one was moved to the crash quarantine (a confirmed
// copy) and acked, and the ack lost to the close left the copy beside the
// requeued original: the message ran twice (the fault suite's
// TestShutdownAtLastAttempt/plainSubscriber=true, about 1 run in 12).
func TestChainLeavesStoppedMessagesAlone(t *testing.T) {
	for _, redelivered := range []bool{false, true} {
		r, msg := footprintRetry(t)
		// The queue's retry topology, quarantine included, so that a copy
		// would land somewhere.
		sub, err := r.NewSubscriber(watermill.NopLogger{}, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := sub.SubscribeInitialize(footprintQueue); err != nil {
			t.Fatal(err)
		}
		_ = sub.Close()
		t.Cleanup(func() { _ = r.DeleteQueues(footprintQueue) })
		if redelivered {
			msg.Metadata.Set(retrymeta.DeliveryRedeliveredKey, "true")
		}
		ctx, cancel := context.WithCancel(msg.Context())
		cancel()
		msg.SetContext(ctx)
		ran := false
		h := r.Middleware(func(*message.Message) ([]*message.Message, error) { ran = true; return nil, nil })
		if _, err := h(msg); err == nil {
			t.Errorf("redelivered=%v: the chain settled a message whose context had ended", redelivered)
		}
		if ran {
			t.Errorf("redelivered=%v: the handler ran for a message whose context had ended", redelivered)
		}
		if n := quarantined(t, r); n != 0 {
			t.Errorf("redelivered=%v: %d copies in the quarantine queue", redelivered, n)
		}
	}
}

// quarantined returns how many messages wait in footprintQueue's
// quarantine queue.
func quarantined(t *testing.T, r *amqpretry.Retry) int {
	t.Helper()
	conn, err := amqp.Dial(testkit.URI(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	q, err := ch.QueueDeclarePassive(r.Topology().Naming().QuarantineQueue(footprintQueue), true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return q.Messages
}
