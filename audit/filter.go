package audit

import (
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// ErrInvalidFilter is wrapped by the error of a Filter (or a message id)
// that no store can search with: Filter.Validate's, and a store's for an
// After that is not its cursor. The error names the field; it is the
// caller's mistake (an HTTP 400), not the store's.
var ErrInvalidFilter = errors.New("audit: invalid filter")

// Validate reports the first field of f no store can search with, wrapping
// ErrInvalidFilter: From not before To, a
// string (MessageID, CorrelationID, Queue, Exchange, RoutingKey, Outcome,
// LastOutcome, ErrorClass, ErrorContains, After, a Headers key or string
// value at any depth) that is not valid UTF-8 or holds a NUL byte
// (PostgreSQL text and jsonb cannot hold either: SQLSTATE 22021, 22P05).
// Whether After is a cursor and the Limit range are the store's to say.
func (f Filter) Validate() error {
	if !f.From.IsZero() && !f.To.IsZero() && !f.From.Before(f.To) {
		return fmt.Errorf("%w: Filter.From %s is not before Filter.To %s", ErrInvalidFilter, f.From.Format(time.RFC3339Nano), f.To.Format(time.RFC3339Nano))
	}
	for _, s := range []struct{ name, v string }{
		{"Filter.MessageID", f.MessageID}, {"Filter.CorrelationID", f.CorrelationID}, {"Filter.Queue", f.Queue},
		{"Filter.Exchange", f.Exchange}, {"Filter.RoutingKey", f.RoutingKey}, {"Filter.Outcome", string(f.Outcome)},
		{"Filter.LastOutcome", string(f.LastOutcome)}, {"Filter.ErrorClass", f.ErrorClass},
		{"Filter.ErrorContains", f.ErrorContains}, {"Filter.After", f.After},
	} {
		if err := validText(s.name, s.v); err != nil {
			return err
		}
	}
	for k, v := range f.Headers {
		if err := validText("Filter.Headers key", k); err != nil {
			return err
		}
		if err := validValue("Filter.Headers["+k+"]", v, 0); err != nil {
			return err
		}
	}
	return nil
}

// validText returns nil if s can be searched for (valid UTF-8, no NUL
// byte), else an error wrapping ErrInvalidFilter naming field.
func validText(field, s string) error {
	switch {
	case !utf8.ValidString(s):
		return fmt.Errorf("%w: %s is not valid UTF-8", ErrInvalidFilter, strings.ToValidUTF8(field, "?"))
	case strings.IndexByte(s, 0) >= 0:
		return fmt.Errorf("%w: %s holds a NUL byte", ErrInvalidFilter, strings.ToValidUTF8(strings.ReplaceAll(field, "\x00", "\\0"), "?"))
	}
	return nil
}

func validValue(field string, v any, depth int) error {
	if depth > 64 {
		return fmt.Errorf("%w: %s is nested more than 64 deep", ErrInvalidFilter, field)
	}
	switch x := v.(type) {
	case string:
		return validText(field, x)
	case map[string]any:
		for k, e := range x {
			if err := validText(field+" key", k); err != nil {
				return err
			}
			if err := validValue(field, e, depth+1); err != nil {
				return err
			}
		}
	case []any:
		for _, e := range x {
			if err := validValue(field, e, depth+1); err != nil {
				return err
			}
		}
	}
	return nil
}
