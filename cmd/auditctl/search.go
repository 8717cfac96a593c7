package main

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/auditparse"
)

// oneLine replaces control characters by spaces so a value fits a cell.
func oneLine(s string) string {
	return strings.Map(func(r rune) rune {
		if unicode.IsControl(r) {
			return ' '
		}
		return r
	}, s)
}

func truncate(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n-3]) + "..."
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func formatTime(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format("2006-01-02T15:04:05.000Z07:00")
}

// messageTime is the time Search sorts by.
func messageTime(m audit.Message) time.Time {
	if m.Arrival != nil {
		return m.Arrival.ArrivedAt
	}
	var t time.Time
	for _, a := range m.Attempts {
		if t.IsZero() || a.StartedAt.Before(t) {
			t = a.StartedAt
		}
	}
	return t
}

func lastAttempt(m audit.Message) *audit.Attempt {
	var best *audit.Attempt
	for i := range m.Attempts {
		a := &m.Attempts[i]
		if best == nil || a.Attempt > best.Attempt || (a.Attempt == best.Attempt && a.StartedAt.After(best.StartedAt)) {
			best = a
		}
	}
	return best
}

func cmdSearch(e *env) int {
	st, err := openStore(e)
	if err != nil {
		return fail(e.stderr, err)
	}
	defer st.Close()
	// Listings carry no bodies (show has them): SearchEach reads none.
	msgs := []audit.Message{}
	next, err := st.SearchEach(e.ctx, e.f, func(m audit.Message) error {
		msgs = append(msgs, m)
		return nil
	})
	if err != nil {
		return fail(e.stderr, err)
	}
	if e.o.json {
		return jsonOut(e, auditparse.SearchResponse{Messages: msgs, Next: next}, exitOK)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "TIME\tMESSAGE ID\tEXCHANGE\tROUTING KEY\tQUEUE\tATTEMPTS\tLAST OUTCOME\tCLASS\tERROR")
	for _, m := range msgs {
		ex, key := "-", "-"
		if m.Arrival != nil {
			ex, key = orDash(oneLine(m.Arrival.Exchange)), orDash(oneLine(m.Arrival.RoutingKey))
		}
		q, outcome, class, errText := "-", "-", "-", ""
		if a := lastAttempt(m); a != nil {
			q, outcome, class, errText = orDash(oneLine(a.Queue)), string(a.Outcome), orDash(oneLine(a.ErrorClass)), a.Error
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", formatTime(messageTime(m)), orDash(oneLine(m.MessageID)),
			ex, key, q, len(m.Attempts), outcome, class, truncate(oneLine(errText), errorWidth))
	}
	if err := tw.Flush(); err != nil {
		return fail(e.stderr, fmt.Errorf("writing output: %w", err))
	}
	fmt.Fprintf(e.stderr, "%d message(s)\n", len(msgs))
	if next != "" {
		fmt.Fprintf(e.stderr, "more: add --after %s\n", next)
	}
	return exitOK
}

func cmdShow(e *env) int {
	st, err := openStore(e)
	if err != nil {
		return fail(e.stderr, err)
	}
	defer st.Close()
	id := e.pos[0]
	m, ok, err := st.Get(e.ctx, id)
	if err != nil {
		return fail(e.stderr, err)
	}
	if !ok {
		fmt.Fprintf(e.stderr, "auditctl: no audit record of message %q\n", id)
		return exitFail
	}
	if e.o.json {
		return jsonOut(e, m, exitOK)
	}
	w := e.stdout
	fmt.Fprintf(w, "Message %s\n", m.MessageID)
	if a := m.Arrival; a == nil {
		fmt.Fprintln(w, "\nArrival: none recorded (published before auditing began, or not through an audited exchange): cannot be resent")
	} else {
		fmt.Fprintln(w, "\nArrival:")
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		for _, row := range [][2]string{
			{"Exchange", a.Exchange}, {"Routing key", a.RoutingKey},
			{"Correlation id", a.CorrelationID},
			{"Published at", formatTime(a.PublishedAt)}, {"Arrived at", formatTime(a.ArrivedAt)},
			{"Record id", a.ID},
		} {
			fmt.Fprintf(tw, "  %s:\t%s\n", row[0], oneLine(orDash(row[1])))
		}
		for _, k := range sortedKeys(a.Properties) {
			fmt.Fprintf(tw, "  %s:\t%s\n", k, oneLine(a.Properties[k]))
		}
		_ = tw.Flush()
		if len(a.Headers) > 0 {
			fmt.Fprintln(w, "  Headers:")
			tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
			for _, k := range sortedKeys(a.Headers) {
				b, _ := json.Marshal(a.Headers[k])
				fmt.Fprintf(tw, "    %s:\t%s\n", oneLine(k), truncate(oneLine(string(b)), 200))
			}
			_ = tw.Flush()
		}
		body, note := a.Body, ""
		if a.BodyTruncated {
			note = fmt.Sprintf(", TRUNCATED in the audit: %d of %d bytes stored", len(a.Body), a.BodySize)
		}
		if len(body) > bodyPreview {
			body, note = body[:bodyPreview], note+fmt.Sprintf(", first %d shown", bodyPreview)
		}
		if utf8.Valid(body) {
			fmt.Fprintf(w, "  Body (%d bytes%s):\n%s\n", a.BodySize, note, body)
		} else {
			fmt.Fprintf(w, "  Body (%d bytes, binary, base64%s):\n%s\n", a.BodySize, note, base64.StdEncoding.EncodeToString(body))
		}
	}
	fmt.Fprintf(w, "\nAttempts (%d):\n", len(m.Attempts))
	if len(m.Attempts) > 0 {
		tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "  #\tSTARTED\tQUEUE\tDURATION\tOUTCOME\tDELAY\tCLASS\tERROR")
		for _, a := range m.Attempts {
			delay := "-"
			if a.Delay > 0 {
				delay = a.Delay.String()
			}
			fmt.Fprintf(tw, "  %d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", a.Attempt, formatTime(a.StartedAt), orDash(oneLine(a.Queue)),
				a.Duration, a.Outcome, delay, orDash(oneLine(a.ErrorClass)), truncate(oneLine(a.Error), 200))
		}
		_ = tw.Flush()
	}
	return exitOK
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}
