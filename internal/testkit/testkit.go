// Package testkit holds the helpers the project's tests share: reaching the
// real RabbitMQ broker, unique names, waiting on conditions with a deadline,
// and exact backoff policies.
package testkit

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// DefaultURI is used when AMQP_URI is unset.
const DefaultURI = "amqp://guest:guest@127.0.0.1:5672/"

var (
	once    sync.Once
	dialErr error
)

// URI returns $AMQP_URI or DefaultURI. It dials the broker once per test
// binary (5 s timeout); if that failed, the test fails when CI=true (so CI
// never skips the integration tests silently) and is skipped otherwise.
func URI(t testing.TB) string {
	t.Helper()
	uri := os.Getenv("AMQP_URI")
	if uri == "" {
		uri = DefaultURI
	}
	once.Do(func() {
		conn, err := amqp.DialConfig(uri, amqp.Config{Dial: amqp.DefaultDial(5 * time.Second)})
		if err != nil {
			dialErr = err
			return
		}
		_ = conn.Close()
	})
	if dialErr != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("RabbitMQ broker at %s unreachable: %v", RedactURI(uri), dialErr)
		}
		t.Skipf("RabbitMQ broker at %s unreachable (set AMQP_URI, or run `make broker`): %v", RedactURI(uri), dialErr)
	}
	return uri
}

// RedactURI hides the password of an AMQP URI for log output.
func RedactURI(uri string) string {
	return redact.URI(uri)
}

// UniqueName returns "<prefix>.<test name>.<random hex>", safe as a queue or
// exchange name (the test name part is cut to 100 bytes) and unique across
// concurrent test runs.
func UniqueName(t testing.TB, prefix string) string {
	t.Helper()
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatalf("rand: %v", err)
	}
	name := strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', r == '-', r == '_':
			return r
		default:
			return '_'
		}
	}, t.Name())
	if len(name) > 100 {
		name = name[:100]
	}
	return prefix + "." + name + "." + hex.EncodeToString(b[:])
}

// WaitFor polls cond every 10 ms until it is true, failing the test after
// timeout with "timed out waiting for <what>". The polling interval is not a
// synchronisation point: only cond decides.
func WaitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Recv waits for one value on ch, failing the test after timeout.
func Recv[T any](t testing.TB, ch <-chan T, timeout time.Duration) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(timeout):
		var zero T
		t.Fatalf("nothing received within %v", timeout)
		return zero
	}
}

// ExactBackoff returns a policy factory: exponential from initial, factor 2,
// no jitter, capped at 1 min per attempt, no elapsed-time limit.
func ExactBackoff(initial time.Duration) func() backoff.BackOff {
	return func() backoff.BackOff {
		b := backoff.NewExponentialBackOff()
		b.InitialInterval = initial
		b.Multiplier = 2
		b.RandomizationFactor = 0
		b.MaxInterval = time.Minute
		b.MaxElapsedTime = 0
		return b
	}
}

// SyncBuffer is a bytes.Buffer safe for concurrent writes and reads, for
// capturing a program's output while it runs.
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write appends p.
func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
