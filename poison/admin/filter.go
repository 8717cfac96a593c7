package admin

import (
	"errors"
	"regexp"
	"slices"
	"strings"
	"time"
)

// Filter selects messages. A zero Filter matches every message. All set
// conditions must hold (AND); string comparisons are case-sensitive.
type Filter struct {
	// ReasonContains matches messages whose Reason contains this substring.
	ReasonContains string
	// ReasonRegexp matches messages whose Reason it matches.
	ReasonRegexp *regexp.Regexp
	// Handler matches Message.Handler exactly.
	Handler string
	// OriginalQueue matches Message.OriginalQueue exactly.
	OriginalQueue string
	// Class matches Message.Class exactly, e.g. "malformed".
	Class string
	// Since and Until bound Message.PoisonedAt: Since <= PoisonedAt < Until.
	// A zero value is no bound. When either is set, messages without a
	// (valid) rabbitretry-poisoned-at header do not match.
	Since, Until time.Time
	// Headers matches messages having every key with exactly this value, in
	// the stringified form of Message.Headers.
	Headers map[string]string
	// UUIDs matches messages whose UUID is one of these.
	UUIDs []string
	// Limit is the maximum number of matching messages an operation acts on
	// (the first ones in queue order); 0 means all; the other conditions ignore it.
	// Negative values are refused by every Admin method.
	Limit int
}

// validate reports a negative Limit or Since after Until.
func (f Filter) validate() error {
	if f.Limit < 0 {
		return errors.New("poison/admin: Filter.Limit must be >= 0 (0 = no limit)")
	}
	if !f.Since.IsZero() && !f.Until.IsZero() && f.Since.After(f.Until) {
		return errors.New("poison/admin: Filter.Since is after Filter.Until")
	}
	return nil
}

// match reports whether m satisfies every set condition of f (Limit
// excepted).
func (f Filter) match(m Message) bool {
	if f.ReasonContains != "" && !strings.Contains(m.Reason, f.ReasonContains) {
		return false
	}
	if f.ReasonRegexp != nil && !f.ReasonRegexp.MatchString(m.Reason) {
		return false
	}
	if f.Handler != "" && m.Handler != f.Handler {
		return false
	}
	if f.OriginalQueue != "" && m.OriginalQueue != f.OriginalQueue {
		return false
	}
	if f.Class != "" && m.Class != f.Class {
		return false
	}
	if !f.Since.IsZero() || !f.Until.IsZero() {
		if m.PoisonedAt.IsZero() {
			return false
		}
		if !f.Since.IsZero() && m.PoisonedAt.Before(f.Since) {
			return false
		}
		if !f.Until.IsZero() && !m.PoisonedAt.Before(f.Until) {
			return false
		}
	}
	for k, v := range f.Headers {
		got, ok := m.Headers[k]
		if !ok || got != v {
			return false
		}
	}
	if len(f.UUIDs) > 0 && !slices.Contains(f.UUIDs, m.UUID) {
		return false
	}
	return true
}
