package amqpretry

import (
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/middleware"
)

// maxFieldDepth bounds how deep headerToString descends into nested tables
// and arrays. A table decoded from the wire cannot nest deeper than the
// client library allows; the bound protects against Go values that contain
// themselves.
const maxFieldDepth = 64

// DeathRecordsFromTable converts the value of RabbitMQ's x-death header, as
// github.com/rabbitmq/amqp091-go decodes it, into death records (RabbitMQ
// "Dead Letter Exchanges": one entry per {queue, reason}, most recent first,
// each a table with queue, reason, count, time, exchange, routing-keys and
// possibly original-expiration, which is ignored).
//
// The conversion is tolerant of the shapes a client library or a test may
// produce:
//   - the header may be []interface{} (what amqp091-go decodes), []amqp.Table
//     or []map[string]interface{}; nil yields no records and no error;
//   - an entry may be amqp.Table or map[string]interface{};
//   - count may be any Go integer type, a float without fraction, or a
//     decimal string ([]byte too); an entry without count counts as 1;
//   - routing-keys may be []interface{} of strings or []string;
//   - time may be time.Time (amqp091-go's decoding of an AMQP timestamp) or an
//     RFC 3339 string; it is returned in UTC. A missing time is the zero time;
//     a year outside 0-9999 is an error ("time out of range").
//
// It returns an error, naming the entry (0-based) and the problem, when the
// header is not an array, when it has more than middleware.MaxDeathRecords
// entries, when an entry is not a table, has no non-empty string queue, has a
// reason, exchange or routing key that is not a string, or has a count that
// is not a number, is negative or exceeds math.MaxInt32 ("count out of
// range"). A forged header therefore cannot inject an absurd count.
func DeathRecordsFromTable(v interface{}) ([]middleware.DeathRecord, error) {
	var entries []interface{}
	switch a := v.(type) {
	case nil:
		return nil, nil
	case []interface{}:
		entries = a
	case []amqp.Table:
		entries = make([]interface{}, len(a))
		for i := range a {
			entries[i] = a[i]
		}
	case []map[string]interface{}:
		entries = make([]interface{}, len(a))
		for i := range a {
			entries[i] = a[i]
		}
	default:
		return nil, fmt.Errorf("x-death header is %s, not an array of tables", typeName(v))
	}
	if len(entries) > middleware.MaxDeathRecords {
		return nil, fmt.Errorf("x-death header has %d entries, more than the %d accepted", len(entries), middleware.MaxDeathRecords)
	}
	recs := make([]middleware.DeathRecord, 0, len(entries))
	for i, e := range entries {
		var t map[string]interface{}
		switch tt := e.(type) {
		case amqp.Table:
			t = tt
		case map[string]interface{}:
			t = tt
		default:
			return nil, fmt.Errorf("x-death entry %d is %s, not a table", i, typeName(e))
		}
		rec, err := deathRecordFromEntry(t)
		if err != nil {
			return nil, fmt.Errorf("x-death entry %d: %w", i, err)
		}
		recs = append(recs, rec)
	}
	return recs, nil
}

