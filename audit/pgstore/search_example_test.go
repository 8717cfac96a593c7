package pgstore_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
)

// Write the records an audit.Consumer would, then find the poisoned
// messages page by page, newest first, with the cursor SearchPage returns.
func ExampleStore_SearchPage() {
	ctx := context.Background()
	schema := fmt.Sprintf("example_search_%d", os.Getpid()) // a throwaway schema; default "rabbitretry_audit"
	store, err := pgstore.New(ctx, pgstore.Config{
		DSN:    "postgres://postgres@127.0.0.1:5432/test?sslmode=disable",
		Schema: schema,
	})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	defer store.Pool().Exec(ctx, "DROP SCHEMA "+schema+" CASCADE") //nolint:errcheck // example cleanup

	t0 := time.Date(2026, 11, 24, 8, 0, 0, 0, time.UTC)
	var arrivals []audit.Arrival
	var attempts []audit.Attempt
	for i, outcome := range []audit.Outcome{audit.OutcomePoisoned, audit.OutcomeSuccess, audit.OutcomePoisoned, audit.OutcomePoisoned} {
		id := fmt.Sprintf("order-%d", i+1)
		at := t0.Add(time.Duration(i) * time.Minute)
		arrivals = append(arrivals, audit.Arrival{ID: "arr-" + id, MessageID: id, Exchange: "orders", RoutingKey: "order.created", ArrivedAt: at})
		attempts = append(attempts, audit.Attempt{ID: "att-" + id, MessageID: id, Queue: "orders.created", Attempt: 1,
			StartedAt: at.Add(time.Second), Outcome: outcome, ErrorClass: "permanent"})
	}
	if err := store.Write(ctx, arrivals, attempts); err != nil {
		log.Fatal(err)
	}

	f := audit.Filter{LastOutcome: audit.OutcomePoisoned, Limit: 2}
	for page := 1; ; page++ {
		msgs, next, err := store.SearchPage(ctx, f)
		if err != nil {
			log.Fatal(err)
		}
		for _, m := range msgs {
			fmt.Println("page", page, m.MessageID, m.Attempts[len(m.Attempts)-1].Outcome)
		}
		if next == "" {
			break
		}
		f.After = next
	}
	// Output:
	// page 1 order-4 poisoned
	// page 1 order-3 poisoned
	// page 2 order-1 poisoned
}
