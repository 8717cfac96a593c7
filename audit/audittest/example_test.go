package audittest_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/audittest"
)

// An in-memory audit.Store for tests: write an arrival and its attempts as
// an audit.Consumer would, then read the message's story back.
func ExampleMemoryStore() {
	ctx := context.Background()
	store := audittest.NewMemoryStore()
	t0 := time.Date(2026, 11, 24, 8, 0, 0, 0, time.UTC)
	err := store.Write(ctx,
		[]audit.Arrival{{ID: "arr-1", MessageID: "order-42", Exchange: "orders", RoutingKey: "order.created", ArrivedAt: t0}},
		[]audit.Attempt{
			{ID: "att-1", MessageID: "order-42", Queue: "orders.created", Attempt: 1, StartedAt: t0, Outcome: audit.OutcomeRetry, Error: "timeout"},
			{ID: "att-2", MessageID: "order-42", Queue: "orders.created", Attempt: 2, StartedAt: t0.Add(5 * time.Second), Outcome: audit.OutcomeSuccess},
		})
	if err != nil {
		log.Fatal(err)
	}

	msgs, err := store.Search(ctx, audit.Filter{MessageID: "order-42"})
	if err != nil {
		log.Fatal(err)
	}
	for _, m := range msgs {
		fmt.Println(m.MessageID, "arrived on", m.Arrival.Exchange)
		for _, a := range m.Attempts {
			fmt.Println(" attempt", a.Attempt, a.Outcome, a.Error)
		}
	}
	// Output:
	// order-42 arrived on orders
	//  attempt 1 retry timeout
	//  attempt 2 success
}