func deathRecordFromEntry(t map[string]interface{}) (middleware.DeathRecord, error) {
	var rec middleware.DeathRecord
	q, ok := t["queue"]
	if !ok || q == nil {
		return rec, errors.New("missing queue")
	}
	qs, ok := stringField(q)
	if !ok {
		return rec, fmt.Errorf("queue is %s, not a string", typeName(q))
	}
	if qs == "" {
		return rec, errors.New("queue is empty")
	}
	rec.Queue = qs

	if r, ok := t["reason"]; ok && r != nil {
		rs, ok := stringField(r)
		if !ok {
			return rec, fmt.Errorf("reason is %s, not a string", typeName(r))
		}
		rec.Reason = rs
	}
	if x, ok := t["exchange"]; ok && x != nil {
		xs, ok := stringField(x)
		if !ok {
			return rec, fmt.Errorf("exchange is %s, not a string", typeName(x))
		}
		rec.Exchange = xs
	}

	rec.Count = 1
	if c, ok := t["count"]; ok && c != nil {
		n, err := toInt64(c)
		if err != nil {
			return rec, fmt.Errorf("count: %w", err)
		}
		if n < 0 {
			return rec, fmt.Errorf("count %d is negative", n)
		}
		if n > math.MaxInt32 {
			return rec, fmt.Errorf("count out of range: %d exceeds %d", n, math.MaxInt32)
		}
		rec.Count = n
	}

	if rk, ok := t["routing-keys"]; ok && rk != nil {
		switch keys := rk.(type) {
		case []string:
			if len(keys) > 0 {
				rec.RoutingKeys = append([]string(nil), keys...)
			}
		case []interface{}:
			for j, k := range keys {
				ks, ok := stringField(k)
				if !ok {
					return rec, fmt.Errorf("routing key %d is %s, not a string", j, typeName(k))
				}
				rec.RoutingKeys = append(rec.RoutingKeys, ks)
			}
		default:
			return rec, fmt.Errorf("routing-keys is %s, not an array of strings", typeName(rk))
		}
	}

	if tv, ok := t["time"]; ok && tv != nil {
		switch tm := tv.(type) {
		case time.Time:
			rec.Time = tm.UTC()
		case string:
			p, err := time.Parse(time.RFC3339Nano, tm)
			if err != nil {
				return rec, fmt.Errorf("time %q is not an RFC 3339 time", tm)
			}
			rec.Time = p.UTC()
		default:
			return rec, fmt.Errorf("time is %s, not a timestamp", typeName(tv))
		}
		// middleware.EncodeXDeath writes JSON, which holds years 0-9999 only.
		if y := rec.Time.Year(); y < 0 || y > 9999 {
			return rec, fmt.Errorf("time out of range: year %d", y)
		}
	}
	return rec, nil
}

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

// DeliveryCount converts the value of the x-delivery-count header that
// quorum queues set on redelivered messages (RabbitMQ "Quorum Queues",
// poison message handling: the number of earlier unsuccessful delivery
// attempts; the header is absent on the first delivery). The value may be of
// any Go integer type (amqp091-go decodes the broker's value as int64); a
// float without fraction or a decimal string is accepted too.
//
// It returns an error for a nil, non-integer or negative value, or for an
// unsigned value above math.MaxInt64.
func DeliveryCount(v interface{}) (int64, error) {
	if v == nil {
		return 0, errors.New("x-delivery-count is void")
	}
	n, err := toInt64(v)
	if err != nil {
		return 0, fmt.Errorf("x-delivery-count: %w", err)
	}
	if n < 0 {
		return 0, fmt.Errorf("x-delivery-count %d is negative", n)
	}
	return n, nil
}

