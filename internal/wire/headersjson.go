package wire

import (
	"encoding/base64"
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// HeadersToJSON converts AMQP headers into values encoding/json marshals
// without error or loss of precision, for storing them as a JSON document
// (the audit's Arrival.Headers): tables become objects, arrays arrays,
// numbers json.Number (exact, including AMQP decimals), timestamps RFC 3339
// strings (UTC), byte arrays base64 strings (standard encoding: byte arrays
// are binary, not text), NaN and infinities strings. A value of a type the
// AMQP 0-9-1 field table cannot hold, or nesting deeper than 64 levels,
// returns an error naming the field. Nil headers give nil.
func HeadersToJSON(h amqp.Table) (map[string]any, error) {
	if h == nil {
		return nil, nil
	}
	out := make(map[string]any, len(h))
	for k, v := range h {
		j, err := headerJSON(v, 0)
		if err != nil {
			return nil, fmt.Errorf("header %q: %w", truncateForError(k), err)
		}
		out[k] = j
	}
	return out, nil
}

func headerJSON(v any, depth int) (any, error) {
	if depth > maxFieldDepth {
		return nil, fmt.Errorf("header value nested deeper than %d levels", maxFieldDepth)
	}
	switch x := v.(type) {
	case []byte:
		return base64.StdEncoding.EncodeToString(x), nil
	case amqp.Table:
		return tableJSON(x, depth)
	case map[string]any:
		return tableJSON(x, depth)
	case []any:
		out := make([]any, len(x))
		for i, e := range x {
			j, err := headerJSON(e, depth+1)
			if err != nil {
				return nil, err
			}
			out[i] = j
		}
		return out, nil
	case []amqp.Table:
		out := make([]any, len(x))
		for i, e := range x {
			j, err := tableJSON(e, depth+1)
			if err != nil {
				return nil, err
			}
			out[i] = j
		}
		return out, nil
	}
	return toJSONValue(v, depth)
}

func tableJSON(m map[string]any, depth int) (any, error) {
	out := make(map[string]any, len(m))
	for k, e := range m {
		j, err := headerJSON(e, depth+1)
		if err != nil {
			return nil, fmt.Errorf("field %q: %w", truncateForError(k), err)
		}
		out[k] = j
	}
	return out, nil
}

// EncodeHeaderTable encodes h exactly, every value with its AMQP 0-9-1
// field type, as the field table travels on the wire (keys sorted, so the
// result is deterministic), in standard base64: the form in which the
// audit stores an arrival's headers so that a resend publishes them with
// the same types and values (an int32 stays an int32, an int64 beyond
// 2^53 stays exact, a decimal stays a decimal, a timestamp a timestamp, a
// byte array a byte array). The values must be of the Go types amqp091-go
// decodes field values into (nil, bool, int8, uint8, int16, uint16,
// int32, uint32, int64, float32, float64, amqp.Decimal, string, []byte,
// time.Time of whole seconds, amqp.Table and []interface{} of these,
// nested at most 64 levels, keys at most 255 bytes), as every delivery's
// headers are. Errors: a value of another type, or too deep, naming the
// field. A nil table gives "".
func EncodeHeaderTable(h amqp.Table) (string, error) {
	if h == nil {
		return "", nil
	}
	return encodeTypedHeaders(h)
}

// DecodeHeaderTable is the inverse of EncodeHeaderTable: the table with
// each value as amqp091-go decodes it (a timestamp as time.Unix(seconds,
// 0), an empty array as a nil []interface{}). "" gives a nil table. It
// returns an error, never panics, for text that is not a well-formed
// encoded field table.
func DecodeHeaderTable(s string) (amqp.Table, error) {
	if s == "" {
		return nil, nil
	}
	return decodeTypedHeaders(s)
}
