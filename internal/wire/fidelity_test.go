package wire

import (
	"bytes"
	"encoding/base64"
	"encoding/binary"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// sameWireValue reports whether a and b encode to the same AMQP field value
// (same type tag and bytes; a timestamp's time zone does not matter).
func sameWireValue(a, b interface{}) bool {
	ea, errA := appendField(nil, a, 0)
	eb, errB := appendField(nil, b, 0)
	return errA == nil && errB == nil && bytes.Equal(ea, eb)
}

// allWireTypes has one header of every AMQP field type amqp091-go decodes,
// as it decodes them (a timestamp as time.Unix(s, 0), an empty array as a
// nil slice).
func allWireTypes() amqp.Table {
	return amqp.Table{
		"t": true, "f": false, "b": int8(-128), "B": uint8(255), "s": int16(math.MinInt16), "u": uint16(math.MaxUint16),
		"I": int32(math.MinInt32), "i": uint32(math.MaxUint32), "l": int64(math.MinInt64), "l-max": int64(math.MaxInt64),
		"f32": float32(-0.1), "f64": math.Inf(-1), "f32-nan": float32(math.NaN()), "D": amqp.Decimal{Scale: 255, Value: math.MinInt32},
		"S": "text\x00with nul", "x": []byte{0, 1, 0xff}, "x-empty": []byte{}, "T": time.Unix(-62135596800, 0), "T-now": time.Unix(1732345678, 0),
		"F": amqp.Table{"k": amqp.Table{"kk": []interface{}{int16(1), nil}}, "": "empty key"}, "F-empty": amqp.Table{},
		"A": []interface{}{int8(1), "s", []interface{}(nil), amqp.Table{"a": []byte("b")}, nil}, "A-empty": []interface{}(nil), "V": nil,
		strings.Repeat("k", 255): int32(1),
	}
}

func TestTypedHeadersEncoding(t *testing.T) {
	h := allWireTypes()
	enc, err := encodeTypedHeaders(h)
	if err != nil {
		t.Fatal(err)
	}
	got, err := decodeTypedHeaders(enc)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range h {
		g := got[k]
		if !sameWireValue(v, g) || reflect.TypeOf(v) != reflect.TypeOf(g) {
			t.Errorf("%q: decoded %T %#v, want %T %#v", k, g, g, v, v)
		}
		if f, ok := v.(float32); !ok || !math.IsNaN(float64(f)) { // NaN != NaN
			if !reflect.DeepEqual(v, g) {
				t.Errorf("%q: decoded %#v, not DeepEqual to %#v", k, g, v)
			}
		}
	}
	if len(got) != len(h) {
		t.Errorf("decoded %d headers, want %d", len(got), len(h))
	}
	// The encoding is deterministic (keys in order) and its size is what
	// encodedHeaderBytes counts for the table.
	enc2, _ := encodeTypedHeaders(got)
	if enc2 != enc {
		t.Error("re-encoding differs")
	}
	raw, _ := base64.StdEncoding.DecodeString(enc)
	if n := HeaderBytes(h); n != len(raw)+4 {
		t.Errorf("encodedHeaderBytes = %d, the encoded table takes %d", n, len(raw)+4)
	}
	// Values that cannot arrive from the broker are not wire-typed.
	for _, v := range []interface{}{int(1), uint(1), uint64(1), map[string]interface{}{}, []string{"a"}, []amqp.Table{{}},
		time.Unix(1, 5), struct{}{}, amqp.Table{strings.Repeat("k", 256): 1}, []interface{}{int(1)}} {
		if wireTyped(v, 0) {
			t.Errorf("wireTyped(%T %#v) = true", v, v)
		}
	}
	// Malformed input: errors, no panic.
	for _, s := range []string{"!", base64.StdEncoding.EncodeToString([]byte{3, 'a', 'b'}),
		base64.StdEncoding.EncodeToString([]byte{1, 'a', 'Z'}),
		base64.StdEncoding.EncodeToString([]byte{1, 'a', 'S', 0xff, 0xff, 0xff, 0xff}),
		base64.StdEncoding.EncodeToString([]byte{1, 'a', 'l', 1, 2}),
		base64.StdEncoding.EncodeToString(nestedArrays(200))} {
		if _, err := decodeTypedHeaders(s); err == nil {
			t.Errorf("decodeTypedHeaders(%q) accepted malformed input", s)
		}
	}
}

// nestedArrays returns a table {"a": [[[...]]]} nested n arrays deep.
func nestedArrays(n int) []byte {
	inner := []byte{}
	for range n {
		b := binary.BigEndian.AppendUint32([]byte{tagArray}, uint32(len(inner)))
		inner = append(b, inner...)
	}
	return append([]byte{1, 'a'}, inner...)
}

// genValue builds an AMQP field value from fuzz input.
func genValue(b []byte, depth int) (interface{}, []byte) {
	if len(b) == 0 {
		return nil, b
	}
	op, b := b[0], b[1:]
	take := func(n int) []byte {
		if n > len(b) {
			n = len(b)
		}
		v := b[:n]
		b = b[n:]
		return v
	}
	u64 := func() uint64 { var buf [8]byte; copy(buf[:], take(8)); return binary.BigEndian.Uint64(buf[:]) }
	switch op % 17 {
	case 0:
		return nil, b
	case 1:
		return u64()%2 == 1, b
	case 2:
		return int8(u64()), b
	case 3:
		return uint8(u64()), b
	case 4:
		return int16(u64()), b
	case 5:
		return uint16(u64()), b
	case 6:
		return int32(u64()), b
	case 7:
		return uint32(u64()), b
	case 8:
		return int64(u64()), b
	case 9:
		return math.Float32frombits(uint32(u64())), b
	case 10:
		return math.Float64frombits(u64()), b
	case 11:
		v := u64()
		return amqp.Decimal{Scale: uint8(v), Value: int32(v >> 8)}, b
	case 12:
		n := int(u64() % 16)
		return string(take(n)), b
	case 13:
		n := int(u64() % 16)
		return append([]byte{}, take(n)...), b
	case 14:
		return time.Unix(int64(u64()), 0), b
	case 15:
		if depth > 4 {
			return nil, b
		}
		n := int(u64() % 4)
		t := amqp.Table{}
		for i := range n {
			var v interface{}
			v, b = genValue(b, depth+1)
			t[string(rune('a'+i))+string(take(int(i)))] = v
		}
		return t, b
	default:
		if depth > 4 {
			return nil, b
		}
		n := int(u64() % 4)
		var a []interface{}
		for range n {
			var v interface{}
			v, b = genValue(b, depth+1)
			a = append(a, v)
		}
		return a, b
	}
}

// FuzzTypedHeaders: any table of AMQP field values encodes, decodes to the
// same wire values with the same Go types, and re-encodes identically; its
// string form (what the handler sees) is unchanged, so Marshal restores it;
// encodedHeaderBytes matches the encoding. Arbitrary text never makes
// decodeTypedHeaders panic, and what it accepts round-trips.
func FuzzTypedHeaders(f *testing.F) {
	f.Add([]byte{15, 0, 0, 0, 0, 0, 0, 0, 3, 8, 1, 2, 3, 4, 5, 6, 7, 8, 16, 0, 0, 0, 0, 0, 0, 0, 2, 12, 0, 0, 0, 0, 0, 0, 0, 3, 'a', 'b', 'c'}, "x")
	f.Add([]byte{14, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, "AQFhVg==")
	f.Add([]byte{10, 0x7f, 0xf8, 0, 0, 0, 0, 0, 1}, "")
	f.Fuzz(func(t *testing.T, in []byte, text string) {
		h := amqp.Table{}
		for i := 0; len(in) > 0 && i < 8; i++ {
			var v interface{}
			v, in = genValue(in, 0)
			h[string(rune('A'+i))] = v
		}
		enc, err := encodeTypedHeaders(h)
		if err != nil {
			t.Fatalf("encode: %v", err)
		}
		got, err := decodeTypedHeaders(enc)
		if err != nil {
			t.Fatalf("decode: %v", err)
		}
		if len(got) != len(h) {
			t.Fatalf("%d headers decoded, want %d", len(got), len(h))
		}
		for k, v := range h {
			if !sameWireValue(v, got[k]) || reflect.TypeOf(v) != reflect.TypeOf(got[k]) {
				t.Fatalf("%q: %T %#v decoded as %T %#v", k, v, v, got[k], got[k])
			}
			s1, err1 := HeaderString(v)
			s2, err2 := HeaderString(got[k])
			if err1 != nil || err2 != nil || s1 != s2 {
				t.Fatalf("%q: string form %q (%v) became %q (%v)", k, s1, err1, s2, err2)
			}
		}
		if enc2, _ := encodeTypedHeaders(got); enc2 != enc {
			t.Fatal("re-encoding differs")
		}
		raw, _ := base64.StdEncoding.DecodeString(enc)
		if HeaderBytes(h) != len(raw)+4 {
			t.Fatalf("encodedHeaderBytes %d, encoding %d", HeaderBytes(h), len(raw)+4)
		}
		if dt, err := decodeTypedHeaders(text); err == nil {
			e, err := encodeTypedHeaders(dt)
			if err != nil {
				t.Fatalf("decoded %q but cannot encode it: %v", text, err)
			}
			if again, err := decodeTypedHeaders(e); err != nil || len(again) != len(dt) {
				t.Fatalf("round trip of accepted input: %v", err)
			}
		}
	})
}

// The Marshaler restores every user header with its type, keeps the
// handler's string when it changed one, drops a header it deleted, never
// types the library's own keys, and ignores a TypedHeadersKey that arrives
// as a header.
