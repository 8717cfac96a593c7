package wire

import (
	"encoding/json"
	"math"
	"reflect"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	amqp "github.com/rabbitmq/amqp091-go"
)

var xdeathTestTime = time.Date(2024, 5, 6, 7, 8, 9, 0, time.UTC)

// brokerXDeathEntry returns an x-death entry shaped as amqp091-go decodes it
// from RabbitMQ: count int64, time time.Time (local zone), routing-keys
// []interface{} of string.
func brokerXDeathEntry(queue, reason string, count interface{}) amqp.Table {
	return amqp.Table{
		"queue":        queue,
		"reason":       reason,
		"count":        count,
		"exchange":     "orders",
		"routing-keys": []interface{}{"order.created"},
		"time":         xdeathTestTime.Local(),
	}
}

func TestDeathRecordsFromTable(t *testing.T) {
	want1 := DeathRecord{
		Queue: "A", Reason: "rejected", Count: 3, Exchange: "orders",
		RoutingKeys: []string{"order.created"}, Time: xdeathTestTime,
	}
	withCount := func(n int64) []DeathRecord {
		r := want1
		r.Count = n
		return []DeathRecord{r}
	}
	thousand := make([]interface{}, 1000)
	for i := range thousand {
		thousand[i] = brokerXDeathEntry("A", "rejected", int64(1))
	}
	maxOK := make([]interface{}, MaxDeathRecords)
	for i := range maxOK {
		maxOK[i] = brokerXDeathEntry("Q"+strconv.Itoa(i), "expired", int64(i))
	}

	tests := []struct {
		name    string
		in      interface{}
		want    []DeathRecord
		wantLen int    // checked instead of want when > 0
		wantErr string // substring; "" means no error
	}{
		{name: "broker shape", in: []interface{}{brokerXDeathEntry("A", "rejected", int64(3))}, want: withCount(3)},
		{name: "two entries keep order", in: []interface{}{
			brokerXDeathEntry("B", "expired", int64(2)),
			brokerXDeathEntry("A", "rejected", int64(3)),
		}, want: []DeathRecord{
			{Queue: "B", Reason: "expired", Count: 2, Exchange: "orders", RoutingKeys: []string{"order.created"}, Time: xdeathTestTime},
			want1,
		}},
		{name: "[]amqp.Table", in: []amqp.Table{brokerXDeathEntry("A", "rejected", int64(3))}, want: withCount(3)},
		{name: "[]map entries", in: []map[string]interface{}{map[string]interface{}(brokerXDeathEntry("A", "rejected", int64(3)))}, want: withCount(3)},
		{name: "map entry in []interface{}", in: []interface{}{map[string]interface{}(brokerXDeathEntry("A", "rejected", int64(3)))}, want: withCount(3)},
		{name: "count int", in: []interface{}{brokerXDeathEntry("A", "rejected", 3)}, want: withCount(3)},
		{name: "count int8", in: []interface{}{brokerXDeathEntry("A", "rejected", int8(3))}, want: withCount(3)},
		{name: "count int16", in: []interface{}{brokerXDeathEntry("A", "rejected", int16(3))}, want: withCount(3)},
		{name: "count int32", in: []interface{}{brokerXDeathEntry("A", "rejected", int32(3))}, want: withCount(3)},
		{name: "count int64", in: []interface{}{brokerXDeathEntry("A", "rejected", int64(3))}, want: withCount(3)},
		{name: "count uint", in: []interface{}{brokerXDeathEntry("A", "rejected", uint(3))}, want: withCount(3)},
		{name: "count uint8", in: []interface{}{brokerXDeathEntry("A", "rejected", uint8(3))}, want: withCount(3)},
		{name: "count uint16", in: []interface{}{brokerXDeathEntry("A", "rejected", uint16(3))}, want: withCount(3)},
		{name: "count uint32", in: []interface{}{brokerXDeathEntry("A", "rejected", uint32(3))}, want: withCount(3)},
		{name: "count uint64", in: []interface{}{brokerXDeathEntry("A", "rejected", uint64(3))}, want: withCount(3)},
		{name: "count float64 integral", in: []interface{}{brokerXDeathEntry("A", "rejected", float64(3))}, want: withCount(3)},
		{name: "count float32 integral", in: []interface{}{brokerXDeathEntry("A", "rejected", float32(3))}, want: withCount(3)},
		{name: "count string", in: []interface{}{brokerXDeathEntry("A", "rejected", "3")}, want: withCount(3)},
		{name: "count bytes", in: []interface{}{brokerXDeathEntry("A", "rejected", []byte("3"))}, want: withCount(3)},
		{name: "count zero", in: []interface{}{brokerXDeathEntry("A", "rejected", int64(0))}, want: withCount(0)},
		{name: "count MaxInt32", in: []interface{}{brokerXDeathEntry("A", "rejected", int64(math.MaxInt32))}, want: withCount(math.MaxInt32)},
		{name: "count missing counts as one", in: []interface{}{amqp.Table{"queue": "A", "reason": "rejected"}},
			want: []DeathRecord{{Queue: "A", Reason: "rejected", Count: 1}}},
		{name: "routing-keys []string", in: []interface{}{amqp.Table{"queue": "A", "reason": "rejected", "count": int64(1), "routing-keys": []string{"a", "b"}}},
			want: []DeathRecord{{Queue: "A", Reason: "rejected", Count: 1, RoutingKeys: []string{"a", "b"}}}},
		{name: "time RFC 3339 string", in: []interface{}{amqp.Table{"queue": "A", "count": int64(1), "time": "2024-05-06T09:08:09+02:00"}},
			want: []DeathRecord{{Queue: "A", Count: 1, Time: xdeathTestTime}}},
		{name: "original-expiration ignored", in: []interface{}{amqp.Table{"queue": "A", "reason": "expired", "count": int64(1), "original-expiration": "1000"}},
			want: []DeathRecord{{Queue: "A", Reason: "expired", Count: 1}}},
		{name: "nil", in: nil, want: nil},
		{name: "empty array", in: []interface{}{}, want: []DeathRecord{}},
		{name: "exactly MaxDeathRecords", in: maxOK, wantLen: MaxDeathRecords},

		{name: "count abc", in: []interface{}{brokerXDeathEntry("A", "rejected", "abc")}, wantErr: "entry 0: count"},
		{name: "count negative", in: []interface{}{brokerXDeathEntry("A", "rejected", int64(-5))}, wantErr: "negative"},
		{name: "count negative string", in: []interface{}{brokerXDeathEntry("A", "rejected", "-5")}, wantErr: "negative"},
		{name: "count huge int64", in: []interface{}{brokerXDeathEntry("A", "rejected", int64(math.MaxInt32)+1)}, wantErr: "count out of range"},
		{name: "count huge uint64", in: []interface{}{brokerXDeathEntry("A", "rejected", uint64(math.MaxUint64))}, wantErr: "out of range"},
		{name: "count huge string", in: []interface{}{brokerXDeathEntry("A", "rejected", "99999999999999999999999")}, wantErr: "out of range"},
		{name: "count fractional", in: []interface{}{brokerXDeathEntry("A", "rejected", 1.5)}, wantErr: "not an integer"},
		{name: "count NaN", in: []interface{}{brokerXDeathEntry("A", "rejected", math.NaN())}, wantErr: "not an integer"},
		{name: "count bool", in: []interface{}{brokerXDeathEntry("A", "rejected", true)}, wantErr: "not an integer"},
		{name: "missing queue", in: []interface{}{amqp.Table{"reason": "rejected", "count": int64(1)}}, wantErr: "entry 0: missing queue"},
		{name: "empty queue", in: []interface{}{amqp.Table{"queue": "", "count": int64(1)}}, wantErr: "queue is empty"},
		{name: "queue not a string", in: []interface{}{amqp.Table{"queue": int64(7), "count": int64(1)}}, wantErr: "queue is int64"},
		{name: "second entry bad", in: []interface{}{brokerXDeathEntry("A", "rejected", int64(1)), amqp.Table{"count": int64(1)}}, wantErr: "entry 1: missing queue"},
		{name: "entry not a table", in: []interface{}{"A"}, wantErr: "entry 0 is string, not a table"},
		{name: "entry nil", in: []interface{}{nil}, wantErr: "entry 0 is void"},
		{name: "reason not a string", in: []interface{}{amqp.Table{"queue": "A", "reason": int64(1)}}, wantErr: "reason"},
		{name: "exchange not a string", in: []interface{}{amqp.Table{"queue": "A", "exchange": true}}, wantErr: "exchange"},
		{name: "routing key not a string", in: []interface{}{amqp.Table{"queue": "A", "routing-keys": []interface{}{"a", int64(1)}}}, wantErr: "routing key 1"},
		{name: "routing-keys not an array", in: []interface{}{amqp.Table{"queue": "A", "routing-keys": "a"}}, wantErr: "routing-keys"},
		{name: "time wrong type", in: []interface{}{amqp.Table{"queue": "A", "time": int64(5)}}, wantErr: "time"},
		{name: "time year out of JSON range", in: []interface{}{amqp.Table{"queue": "A", "time": time.Unix(1<<40, 0)}}, wantErr: "time out of range"},
		{name: "time bad string", in: []interface{}{amqp.Table{"queue": "A", "time": "yesterday"}}, wantErr: "time"},
		{name: "header is a string", in: `[{"queue":"A"}]`, wantErr: "not an array"},
		{name: "header is a table", in: amqp.Table{"queue": "A"}, wantErr: "not an array"},
		{name: "1000 entries", in: thousand, wantErr: "more than the 256"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DeathRecordsFromTable(tc.in)
			if tc.wantErr != "" {
				if err == nil {
					t.Fatalf("got %+v, want error containing %q", got, tc.wantErr)
				}
				if !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %q does not contain %q", err, tc.wantErr)
				}
				if !strings.Contains(err.Error(), "x-death") {
					t.Errorf("error %q does not name the header", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if tc.wantLen > 0 {
				if len(got) != tc.wantLen {
					t.Fatalf("got %d records, want %d", len(got), tc.wantLen)
				}
				return
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got  %#v\nwant %#v", got, tc.want)
			}
			// What the Marshaler stores must parse back to the same records.
			if got != nil {
				back, err := ParseXDeath(EncodeXDeath(got))
				if err != nil {
					t.Fatalf("ParseXDeath: %v", err)
				}
				if len(got) == 0 && len(back) == 0 {
					return
				}
				if !reflect.DeepEqual(back, got) {
					t.Fatalf("round trip: got %#v, want %#v", back, got)
				}
			}
		})
	}
}

func TestDeliveryCount(t *testing.T) {
	ok := []struct {
		in   interface{}
		want int64
	}{
		{int64(1), 1}, {int64(0), 0}, {int(7), 7}, {int8(2), 2}, {int16(2), 2}, {int32(2), 2},
		{uint(2), 2}, {uint8(2), 2}, {uint16(2), 2}, {uint32(2), 2}, {uint64(2), 2},
		{float64(4), 4}, {"12", 12}, {int64(math.MaxInt64), math.MaxInt64},
	}
	for _, tc := range ok {
		got, err := Count("x-delivery-count", tc.in)
		if err != nil || got != tc.want {
			t.Errorf("DeliveryCount(%#v) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
	bad := []interface{}{nil, int64(-1), int8(-1), "x", "-3", 2.5, uint64(math.MaxUint64), true, amqp.Table{}}
	for _, in := range bad {
		if got, err := Count("x-delivery-count", in); err == nil {
			t.Errorf("DeliveryCount(%#v) = %d, want an error", in, got)
		} else if !strings.Contains(err.Error(), "x-delivery-count") {
			t.Errorf("DeliveryCount(%#v) error %q does not name the header", in, err)
		}
	}
}

func TestHeaderToString(t *testing.T) {
	ts := time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.UTC)
	tests := []struct {
		name string
		in   interface{}
		want string
	}{
		{"nil", nil, ""},
		{"string", "héllo", "héllo"},
		{"empty string", "", ""},
		{"bytes", []byte("raw\x00bytes"), "raw\x00bytes"},
		{"bool true", true, "true"},
		{"bool false", false, "false"},
		{"int", int(-42), "-42"},
		{"int8", int8(-128), "-128"},
		{"int16", int16(-32768), "-32768"},
		{"int32", int32(math.MinInt32), "-2147483648"},
		{"int64", int64(math.MaxInt64), "9223372036854775807"},
		{"uint", uint(42), "42"},
		{"uint8", uint8(255), "255"},
		{"uint16", uint16(65535), "65535"},
		{"uint32", uint32(math.MaxUint32), "4294967295"},
		{"uint64", uint64(math.MaxUint64), "18446744073709551615"},
		{"float32", float32(1.5), "1.5"},
		{"float32 shortest", float32(0.1), "0.1"},
		{"float64", 3.25, "3.25"},
		{"float64 large", 1e21, "1e+21"},
		{"float64 NaN", math.NaN(), "NaN"},
		{"float64 +Inf", math.Inf(1), "+Inf"},
		{"float64 -Inf", math.Inf(-1), "-Inf"},
		{"time UTC", ts, "2024-05-06T07:08:09.123456789Z"},
		{"time other zone", ts.In(time.FixedZone("X", 3600)), "2024-05-06T07:08:09.123456789Z"},
		{"decimal", amqp.Decimal{Scale: 2, Value: 12345}, "123.45"},
		{"decimal small", amqp.Decimal{Scale: 3, Value: 5}, "0.005"},
		{"decimal negative", amqp.Decimal{Scale: 2, Value: -5}, "-0.05"},
		{"decimal scale 0", amqp.Decimal{Scale: 0, Value: -7}, "-7"},
		{"decimal exact scale", amqp.Decimal{Scale: 2, Value: 99}, "0.99"},
		{"decimal min", amqp.Decimal{Scale: 1, Value: math.MinInt32}, "-214748364.8"},
		{"table", amqp.Table{"b": int64(2), "a": "x", "t": ts, "raw": []byte("r"), "v": nil, "ok": true},
			`{"a":"x","b":2,"ok":true,"raw":"r","t":"2024-05-06T07:08:09.123456789Z","v":null}`},
		{"nested", amqp.Table{"arr": []interface{}{int8(1), 2.5, amqp.Decimal{Scale: 1, Value: 15}, amqp.Table{"n": uint64(math.MaxUint64)}}},
			`{"arr":[1,2.5,1.5,{"n":18446744073709551615}]}`},
		{"table with NaN", amqp.Table{"f": math.NaN(), "g": math.Inf(-1)}, `{"f":"NaN","g":"-Inf"}`},
		{"plain map", map[string]interface{}{"k": "v"}, `{"k":"v"}`},
		{"array", []interface{}{"a", int64(1), nil, false}, `["a",1,null,false]`},
		{"empty array", []interface{}{}, `[]`},
		{"empty table", amqp.Table{}, `{}`},
		{"[]amqp.Table", []amqp.Table{{"q": "A"}}, `[{"q":"A"}]`},
		{"[]string", []string{"a", "b"}, `["a","b"]`},
		{"x-death as decoded", []interface{}{brokerXDeathEntry("A", "rejected", int64(1))},
			`[{"count":1,"exchange":"orders","queue":"A","reason":"rejected","routing-keys":["order.created"],"time":"2024-05-06T07:08:09Z"}]`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := HeaderString(tc.in)
			if err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if got != tc.want {
				t.Fatalf("got %q, want %q", got, tc.want)
			}
		})
	}

	// Unsupported Go types and cycles are errors, not panics.
	cyclic := amqp.Table{}
	cyclic["self"] = cyclic
	deep := interface{}("leaf")
	for i := 0; i < 100; i++ {
		deep = []interface{}{deep}
	}
	for name, in := range map[string]interface{}{
		"struct":         struct{ A int }{1},
		"chan":           make(chan int),
		"pointer":        new(int),
		"nested struct":  amqp.Table{"k": struct{}{}},
		"array of funcs": []interface{}{func() {}},
		"cyclic table":   cyclic,
		"too deep":       deep,
	} {
		if got, err := HeaderString(in); err == nil {
			t.Errorf("%s: got %q, want an error", name, got)
		}
	}
}

// FuzzDeathRecordsFromJSONLike builds an x-death value of n entries from
// fuzzed fields, in the shape amqp091-go decodes, and checks that the
// conversion accepts exactly the valid ones and that the result survives the
// EncodeXDeath / ParseXDeath round trip.
func FuzzDeathRecordsFromJSONLike(f *testing.F) {
	f.Add("orders", "rejected", int64(1), 1, "orders.ex", "key", int64(1714979289))
	f.Add("A", "expired", int64(3), 2, "", "", int64(0))
	f.Add("", "rejected", int64(1), 1, "", "", int64(0))
	f.Add("Q", "delivery_limit", int64(-1), 1, "x", "k", int64(-1))
	f.Add("Q", "maxlen", int64(math.MaxInt32)+1, 1, "x", "k", int64(1))
	f.Add("Q", "rejected", int64(1), 300, "x", "k", int64(1))
	f.Add("Q\x00\xff", "\u2603", int64(0), 0, "\xff", "\x00", int64(math.MaxInt64))
	f.Fuzz(func(t *testing.T, queue, reason string, count int64, n int, exchange, rk string, unix int64) {
		if n < 0 {
			n = -(n % 1000)
		}
		n %= 400
		ts := time.Unix(unix%(1<<40), 0) // amqp091-go decodes timestamps with time.Unix
		entries := make([]interface{}, n)
		for i := range entries {
			entries[i] = amqp.Table{
				"queue":        queue,
				"reason":       reason,
				"count":        count,
				"exchange":     exchange,
				"routing-keys": []interface{}{rk},
				"time":         ts,
			}
		}
		recs, err := DeathRecordsFromTable(entries)
		year := ts.UTC().Year()
		valid := queue != "" && count >= 0 && count <= math.MaxInt32 && year >= 0 && year <= 9999 &&
			n <= MaxDeathRecords
		if n == 0 {
			valid = true
		}
		if valid != (err == nil) {
			t.Fatalf("queue=%q count=%d n=%d: valid=%v but err=%v", queue, count, n, valid, err)
		}
		if err != nil {
			return
		}
		if len(recs) != n {
			t.Fatalf("got %d records, want %d", len(recs), n)
		}
		for _, r := range recs {
			if r.Queue != queue || r.Reason != reason || r.Count != count || r.Exchange != exchange ||
				len(r.RoutingKeys) != 1 || r.RoutingKeys[0] != rk || !r.Time.Equal(ts) {
				t.Fatalf("record %+v does not match the input", r)
			}
		}
		s := EncodeXDeath(recs)
		back, err := ParseXDeath(s)
		if err != nil {
			t.Fatalf("ParseXDeath(EncodeXDeath(...)): %v", err)
		}
		if len(back) != n {
			t.Fatalf("round trip: %d records, want %d", len(back), n)
		}
		for i := range back {
			// JSON replaces invalid UTF-8; compare only when it cannot.
			if validUTF8(queue, reason, exchange, rk) && !reflect.DeepEqual(back[i], recs[i]) {
				t.Fatalf("round trip: got %#v, want %#v", back[i], recs[i])
			}
			if back[i].Count != count || !back[i].Time.Equal(ts) {
				t.Fatalf("round trip changed count or time: %#v", back[i])
			}
		}
	})
}

func validUTF8(ss ...string) bool {
	for _, s := range ss {
		if !utf8.ValidString(s) {
			return false
		}
	}
	return true
}

// FuzzHeaderToString checks that HeaderString never panics, that numbers
// round-trip through their decimal form, and that tables and arrays give
// valid JSON whose fields match the input.
func FuzzHeaderToString(f *testing.F) {
	f.Add("s", int64(1), uint64(1), 1.5, []byte("b"), true, uint8(0), int32(0))
	f.Add("", int64(math.MinInt64), uint64(math.MaxUint64), math.Inf(1), []byte{}, false, uint8(255), int32(math.MinInt32))
	f.Add("\xff\x00\"\\", int64(-1), uint64(0), math.Copysign(0, -1), []byte("\xff"), false, uint8(9), int32(-1))
	f.Fuzz(func(t *testing.T, s string, i int64, u uint64, fl float64, b []byte, bo bool, scale uint8, dv int32) {
		mustStr := func(v interface{}) string {
			t.Helper()
			out, err := HeaderString(v)
			if err != nil {
				t.Fatalf("HeaderString(%#v): %v", v, err)
			}
			return out
		}
		if got := mustStr(s); got != s {
			t.Fatalf("string %q became %q", s, got)
		}
		if got := mustStr(b); got != string(b) {
			t.Fatalf("bytes %q became %q", b, got)
		}
		if n, err := strconv.ParseInt(mustStr(i), 10, 64); err != nil || n != i {
			t.Fatalf("int64 %d did not round-trip: %d, %v", i, n, err)
		}
		if n, err := strconv.ParseUint(mustStr(u), 10, 64); err != nil || n != u {
			t.Fatalf("uint64 %d did not round-trip: %d, %v", u, n, err)
		}
		if g, err := strconv.ParseFloat(mustStr(fl), 64); err != nil || (g != fl && !(math.IsNaN(g) && math.IsNaN(fl))) {
			t.Fatalf("float64 %v did not round-trip: %v, %v", fl, g, err)
		}
		if g, err := strconv.ParseBool(mustStr(bo)); err != nil || g != bo {
			t.Fatalf("bool %v did not round-trip", bo)
		}
		dec := amqp.Decimal{Scale: scale, Value: dv}
		ds := mustStr(dec)
		if strings.Count(ds, ".") > 1 || (scale > 0 && !strings.Contains(ds, ".")) {
			t.Fatalf("decimal %+v became %q", dec, ds)
		}
		if scale < 20 {
			// Value = ds * 10^scale exactly.
			digits := strings.Replace(ds, ".", "", 1)
			if n, err := strconv.ParseInt(digits, 10, 64); err != nil || n != int64(dv) {
				t.Fatalf("decimal %+v became %q (digits %q)", dec, ds, digits)
			}
		}
		if !json.Valid([]byte(`[` + ds + `]`)) {
			t.Fatalf("decimal %q is not a JSON number", ds)
		}

		tbl := amqp.Table{
			"s": s, "i": i, "u": u, "f": fl, "b": b, "bo": bo, "d": dec, "v": nil,
			"t":   time.Unix(i%(1<<40), 0),
			"arr": []interface{}{s, i, amqp.Table{s: u}},
		}
		js := mustStr(tbl)
		var back map[string]interface{}
		dec2 := json.NewDecoder(strings.NewReader(js))
		dec2.UseNumber()
		if err := dec2.Decode(&back); err != nil {
			t.Fatalf("table JSON %q invalid: %v", js, err)
		}
		if n, err := back["i"].(json.Number).Int64(); err != nil || n != i {
			t.Fatalf("table i: %v, %v", back["i"], err)
		}
		if back["u"].(json.Number).String() != strconv.FormatUint(u, 10) {
			t.Fatalf("table u: %v", back["u"])
		}
		if back["bo"] != bo || back["v"] != nil {
			t.Fatalf("table bo/v: %v %v", back["bo"], back["v"])
		}
		if utf8.ValidString(s) && back["s"] != s {
			t.Fatalf("table s: %q, want %q", back["s"], s)
		}
		arr := mustStr([]interface{}{s, i, nil, tbl})
		if !json.Valid([]byte(arr)) {
			t.Fatalf("array JSON %q invalid", arr)
		}
	})
}
