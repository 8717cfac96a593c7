package httpapi_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"os"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/audit/httpapi"
	"github.com/rabbitretry/rabbitretry/audit/pgstore"
)

// Serve the audit store read-only over HTTP (what auditctl serve runs) and
// read one message's story with GET /v1/messages/{id}.
func ExampleNew() {
	ctx := context.Background()
	schema := fmt.Sprintf("example_httpapi_%d", os.Getpid()) // a throwaway schema; default "rabbitretry_audit"
	store, err := pgstore.New(ctx, pgstore.Config{DSN: "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", Schema: schema})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	defer store.Pool().Exec(ctx, "DROP SCHEMA "+schema+" CASCADE") //nolint:errcheck // example cleanup
	t0 := time.Date(2026, 11, 24, 8, 0, 0, 0, time.UTC)
	if err := store.Write(ctx,
		[]audit.Arrival{{ID: "arr-1", MessageID: "order-42", Exchange: "orders", RoutingKey: "order.created", ArrivedAt: t0}},
		[]audit.Attempt{{ID: "att-1", MessageID: "order-42", Queue: "orders.created", Attempt: 1, StartedAt: t0, Outcome: audit.OutcomePoisoned, Error: "unknown customer"}},
	); err != nil {
		log.Fatal(err)
	}

	h, err := httpapi.New(httpapi.Config{Store: store}) // read-only: no EnableResend
	if err != nil {
		log.Fatal(err)
	}
	srv := httptest.NewServer(h) // in a service: http.ListenAndServe("127.0.0.1:8080", h)
	defer srv.Close()

	resp, err := http.Get(srv.URL + "/v1/messages/order-42")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	var m audit.Message
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		log.Fatal(err)
	}
	fmt.Println(resp.Status)
	fmt.Println(m.MessageID, m.Arrival.Exchange, m.Attempts[0].Outcome, m.Attempts[0].Error)
	// Output:
	// 200 OK
	// order-42 orders poisoned unknown customer
}
