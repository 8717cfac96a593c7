package pgstore

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
)

// SearchEach lists what SearchPage returns, in the same order and with the
// same next cursor, across more than one chunk, without bodies.
func TestSearchEachIsSearchPageWithoutBodies(t *testing.T) {
	s := newTestStore(t)
	ctx := context.Background()
	base := time.Now().UTC().Add(-time.Hour).Truncate(time.Microsecond)
	var arr []audit.Arrival
	for i := range eachChunk + 30 {
		body := fmt.Sprintf("body-%d", i)
		arr = append(arr, audit.Arrival{ID: fmt.Sprintf("a-%d", i), MessageID: fmt.Sprintf("m-%03d", i), Exchange: "orders",
			RoutingKey: "k", ArrivedAt: base.Add(time.Duration(i) * time.Second), Body: []byte(body), BodySize: len(body)})
	}
	if err := s.Write(ctx, arr, nil); err != nil {
		t.Fatal(err)
	}
	f := audit.Filter{Exchange: "orders", Limit: eachChunk + 20}
	page, next, err := s.SearchPage(ctx, f)
	if err != nil {
		t.Fatal(err)
	}
	var got []audit.Message
	next2, err := s.SearchEach(ctx, f, func(m audit.Message) error { got = append(got, m); return nil })
	if err != nil {
		t.Fatal(err)
	}
	if next2 != next || next == "" || len(got) != len(page) || len(got) != eachChunk+20 {
		t.Fatalf("SearchEach: %d messages, next %q; SearchPage: %d, next %q", len(got), next2, len(page), next)
	}
	for i := range got {
		if got[i].MessageID != page[i].MessageID || got[i].Arrival == nil || got[i].Arrival.Body != nil ||
			got[i].Arrival.BodySize != page[i].Arrival.BodySize || len(page[i].Arrival.Body) != page[i].Arrival.BodySize {
			t.Fatalf("message %d: SearchEach %+v, SearchPage %+v", i, got[i].Arrival, page[i].Arrival)
		}
	}
}
