package wire

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// maxFieldDepth bounds how deep HeaderString descends into nested tables
// and arrays. A table decoded from the wire cannot nest deeper than the
// client library allows; the bound protects against Go values that contain
// themselves.
const maxFieldDepth = 64

// stringField accepts an AMQP long string (string) or byte array ([]byte).
func stringField(v interface{}) (string, bool) {
	switch s := v.(type) {
	case string:
		return s, true
	case []byte:
		return string(s), true
	}
	return "", false
}

// toInt64 converts an integer-valued header field: any Go integer type, a
// finite float without fraction, or a decimal string. Unsigned values above
// math.MaxInt64 and floats outside the int64 range are "out of range".
func toInt64(v interface{}) (int64, error) {
	switch n := v.(type) {
	case int:
		return int64(n), nil
	case int8:
		return int64(n), nil
	case int16:
		return int64(n), nil
	case int32:
		return int64(n), nil
	case int64:
		return n, nil
	case uint:
		return uintToInt64(uint64(n))
	case uint8:
		return int64(n), nil
	case uint16:
		return int64(n), nil
	case uint32:
		return int64(n), nil
	case uint64:
		return uintToInt64(n)
	case float32:
		return floatToInt64(float64(n))
	case float64:
		return floatToInt64(n)
	case string:
		return parseDecimalInt(n)
	case []byte:
		return parseDecimalInt(string(n))
	}
	return 0, fmt.Errorf("value is %s, not an integer", typeName(v))
}

func uintToInt64(u uint64) (int64, error) {
	if u > math.MaxInt64 {
		return 0, fmt.Errorf("value out of range: %d", u)
	}
	return int64(u), nil
}

func floatToInt64(f float64) (int64, error) {
	if math.IsNaN(f) || math.IsInf(f, 0) || f != math.Trunc(f) {
		return 0, fmt.Errorf("value %v is not an integer", f)
	}
	// 2^63 is exactly representable; every float below it converts exactly.
	if f >= math.MaxInt64 || f < math.MinInt64 {
		return 0, fmt.Errorf("value out of range: %v", f)
	}
	return int64(f), nil
}

func parseDecimalInt(s string) (int64, error) {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil {
		if errors.Is(err, strconv.ErrRange) {
			return 0, fmt.Errorf("value out of range: %q", truncateForError(s))
		}
		return 0, fmt.Errorf("value %q is not a decimal integer", truncateForError(s))
	}
	return n, nil
}

// truncateForError keeps error texts short when they quote a header value.
func truncateForError(s string) string {
	const max = 64
	if len(s) <= max {
		return s
	}
	return s[:max] + "..."
}

// typeName describes a header value's type for error messages.
func typeName(v interface{}) string {
	if v == nil {
		return "void"
	}
	return fmt.Sprintf("%T", v)
}

// Count converts the value of a count header the broker sets, named key in
// errors: x-delivery-count, which quorum queues set on redelivered messages
// (RabbitMQ "Quorum Queues", poison message handling: the number of earlier
// unsuccessful delivery attempts; absent on the first delivery), or
// x-acquired-count (RabbitMQ 4.x: every earlier return to the queue). The
// value may be of any Go integer type (amqp091-go decodes the broker's value
// as int64); a float without fraction or a decimal string is accepted too.
//
// It returns an error for a nil, non-integer or negative value, or for an
// unsigned value above math.MaxInt64.
func Count(key string, v interface{}) (int64, error) {
	if v == nil {
		return 0, fmt.Errorf("%s is void", key)
	}
	n, err := toInt64(v)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", key, err)
	}
	if n < 0 {
		return 0, fmt.Errorf("%s %d is negative", key, n)
	}
	return n, nil
}

// HeaderString returns the string form of any AMQP field value as
// amqp091-go decodes it (AMQP 0-9-1 field types: t, b, B, s, u, I, i, l, f, d,
// D, S, x, T, F, A, V):
//   - string as is, []byte as a string of its bytes;
//   - integers and floats in decimal (strconv; floats in the shortest form
//     that round-trips, NaN and ±Inf as "NaN", "+Inf", "-Inf");
//   - bool as "true" or "false";
//   - time.Time in RFC 3339 with nanoseconds, UTC;
//   - amqp.Decimal as its decimal value (Value scaled by 10^-Scale);
//   - nil (void) as "";
//   - amqp.Table, map[string]interface{} and arrays as JSON, with nested
//     values converted the same way (numbers as JSON numbers, NaN and ±Inf,
//     times and byte arrays as JSON strings).
//
// It returns an error for a Go type that is not an AMQP field value or for
// nesting deeper than 64 levels; it never panics.
func HeaderString(v interface{}) (string, error) {
	switch x := v.(type) {
	case nil:
		return "", nil
	case string:
		return x, nil
	case []byte:
		return string(x), nil
	case amqp.Table, map[string]interface{}, []interface{}, []amqp.Table, []string:
		j, err := toJSONValue(v, 0)
		if err != nil {
			return "", err
		}
		b, err := json.Marshal(j)
		if err != nil {
			return "", fmt.Errorf("encoding %s header as JSON: %w", typeName(v), err)
		}
		return string(b), nil
	}
	s, _, err := scalarToString(v)
	return s, err
}

