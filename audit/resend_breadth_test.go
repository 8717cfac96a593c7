package audit_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
)

// Breadth is judged by the result, not by which filter fields are set
// (issue 19 item 10): a filter with only a time range (from 1970) passes
// the empty-filter check but selects every message. Resending more than
// audit.DefaultResendConfirmAbove messages, or every message of the store,
// needs AllowAll; an ExpectedCount that differs from the matches stops the
// resend before anything is sent. Nothing is published by a refused
// resend.
func TestResendBreadthJudgedByResult(t *testing.T) {
	tp := newResendTopology(t)
	st := newResendPGStore(t)
	const n = 40
	base := time.Now().Add(-time.Hour).UTC().Truncate(time.Millisecond)
	var arrivals []audit.Arrival
	for i := range n {
		id := fmt.Sprintf("br-%02d", i)
		a := resendArrival(id, tp.business, tp.key, map[string]any{"_watermill_message_uuid": id}, "body-"+id)
		a.ArrivedAt = base.Add(time.Duration(i) * time.Second)
		arrivals = append(arrivals, a)
	}
	if err := st.Write(context.Background(), arrivals, nil); err != nil {
		t.Fatal(err)
	}
	r := newTestResender(t, st, tp)
	ctx := context.Background()
	since1970 := audit.Filter{From: time.Unix(0, 0)}
	toEx := audit.ResendOptions{Mode: audit.ResendToExchange}

	rep, err := r.Resend(ctx, since1970, toEx)
	if !errors.Is(err, audit.ErrBroadResend) || rep.Sent != 0 {
		t.Errorf("from 1970 without AllowAll: sent %d, %v; want ErrBroadResend and nothing sent", rep.Sent, err)
	}
	// A narrower time range that still holds more than the set number.
	rep, err = r.Resend(ctx, audit.Filter{From: base.Add(20 * time.Second)}, toEx)
	if !errors.Is(err, audit.ErrBroadResend) || rep.Sent != 0 || rep.Matched != 20 {
		t.Errorf("20 messages without AllowAll: %+v, %v; want ErrBroadResend, matched 20, nothing sent", rep, err)
	}
	// Chunks of 5 (Limit) do not hide the breadth of the filter.
	rep, err = r.Resend(ctx, since1970, audit.ResendOptions{Mode: audit.ResendToExchange, Limit: 5})
	if !errors.Is(err, audit.ErrBroadResend) || rep.Sent != 0 {
		t.Errorf("from 1970, Limit 5, without AllowAll: sent %d, %v; want ErrBroadResend", rep.Sent, err)
	}
	// The expected count guards against a result that changed since the
	// dry run.
	allow := audit.ResendOptions{Mode: audit.ResendToExchange, AllowAll: true, ExpectedCount: n - 1}
	rep, err = r.Resend(ctx, since1970, allow)
	if !errors.Is(err, audit.ErrCountMismatch) || rep.Sent != 0 || rep.Matched != n {
		t.Errorf("ExpectedCount %d: %+v, %v; want ErrCountMismatch, matched %d, nothing sent", n-1, rep, err, n)
	}
	tp.drain(t, tp.q1, 0)
	// A narrow filter needs nothing; a dry run tells the count.
	rep, err = r.Resend(ctx, audit.Filter{MessageID: "br-07"}, toEx)
	if err != nil || rep.Sent != 1 {
		t.Fatalf("one message: %+v, %v", rep, err)
	}
	tp.drain(t, tp.q1, 1)
	tp.drain(t, tp.q2, 1)
	dry, err := r.Resend(ctx, since1970, audit.ResendOptions{Mode: audit.ResendToExchange, DryRun: true})
	if err != nil || dry.Matched != n {
		t.Fatalf("dry run: %+v, %v", dry, err)
	}
	allow.ExpectedCount = dry.Matched
	rep, err = r.Resend(ctx, since1970, allow)
	if err != nil || rep.Sent != n {
		t.Fatalf("AllowAll, ExpectedCount %d: %+v, %v", n, rep, err)
	}
	got := tp.drain(t, tp.q1, n)
	tp.drain(t, tp.q2, n)
	seen := map[string]int{}
	for _, d := range got {
		seen[string(d.Body)]++
	}
	lost, dups := 0, 0
	for _, a := range arrivals {
		switch seen[string(a.Body)] {
		case 0:
			lost++
		case 1:
		default:
			dups += seen[string(a.Body)] - 1
		}
	}
	t.Logf("ACCOUNT %s: published=%d handled=%d poisoned=0 duplicates=%d lost=%d", t.Name(), n, len(seen), dups, lost)
	if lost != 0 || dups != 0 {
		t.Errorf("lost %d, duplicates %d", lost, dups)
	}

	// A store of 3: a time range selecting all 3 is "everything".
	st3 := newResendPGStore(t)
	if err := st3.Write(ctx, arrivals[:3], nil); err != nil {
		t.Fatal(err)
	}
	r3 := newTestResender(t, st3, tp)
	if rep, err := r3.Resend(ctx, since1970, toEx); !errors.Is(err, audit.ErrBroadResend) || rep.Sent != 0 {
		t.Errorf("every message of a store of 3: sent %d, %v; want ErrBroadResend", rep.Sent, err)
	}
	if rep, err := r3.Resend(ctx, audit.Filter{From: arrivals[1].ArrivedAt}, toEx); err != nil || rep.Sent != 2 {
		t.Errorf("2 of 3: %+v, %v; want 2 sent", rep, err)
	}
	tp.drain(t, tp.q1, 2)
	tp.drain(t, tp.q2, 2)
}
