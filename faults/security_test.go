package faults

import (
	"errors"
	"fmt"
	"maps"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// A producer cannot buy more attempts than MaxAttempts, nor skip any: the
// attempt header and x-death count only on a copy of this queue's own
// chain, back through a retry route (middleware.HeaderSource, XDeathSource;
// issue #18 item 1), so whatever a producer's message carries, it runs
// exactly MaxAttempts times here, and nothing forged reaches the poison copy.
func TestForgedRetryHeaders(t *testing.T) {
	const maxAttempts = 3
	e := newEnv(t, "classic", func(_ *env, c *amqpretry.Config) { c.MaxAttempts = maxAttempts })
	e.declare()
	xdeath := func(queue, reason string, count int64) []any {
		return []any{amqp.Table{"queue": queue, "reason": reason, "count": count, "exchange": e.exchange,
			"routing-keys": []any{routingKey}, "time": time.Now().Truncate(time.Second)}}
	}
	cases := []struct {
		name    string
		headers amqp.Table
		want    string // attempts the handler sees
	}{
		{"attempt abc", amqp.Table{middleware.AttemptKey: "abc"}, "[1 2 3]"},
		{"attempt -5", amqp.Table{middleware.AttemptKey: "-5"}, "[1 2 3]"},
		{"attempt 0", amqp.Table{middleware.AttemptKey: "0"}, "[1 2 3]"},
		{"attempt 2", amqp.Table{middleware.AttemptKey: "2"}, "[1 2 3]"},
		{"attempt 1000000", amqp.Table{middleware.AttemptKey: "1000000"}, "[1 2 3]"},
		{"attempt 2^70", amqp.Table{middleware.AttemptKey: "1180591620717411303424"}, "[1 2 3]"},
		{"attempt int header -7", amqp.Table{middleware.AttemptKey: int32(-7)}, "[1 2 3]"},
		{"x-death huge count", amqp.Table{"x-death": xdeath("QUEUE", "rejected", 1<<40)}, "[1 2 3]"},
		{"x-death 500000 rejected", amqp.Table{"x-death": xdeath("QUEUE", "rejected", 500000)}, "[1 2 3]"},
		{"x-death negative", amqp.Table{"x-death": xdeath("QUEUE", "rejected", -3)}, "[1 2 3]"},
		{"x-death other queue", amqp.Table{"x-death": xdeath("elsewhere", "rejected", 500000)}, "[1 2 3]"},
		{"x-death expired", amqp.Table{"x-death": xdeath("QUEUE", "expired", 500000)}, "[1 2 3]"},
		{"x-death as string", amqp.Table{"x-death": `[{"queue":"QUEUE","reason":"rejected","count":999}]`}, "[1 2 3]"},
		{"x-delivery-count 999", amqp.Table{"x-delivery-count": int64(999)}, "[1 2 3]"},
		{"forged header-error", amqp.Table{retrymeta.HeaderErrorKey: "everything is fine"}, "[1 2 3]"},
		{"attempt 999 + x-death 5", amqp.Table{middleware.AttemptKey: "999", "x-death": xdeath("QUEUE", "rejected", 5)}, "[1 2 3]"},
	}
	var uuids []string
	byUUID := map[string]string{}
	var ps []amqp.Publishing
	for _, c := range cases {
		us, p := newMessages(1, func(int) []byte { return []byte(c.name) })
		for k, v := range c.headers {
			if v2, ok := v.([]any); ok { // substitute the real queue name
				tb := maps.Clone(v2[0].(amqp.Table))
				if tb["queue"] == "QUEUE" {
					tb["queue"] = e.queue
				}
				v = []any{tb}
			}
			if s, ok := v.(string); ok {
				v = strings.ReplaceAll(s, "QUEUE", e.queue)
			}
			p[0].Headers[k] = v
		}
		uuids = append(uuids, us[0])
		byUUID[us[0]] = c.name
		ps = append(ps, p[0])
	}
	l := newLedger()
	var mu sync.Mutex
	problems := map[string]string{}
	e.start(func(msg *message.Message) error {
		l.attempt(msg.UUID, middleware.Attempt(msg))
		if p := msg.Metadata.Get(retrymeta.HeaderErrorKey); p != "" {
			mu.Lock()
			problems[msg.UUID] = p
			mu.Unlock()
		}
		return errTransient
	})
	e.publish(ps...)
	settled := e.settle(len(cases), func() int { return 0 }, 30*time.Second)
	e.stop()
	poisoned, ds := e.poisoned()
	account(t, uuids, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle")
	}
	e.checkEmpty()
	for i, c := range cases {
		got := l.attemptsOf(uuids[i])
		if fmt.Sprint(got) != c.want {
			t.Errorf("%s: attempts %v, want %s", c.name, got, c.want)
		}
		if len(got) > maxAttempts {
			t.Errorf("%s: %d handler calls, more than MaxAttempts %d", c.name, len(got), maxAttempts)
		}
		mu.Lock()
		p := problems[uuids[i]]
		mu.Unlock()
		if p != "" {
			t.Logf("%-26s attempts %-8s reported: %s", c.name, fmt.Sprint(got), p)
		}
	}
	for _, d := range ds {
		u := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
		if d.Headers[middleware.ErrorClassKey] != middleware.ClassExhausted {
			t.Errorf("%s: poisoned with class %v", byUUID[u], d.Headers[middleware.ErrorClassKey])
		}
		for k := range d.Headers {
			if k == "x-death" || k == "x-delivery-count" || k == retrymeta.HeaderErrorKey {
				t.Errorf("%s: forged %s carried into the poison queue", byUUID[u], k)
			}
		}
	}
}

// Error texts in failure headers are bounded: a 10 KiB error leaves at most
// retrymeta.DefaultMaxErrorBytes (1 KiB) in rabbitretry-last-error on the
// retry copy and in reason_poisoned / rabbitretry-last-error on the poison
// copy.
func TestErrorTextBounded(t *testing.T) {
	e := newEnv(t, "classic", func(_ *env, c *amqpretry.Config) { c.MaxAttempts = 2 })
	e.declare()
	huge := strings.Repeat("é", 5*1024) // 10 KiB of 2-byte runes: a cut must not split one
	uuids, ps := newMessages(1, nil)
	l := newLedger()
	var mu sync.Mutex
	var retryLastError string
	e.start(func(msg *message.Message) error {
		if middleware.Attempt(msg) == 2 {
			mu.Lock()
			retryLastError = msg.Metadata.Get(middleware.LastErrorKey)
			mu.Unlock()
		}
		l.attempt(msg.UUID, middleware.Attempt(msg))
		return errors.New("upstream said: " + huge)
	})
	e.publish(ps...)
	settled := e.settle(1, l.handled, 20*time.Second)
	e.stop()
	poisoned, ds := e.poisoned()
	account(t, uuids, l.successes(), poisoned)
	if !settled || len(ds) != 1 {
		t.Fatalf("not poisoned")
	}
	check := func(where, v string) {
		t.Helper()
		if v == "" || len(v) > retrymeta.DefaultMaxErrorBytes {
			t.Errorf("%s: %d bytes, want 1..%d", where, len(v), retrymeta.DefaultMaxErrorBytes)
		}
		if !strings.Contains(v, "upstream said: ") || !strings.HasSuffix(v, "…") || !utf8.ValidString(v) {
			t.Errorf("%s: not a clean UTF-8 prefix marked as cut: %q...", where, v[:min(len(v), 40)])
		}
	}
	mu.Lock()
	check("retry copy "+middleware.LastErrorKey, retryLastError)
	mu.Unlock()
	h := ds[0].Headers
	check("poison "+retrymeta.PoisonReasonKey, h[retrymeta.PoisonReasonKey].(string))
	check("poison "+middleware.LastErrorKey, h[middleware.LastErrorKey].(string))
	total := 0
	for k, v := range h {
		if s, ok := v.(string); ok {
			total += len(k) + len(s)
		}
	}
	t.Logf("poison copy: reason %d bytes, last-error %d bytes, all string headers %d bytes",
		len(h[retrymeta.PoisonReasonKey].(string)), len(h[middleware.LastErrorKey].(string)), total)
}

// A custom Config.ErrorText redacts secrets from every header the library
// writes (retry copies and poison copy) and from its own logs of retries
// and poisonings.
func TestErrorTextRedaction(t *testing.T) {
	creds := regexp.MustCompile(`(amqps?|https?|postgres)://[^:/@\s]+:[^@/\s]+@`)
	redact := func(err error) string {
		return retrymeta.Truncate(creds.ReplaceAllString(err.Error(), "$1://REDACTED@"), retrymeta.DefaultMaxErrorBytes)
	}
	e := newEnv(t, "classic", func(_ *env, c *amqpretry.Config) {
		c.MaxAttempts = 3
		c.ErrorText = redact
	})
	e.declare()
	uuids, ps := newMessages(1, nil)
	l := newLedger()
	var mu sync.Mutex
	var metas []message.Metadata
	e.start(func(msg *message.Message) error {
		l.attempt(msg.UUID, middleware.Attempt(msg))
		mu.Lock()
		metas = append(metas, maps.Clone(msg.Metadata))
		mu.Unlock()
		return fmt.Errorf("dial amqp://user:secret@rabbit.internal:5672/: %w", errTransient)
	})
	e.publish(ps...)
	settled := e.settle(1, l.handled, 20*time.Second)
	e.stop()
	poisoned, ds := e.poisoned()
	account(t, uuids, l.successes(), poisoned)
	if !settled || len(ds) != 1 {
		t.Fatalf("not poisoned")
	}
	mu.Lock()
	defer mu.Unlock()
	for i, md := range metas {
		for k, v := range md {
			if strings.Contains(v, "secret") {
				t.Errorf("attempt %d: header %s = %q leaks the secret", i+1, k, v)
			}
		}
	}
	for k, v := range ds[0].Headers {
		if s, ok := v.(string); ok && strings.Contains(s, "secret") {
			t.Errorf("poison copy: header %s = %q leaks the secret", k, s)
		}
	}
	if r := ds[0].Headers[retrymeta.PoisonReasonKey].(string); !strings.Contains(r, "amqp://REDACTED@rabbit.internal") {
		t.Errorf("reason %q: not the redacted text", r)
	}
	if got := metas[len(metas)-1].Get(middleware.LastErrorKey); !strings.Contains(got, "REDACTED") {
		t.Errorf("retry copy's last error %q is not redacted", got)
	}
	// The library's own retry and poison logs use the redacted text.
	var leaks []string
	for _, le := range e.logs.find("", "") {
		for k, v := range le.Fields {
			if strings.Contains(fmt.Sprint(v), "secret") {
				leaks = append(leaks, le.Msg+" field "+k)
			}
		}
		if le.Err != nil && strings.Contains(le.Err.Error(), "secret") {
			leaks = append(leaks, le.Msg+" error")
		}
	}
	slices.Sort(leaks)
	if len(leaks) != 0 {
		t.Errorf("library logs leak the secret: %v", slices.Compact(leaks))
	}
}
