package pgstore_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
)

// Open the store (migrating its schema), find the messages poisoned in the
// last hour page by page, and prune records older than 30 days.
func Example() {
	ctx := context.Background()
	store, err := pgstore.New(ctx, pgstore.Config{
		DSN: "postgres://postgres@127.0.0.1:5432/test?sslmode=disable",
		// Schema: "rabbitretry_audit" (default)
	})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()

	f := audit.Filter{LastOutcome: audit.OutcomePoisoned, From: time.Now().Add(-time.Hour), Limit: 500}
	for {
		msgs, next, err := store.SearchPage(ctx, f)
		if err != nil {
			log.Fatal(err)
		}
		for _, m := range msgs {
			last := m.Attempts[len(m.Attempts)-1]
			fmt.Println(m.MessageID, last.Queue, last.ErrorClass, last.Error)
		}
		if next == "" {
			break
		}
		f.After = next
	}

	deleted, err := store.Prune(ctx, time.Now().AddDate(0, 0, -30), 0)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("pruned", deleted.Arrivals+deleted.Attempts, "records")
}
