package wire

import (
	"encoding/json"
	"math"
	"reflect"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

func TestHeadersToJSON(t *testing.T) {
	h := amqp.Table{
		"s":   "text",
		"b":   []byte{0xff, 0x00, 'a'},
		"i":   int64(math.MaxInt64),
		"d":   amqp.Decimal{Scale: 2, Value: -5},
		"f":   math.NaN(),
		"t":   time.Date(2026, 11, 24, 9, 0, 0, 0, time.FixedZone("x", 3600)),
		"ok":  true,
		"nil": nil,
		"tab": amqp.Table{"inner": []any{int32(1), []byte("hi"), amqp.Table{"deep": "x"}}},
		"arr": []amqp.Table{{"count": int64(2)}},
	}
	j, err := HeadersToJSON(h)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(j)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"arr":[{"count":2}],"b":"/wBh","d":-0.05,"f":"NaN","i":9223372036854775807,"nil":null,"ok":true,"s":"text","t":"2026-11-24T08:00:00Z","tab":{"inner":[1,"aGk=",{"deep":"x"}]}}`
	if string(b) != want {
		t.Fatalf("got  %s\nwant %s", b, want)
	}
	if j, err := HeadersToJSON(nil); j != nil || err != nil {
		t.Errorf("nil headers: %v %v", j, err)
	}
	if _, err := HeadersToJSON(amqp.Table{"bad": struct{}{}}); err == nil {
		t.Error("unsupported value type: no error")
	}
}

// EncodeHeaderTable / DecodeHeaderTable keep every AMQP field type
// amqp091-go reads and writes (t b B s u I i l f d D S x T F A V), value
// and Go type, where the JSON form loses them.
func TestHeaderTableRoundTrip(t *testing.T) {
	h := amqp.Table{
		"t": true, "b": int8(-8), "B": uint8(200), "s": int16(-16000), "u": uint16(65000),
		"I": int32(-7), "i": uint32(4_000_000_000), "l": int64(1)<<53 + 1, "f": float32(1.5), "d": float64(3),
		"D": amqp.Decimal{Scale: 2, Value: -12345}, "S": "héllo", "x": []byte{0, 0xff}, "T": time.Unix(1_790_000_000, 0),
		"F": amqp.Table{"n": int32(1)}, "A": []any{int64(2), "a", []byte{1}}, "V": nil,
	}
	enc, err := EncodeHeaderTable(h)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeHeaderTable(enc)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, h) {
		t.Fatalf("round trip:\n got %#v\nwant %#v", got, h)
	}
	if _, err := EncodeHeaderTable(amqp.Table{"bad": struct{}{}}); err == nil {
		t.Fatal("a value of no AMQP type encoded")
	}
	if _, err := DecodeHeaderTable("not base64!"); err == nil {
		t.Fatal("garbage decoded")
	}
	if tb, err := DecodeHeaderTable(""); tb != nil || err != nil {
		t.Fatalf("empty: %v %v", tb, err)
	}
}
