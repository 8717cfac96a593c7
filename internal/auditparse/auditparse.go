// Package auditparse parses the audit filter values that auditctl's flags
// and the audit HTTP API's query parameters share (outcomes, header
// matches), so both accept and reject the same text. Internal: it may
// import audit, and audit/httpapi and cmd/auditctl import it.
package auditparse

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/rabbitretry/rabbitretry/audit"
)

// knownOutcomes lists the known attempt outcomes (the values of outcome= and
// last_outcome=).
var knownOutcomes = []audit.Outcome{
	audit.OutcomeSuccess, audit.OutcomeRetry, audit.OutcomePoisoned,
	audit.OutcomeDropped, audit.OutcomeNacked, audit.OutcomeRequeued,
}

// Outcome returns s as an audit.Outcome if it is one of knownOutcomes (""
// is allowed: no filter).
func Outcome(s string) (audit.Outcome, error) {
	if s == "" {
		return "", nil
	}
	for _, o := range knownOutcomes {
		if string(o) == s {
			return o, nil
		}
	}
	names := make([]string, len(knownOutcomes))
	for i, o := range knownOutcomes {
		names[i] = string(o)
	}
	return "", fmt.Errorf("outcome %q: want one of %s", s, strings.Join(names, ", "))
}

// HeaderMatch parses "key=value" for audit.Filter.Headers: the value
// is parsed as JSON if it is valid JSON (5, true, null, "5", {"a":1}),
// else taken as a string (acme). The key must not be empty.
func HeaderMatch(kv string) (string, any, error) {
	k, v, ok := strings.Cut(kv, "=")
	if !ok || k == "" {
		return "", nil, fmt.Errorf("header %q: want key=value", kv)
	}
	var j any
	if err := json.Unmarshal([]byte(v), &j); err == nil {
		return k, j, nil
	}
	return k, v, nil
}
