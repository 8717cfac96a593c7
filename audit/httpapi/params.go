package httpapi

import (
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/auditparse"
)

// invalidFilterText is an ErrInvalidFilter error's text from "invalid
// filter: " on (without the store's prefixes).
func invalidFilterText(err error) string {
	msg := err.Error()
	if i := strings.Index(msg, "invalid filter: "); i >= 0 {
		return msg[i:]
	}
	return msg
}

// validateFilter checks the fields a store would refuse, for a 400.
func validateFilter(f audit.Filter) error {
	if f.Limit < 0 || f.Limit > maxLimit {
		return fmt.Errorf("limit %d: want 0..%d", f.Limit, maxLimit)
	}
	if !f.From.IsZero() && !f.To.IsZero() && !f.From.Before(f.To) {
		return errors.New("from must be before to")
	}
	for _, o := range []audit.Outcome{f.Outcome, f.LastOutcome} {
		if _, err := auditparse.Outcome(string(o)); err != nil {
			return err
		}
	}
	if err := f.Validate(); err != nil {
		return errors.New(invalidFilterText(err))
	}
	return nil
}

// filterParams are the query parameters parseFilter accepts.
var filterParams = map[string]bool{
	"message_id": true, "correlation_id": true, "from": true, "to": true,
	"queue": true, "exchange": true, "routing_key": true, "outcome": true,
	"last_outcome": true, "error_class": true, "error_contains": true,
	"header": true, "limit": true, "after": true,
}

// parseFilter builds an audit.Filter from the query parameters listed in
// the package documentation. Errors name the parameter: an unknown one, a
// repeated single-valued one, a time that is not RFC 3339, from not before
// to, an unknown outcome, a bad header match, limit outside 1..maxLimit.
func parseFilter(q url.Values) (audit.Filter, error) {
	var f audit.Filter
	for k, vs := range q {
		if !filterParams[k] {
			return f, fmt.Errorf("unknown parameter %q", k)
		}
		if k != "header" && len(vs) > 1 {
			return f, fmt.Errorf("parameter %q given %d times", k, len(vs))
		}
	}
	f.MessageID = q.Get("message_id")
	f.CorrelationID = q.Get("correlation_id")
	f.Queue = q.Get("queue")
	f.Exchange = q.Get("exchange")
	f.RoutingKey = q.Get("routing_key")
	f.ErrorClass = q.Get("error_class")
	f.ErrorContains = q.Get("error_contains")
	f.After = q.Get("after")
	var err error
	for _, p := range []struct {
		name string
		dst  *time.Time
	}{{"from", &f.From}, {"to", &f.To}} {
		if s := q.Get(p.name); s != "" {
			if *p.dst, err = time.Parse(time.RFC3339Nano, s); err != nil {
				return f, fmt.Errorf("%s %q: want an RFC 3339 time such as 2026-11-24T09:00:00Z", p.name, s)
			}
		}
	}
	if f.Outcome, err = auditparse.Outcome(q.Get("outcome")); err != nil {
		return f, err
	}
	if f.LastOutcome, err = auditparse.Outcome(q.Get("last_outcome")); err != nil {
		return f, fmt.Errorf("last_%w", err)
	}
	for _, kv := range q["header"] {
		k, v, err := auditparse.HeaderMatch(kv)
		if err != nil {
			return f, err
		}
		if f.Headers == nil {
			f.Headers = map[string]any{}
		}
		f.Headers[k] = v
	}
	if s := q.Get("limit"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 1 || n > maxLimit {
			return f, fmt.Errorf("limit %q: want 1..%d", s, maxLimit)
		}
		f.Limit = n
	}
	if err := validateFilter(f); err != nil {
		return f, err
	}
	return f, nil
}