// headerToString returns the string form of any AMQP field value as
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
func headerToString(v interface{}) (string, error) {
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

// AMQP 0-9-1 field value type tags, as RabbitMQ and amqp091-go write them
// ("AMQP 0-9-1 Errata", field table types; amqp091-go write.go/read.go).
const (
	tagBool      = 't'
	tagInt8      = 'b'
	tagUint8     = 'B'
	tagInt16     = 's'
	tagUint16    = 'u'
	tagInt32     = 'I'
	tagUint32    = 'i'
	tagInt64     = 'l'
	tagFloat32   = 'f'
	tagFloat64   = 'd'
	tagDecimal   = 'D'
	tagLongStr   = 'S'
	tagBytes     = 'x'
	tagTimestamp = 'T'
	tagTable     = 'F'
	tagArray     = 'A'
	tagVoid      = 'V'
)

// wireTyped reports whether v is made only of the Go types amqp091-go
// decodes AMQP field values into (so that it can be encoded and decoded back
// into the same Go value): nil, bool, uint8, int8, int16, uint16, int32,
// uint32, int64, float32, float64, amqp.Decimal, string, []byte, time.Time
// with whole seconds, amqp.Table with keys of at most 255 bytes, and
// []interface{} of these, nested at most maxFieldDepth levels. Other Go types
// (int, uint64, map[string]interface{}, ...) cannot arrive from the broker.
func wireTyped(v interface{}, depth int) bool {
	if depth > maxFieldDepth {
		return false
	}
	switch x := v.(type) {
	case nil, bool, uint8, int8, int16, uint16, int32, uint32, int64, float32, float64, amqp.Decimal, string, []byte:
		return true
	case time.Time:
		return x.Nanosecond() == 0
	case amqp.Table:
		for k, e := range x {
			if len(k) > 255 || !wireTyped(e, depth+1) {
				return false
			}
		}
		return true
	case []interface{}:
		for _, e := range x {
			if !wireTyped(e, depth+1) {
				return false
			}
		}
		return true
	}
	return false
}

// fieldSize returns the number of bytes the AMQP field value v takes on the
// wire, type tag included, as amqp091-go encodes it. A value amqp091-go
// cannot encode counts as a long string of its string form (headerToString).
func fieldSize(v interface{}) int {
	return fieldSizeDepth(v, 0)
}

func fieldSizeDepth(v interface{}, depth int) int {
	if depth > maxFieldDepth {
		return 0
	}
	switch x := v.(type) {
	case nil:
		return 1
	case bool, uint8, int8:
		return 2
	case int16, uint16:
		return 3
	case int32, uint32, float32, int:
		return 5
	case int64, float64, time.Time:
		return 9
	case amqp.Decimal:
		return 6
	case string:
		return 5 + len(x)
	case []byte:
		return 5 + len(x)
	case amqp.Table:
		n := 5
		for k, e := range x {
			n += 1 + len(k) + fieldSizeDepth(e, depth+1)
		}
		return n
	case []interface{}:
		n := 5
		for _, e := range x {
			n += fieldSizeDepth(e, depth+1)
		}
		return n
	}
	s, _ := headerToString(v)
	return 5 + len(s)
}

// encodeTypedHeaders encodes t, whose values must satisfy wireTyped, as an
// AMQP 0-9-1 field table (the encoding of message headers on the wire: keys
// in sorted order, so the result is deterministic) in standard base64. It
// returns an error for a value wireTyped rejects.
func encodeTypedHeaders(t amqp.Table) (string, error) {
	var b []byte
	b, err := appendTable(b, t, 0)
	if err != nil {
		return "", err
	}
	// The outer long-string length is implied by the base64 text.
	return base64.StdEncoding.EncodeToString(b[4:]), nil
}

func appendTable(b []byte, t amqp.Table, depth int) ([]byte, error) {
	if depth > maxFieldDepth {
		return nil, fmt.Errorf("header value nested deeper than %d levels", maxFieldDepth)
	}
	start := len(b)
	b = append(b, 0, 0, 0, 0) // length, filled in below
	keys := make([]string, 0, len(t))
	for k := range t {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if len(k) > 255 {
			return nil, fmt.Errorf("table key %q... longer than 255 bytes", truncateForError(k))
		}
		b = append(b, byte(len(k)))
		b = append(b, k...)
		var err error
		if b, err = appendField(b, t[k], depth+1); err != nil {
			return nil, fmt.Errorf("field %q: %w", truncateForError(k), err)
		}
	}
	n := len(b) - start - 4
	if uint64(n) > math.MaxUint32 {
		return nil, errors.New("table longer than 4 GiB")
	}
	binary.BigEndian.PutUint32(b[start:], uint32(n))
	return b, nil
}

func appendField(b []byte, v interface{}, depth int) ([]byte, error) {
	if depth > maxFieldDepth {
		return nil, fmt.Errorf("header value nested deeper than %d levels", maxFieldDepth)
	}
	switch x := v.(type) {
	case nil:
		return append(b, tagVoid), nil
	case bool:
		if x {
			return append(b, tagBool, 1), nil
		}
		return append(b, tagBool, 0), nil
	case uint8:
		return append(b, tagUint8, x), nil
	case int8:
		return append(b, tagInt8, byte(x)), nil
	case int16:
		return binary.BigEndian.AppendUint16(append(b, tagInt16), uint16(x)), nil
	case uint16:
		return binary.BigEndian.AppendUint16(append(b, tagUint16), x), nil
	case int32:
		return binary.BigEndian.AppendUint32(append(b, tagInt32), uint32(x)), nil
	case uint32:
		return binary.BigEndian.AppendUint32(append(b, tagUint32), x), nil
	case int64:
		return binary.BigEndian.AppendUint64(append(b, tagInt64), uint64(x)), nil
	case float32:
		return binary.BigEndian.AppendUint32(append(b, tagFloat32), math.Float32bits(x)), nil
	case float64:
		return binary.BigEndian.AppendUint64(append(b, tagFloat64), math.Float64bits(x)), nil
	case amqp.Decimal:
		return binary.BigEndian.AppendUint32(append(b, tagDecimal, x.Scale), uint32(x.Value)), nil
	case string:
		if uint64(len(x)) > math.MaxUint32 {
			return nil, errors.New("string longer than 4 GiB")
		}
		b = binary.BigEndian.AppendUint32(append(b, tagLongStr), uint32(len(x)))
		return append(b, x...), nil
	case []byte:
		if uint64(len(x)) > math.MaxUint32 {
			return nil, errors.New("byte array longer than 4 GiB")
		}
		b = binary.BigEndian.AppendUint32(append(b, tagBytes), uint32(len(x)))
		return append(b, x...), nil
	case time.Time:
		if x.Nanosecond() != 0 {
			return nil, errors.New("timestamp with a fraction of a second (AMQP timestamps are whole seconds)")
		}
		return binary.BigEndian.AppendUint64(append(b, tagTimestamp), uint64(x.Unix())), nil
	case amqp.Table:
		return appendTable(append(b, tagTable), x, depth)
	case []interface{}:
		b = append(b, tagArray)
		start := len(b)
		b = append(b, 0, 0, 0, 0)
		for i, e := range x {
			var err error
			if b, err = appendField(b, e, depth+1); err != nil {
				return nil, fmt.Errorf("element %d: %w", i, err)
			}
		}
		n := len(b) - start - 4
		if uint64(n) > math.MaxUint32 {
			return nil, errors.New("array longer than 4 GiB")
		}
		binary.BigEndian.PutUint32(b[start:], uint32(n))
		return b, nil
	}
	return nil, fmt.Errorf("unsupported AMQP field value of type %s", typeName(v))
}

// decodeTypedHeaders is the inverse of encodeTypedHeaders. Values come back
// as the Go types amqp091-go decodes them into: a timestamp as
// time.Unix(seconds, 0), an empty array as a nil []interface{}, a byte array
// as a non-nil []byte. It returns an error, never panics, for text that is
// not base64 or not a well-formed field table (unknown type tag, a length
// beyond the end, nesting deeper than 64 levels, trailing bytes).
func decodeTypedHeaders(s string) (amqp.Table, error) {
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		return nil, fmt.Errorf("typed headers are not base64: %w", err)
	}
	t, err := readTableBody(b, 0)
	if err != nil {
		return nil, fmt.Errorf("typed headers: %w", err)
	}
	return t, nil
}