// scalarToString formats a non-container field value. number reports whether
// the result is a valid JSON number.
func scalarToString(v interface{}) (s string, number bool, err error) {
	switch x := v.(type) {
	case bool:
		return strconv.FormatBool(x), false, nil
	case int:
		return strconv.FormatInt(int64(x), 10), true, nil
	case int8:
		return strconv.FormatInt(int64(x), 10), true, nil
	case int16:
		return strconv.FormatInt(int64(x), 10), true, nil
	case int32:
		return strconv.FormatInt(int64(x), 10), true, nil
	case int64:
		return strconv.FormatInt(x, 10), true, nil
	case uint:
		return strconv.FormatUint(uint64(x), 10), true, nil
	case uint8:
		return strconv.FormatUint(uint64(x), 10), true, nil
	case uint16:
		return strconv.FormatUint(uint64(x), 10), true, nil
	case uint32:
		return strconv.FormatUint(uint64(x), 10), true, nil
	case uint64:
		return strconv.FormatUint(x, 10), true, nil
	case float32:
		f := float64(x)
		return strconv.FormatFloat(f, 'g', -1, 32), !math.IsNaN(f) && !math.IsInf(f, 0), nil
	case float64:
		return strconv.FormatFloat(x, 'g', -1, 64), !math.IsNaN(x) && !math.IsInf(x, 0), nil
	case amqp.Decimal:
		return decimalString(x), true, nil
	case time.Time:
		return x.UTC().Format(time.RFC3339Nano), false, nil
	}
	return "", false, fmt.Errorf("unsupported AMQP field value of type %s", typeName(v))
}

// decimalString formats an AMQP decimal (Value * 10^-Scale) exactly, e.g.
// {Scale: 2, Value: -5} as "-0.05".
func decimalString(d amqp.Decimal) string {
	digits := strconv.FormatInt(int64(d.Value), 10)
	neg := strings.HasPrefix(digits, "-")
	digits = strings.TrimPrefix(digits, "-")
	scale := int(d.Scale)
	if scale > 0 {
		if len(digits) <= scale {
			digits = strings.Repeat("0", scale-len(digits)+1) + digits
		}
		digits = digits[:len(digits)-scale] + "." + digits[len(digits)-scale:]
	}
	if neg {
		return "-" + digits
	}
	return digits
}

// toJSONValue converts a field value to a value encoding/json can marshal
// without error and without losing precision.
func toJSONValue(v interface{}, depth int) (interface{}, error) {
	if depth > maxFieldDepth {
		return nil, fmt.Errorf("header value nested deeper than %d levels", maxFieldDepth)
	}
	switch x := v.(type) {
	case nil:
		return nil, nil
	case string:
		return x, nil
	case []byte:
		return string(x), nil
	case bool:
		return x, nil
	case amqp.Table:
		return mapToJSON(x, depth)
	case map[string]interface{}:
		return mapToJSON(x, depth)
	case []interface{}:
		out := make([]interface{}, len(x))
		for i, e := range x {
			j, err := toJSONValue(e, depth+1)
			if err != nil {
				return nil, err
			}
			out[i] = j
		}
		return out, nil
	case []amqp.Table:
		out := make([]interface{}, len(x))
		for i, e := range x {
			j, err := mapToJSON(e, depth+1)
			if err != nil {
				return nil, err
			}
			out[i] = j
		}
		return out, nil
	case []string:
		return append([]string{}, x...), nil
	}
	s, number, err := scalarToString(v)
	if err != nil {
		return nil, err
	}
	if number {
		return json.Number(s), nil
	}
	return s, nil
}

func mapToJSON(m map[string]interface{}, depth int) (interface{}, error) {
	out := make(map[string]interface{}, len(m))
	for k, e := range m {
		j, err := toJSONValue(e, depth+1)
		if err != nil {
			return nil, fmt.Errorf("field %q: %w", truncateForError(k), err)
		}
		out[k] = j
	}
	return out, nil
}
