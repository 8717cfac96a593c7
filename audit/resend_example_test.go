package audit_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/audittest"
)

// A dry run of a resend: what would be published again, and where, without
// connecting to the broker. The store here is in memory; in a service it is
// a *pgstore.Store fed by an audit.Consumer.
func ExampleResender_Resend() {
	ctx := context.Background()
	store := audittest.NewMemoryStore()
	arrived := time.Date(2026, 11, 24, 8, 0, 0, 0, time.UTC)
	body := []byte(`{"order":42}`)
	err := store.Write(ctx, []audit.Arrival{{
		ID: "arr-1", MessageID: "order-42", Exchange: "orders", RoutingKey: "order.created",
		ArrivedAt: arrived, Body: body, BodySize: len(body),
	}}, []audit.Attempt{{
		ID: "att-1", MessageID: "order-42", Queue: "orders.created", Attempt: 1,
		StartedAt: arrived.Add(time.Second), Outcome: audit.OutcomePoisoned,
		ErrorClass: "permanent", Error: "unknown customer",
	}})
	if err != nil {
		log.Fatal(err)
	}

	r, err := audit.NewResender(audit.ResenderConfig{
		URI:   "amqp://guest:guest@127.0.0.1:5672/", // only a real resend connects
		Store: store,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer r.Close()

	// ResendToQueue: only the queue that poisoned it gets it again, through
	// the retry topology's loop-back exchange.
	rep, err := r.Resend(ctx, audit.Filter{MessageID: "order-42"},
		audit.ResendOptions{Mode: audit.ResendToQueue, DryRun: true})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("matched %d, would send %d\n", rep.Matched, rep.Sent)
	for _, res := range rep.Results {
		fmt.Println(res.MessageID, res.Status, "to queue", res.Queue, "via", res.Exchange)
	}
	// Output:
	// matched 1, would send 1
	// order-42 would-send to queue orders.created via rabbitretry.loopback
}
