package amqpretry_test

import (
	"encoding/json"
	"math"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
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
	j, err := amqpretry.HeadersToJSON(h)
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
	if j, err := amqpretry.HeadersToJSON(nil); j != nil || err != nil {
		t.Errorf("nil headers: %v %v", j, err)
	}
	if _, err := amqpretry.HeadersToJSON(amqp.Table{"bad": struct{}{}}); err == nil {
		t.Error("unsupported value type: no error")
	}
}