var errShortField = errors.New("field table ends inside a value")

func readTableBody(b []byte, depth int) (amqp.Table, error) {
	if depth > maxFieldDepth {
		return nil, fmt.Errorf("nested deeper than %d levels", maxFieldDepth)
	}
	t := amqp.Table{}
	for len(b) > 0 {
		kl := int(b[0])
		if len(b) < 1+kl {
			return nil, errShortField
		}
		k := string(b[1 : 1+kl])
		v, rest, err := readFieldValue(b[1+kl:], depth+1)
		if err != nil {
			return nil, fmt.Errorf("field %q: %w", truncateForError(k), err)
		}
		t[k] = v
		b = rest
	}
	return t, nil
}

// readFieldValue reads one tagged field value from b and returns it with the
// bytes after it.
func readFieldValue(b []byte, depth int) (interface{}, []byte, error) {
	if depth > maxFieldDepth {
		return nil, nil, fmt.Errorf("nested deeper than %d levels", maxFieldDepth)
	}
	if len(b) == 0 {
		return nil, nil, errShortField
	}
	tag, b := b[0], b[1:]
	need := func(n int) error {
		if len(b) < n {
			return errShortField
		}
		return nil
	}
	sized := func() ([]byte, []byte, error) {
		if err := need(4); err != nil {
			return nil, nil, err
		}
		n := binary.BigEndian.Uint32(b)
		if uint64(len(b)-4) < uint64(n) {
			return nil, nil, errShortField
		}
		return b[4 : 4+n], b[4+n:], nil
	}
	switch tag {
	case tagVoid:
		return nil, b, nil
	case tagBool, tagUint8, tagInt8:
		if err := need(1); err != nil {
			return nil, nil, err
		}
		switch tag {
		case tagBool:
			return b[0] != 0, b[1:], nil
		case tagUint8:
			return b[0], b[1:], nil
		}
		return int8(b[0]), b[1:], nil
	case tagInt16, tagUint16:
		if err := need(2); err != nil {
			return nil, nil, err
		}
		u := binary.BigEndian.Uint16(b)
		if tag == tagInt16 {
			return int16(u), b[2:], nil
		}
		return u, b[2:], nil
	case tagInt32, tagUint32, tagFloat32:
		if err := need(4); err != nil {
			return nil, nil, err
		}
		u := binary.BigEndian.Uint32(b)
		switch tag {
		case tagInt32:
			return int32(u), b[4:], nil
		case tagUint32:
			return u, b[4:], nil
		}
		return math.Float32frombits(u), b[4:], nil
	case tagInt64, tagFloat64, tagTimestamp:
		if err := need(8); err != nil {
			return nil, nil, err
		}
		u := binary.BigEndian.Uint64(b)
		switch tag {
		case tagInt64:
			return int64(u), b[8:], nil
		case tagFloat64:
			return math.Float64frombits(u), b[8:], nil
		}
		return time.Unix(int64(u), 0), b[8:], nil
	case tagDecimal:
		if err := need(5); err != nil {
			return nil, nil, err
		}
		return amqp.Decimal{Scale: b[0], Value: int32(binary.BigEndian.Uint32(b[1:]))}, b[5:], nil
	case tagLongStr, tagBytes:
		v, rest, err := sized()
		if err != nil {
			return nil, nil, err
		}
		if tag == tagLongStr {
			return string(v), rest, nil
		}
		return append([]byte{}, v...), rest, nil
	case tagTable:
		v, rest, err := sized()
		if err != nil {
			return nil, nil, err
		}
		t, err := readTableBody(v, depth)
		if err != nil {
			return nil, nil, err
		}
		return t, rest, nil
	case tagArray:
		v, rest, err := sized()
		if err != nil {
			return nil, nil, err
		}
		var arr []interface{}
		for len(v) > 0 {
			var e interface{}
			if e, v, err = readFieldValue(v, depth+1); err != nil {
				return nil, nil, fmt.Errorf("element %d: %w", len(arr), err)
			}
			arr = append(arr, e)
		}
		return arr, rest, nil
	}
	return nil, nil, fmt.Errorf("unknown field type %q", tag)
}
