package wire

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sort"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// Encodable reports whether v can be kept with its AMQP type by
// EncodeHeaderTable: it is made only of the Go types amqp091-go decodes
// AMQP field values into (see wireTyped).
func Encodable(v interface{}) bool { return wireTyped(v, 0) }

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

// FieldSize returns the number of bytes the AMQP field value v takes on the
// wire, type tag included, as amqp091-go encodes it. A value amqp091-go
// cannot encode counts as a long string of its string form (HeaderString).
func FieldSize(v interface{}) int {
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
	s, _ := HeaderString(v)
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

// appendField appends v as a tagged AMQP field value, as amqp091-go writes
// it. Complexity (gocyclo 26): one case per AMQP type tag, the wire format's
// table; splitting it would scatter that table.
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
	if n := fixedWidth(tag); n >= 0 {
		if len(b) < n {
			return nil, nil, errShortField
		}
		return decodeFixed(tag, b[:n]), b[n:], nil
	}
	switch tag {
	case tagLongStr, tagBytes, tagTable, tagArray:
	default:
		return nil, nil, fmt.Errorf("unknown field type %q", tag)
	}
	if len(b) < 4 {
		return nil, nil, errShortField
	}
	n := binary.BigEndian.Uint32(b)
	if uint64(len(b)-4) < uint64(n) {
		return nil, nil, errShortField
	}
	v, rest := b[4:4+n], b[4+n:]
	switch tag {
	case tagLongStr:
		return string(v), rest, nil
	case tagBytes:
		return append([]byte{}, v...), rest, nil
	case tagTable:
		t, err := readTableBody(v, depth)
		if err != nil {
			return nil, nil, err
		}
		return t, rest, nil
	}
	arr, err := readArrayBody(v, depth)
	if err != nil {
		return nil, nil, err
	}
	return arr, rest, nil
}

// fixedWidth returns the size of the value after a fixed-width type tag,
// or -1 for a tag with a length prefix (string, bytes, table, array) or an
// unknown tag.
func fixedWidth(tag byte) int {
	switch tag {
	case tagVoid:
		return 0
	case tagBool, tagUint8, tagInt8:
		return 1
	case tagInt16, tagUint16:
		return 2
	case tagInt32, tagUint32, tagFloat32:
		return 4
	case tagDecimal:
		return 5
	case tagInt64, tagFloat64, tagTimestamp:
		return 8
	}
	return -1
}

// decodeFixed decodes the fixed-width value b (exactly fixedWidth(tag)
// bytes) into the Go type amqp091-go uses for tag. One case per AMQP type
// tag: the complexity is the wire format's table.
func decodeFixed(tag byte, b []byte) interface{} {
	switch tag {
	case tagBool:
		return b[0] != 0
	case tagUint8:
		return b[0]
	case tagInt8:
		return int8(b[0])
	case tagInt16:
		return int16(binary.BigEndian.Uint16(b))
	case tagUint16:
		return binary.BigEndian.Uint16(b)
	case tagInt32:
		return int32(binary.BigEndian.Uint32(b))
	case tagUint32:
		return binary.BigEndian.Uint32(b)
	case tagFloat32:
		return math.Float32frombits(binary.BigEndian.Uint32(b))
	case tagInt64:
		return int64(binary.BigEndian.Uint64(b))
	case tagFloat64:
		return math.Float64frombits(binary.BigEndian.Uint64(b))
	case tagTimestamp:
		return time.Unix(int64(binary.BigEndian.Uint64(b)), 0)
	case tagDecimal:
		return amqp.Decimal{Scale: b[0], Value: int32(binary.BigEndian.Uint32(b[1:]))}
	}
	return nil // tagVoid
}

// readArrayBody decodes the elements of a field array whose length prefix
// was already read.
func readArrayBody(v []byte, depth int) ([]interface{}, error) {
	var arr []interface{}
	for len(v) > 0 {
		var e interface{}
		var err error
		if e, v, err = readFieldValue(v, depth+1); err != nil {
			return nil, fmt.Errorf("element %d: %w", len(arr), err)
		}
		arr = append(arr, e)
	}
	return arr, nil
}
