package amqpretry

import (
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/middleware"
)

func TestLateVerdicts(t *testing.T) {
	l := newLateVerdicts()
	l.max = 3
	msg := message.NewMessage("u1", nil)
	msg.Metadata.Set(middleware.AttemptKey, "2")
	k := lateKey(msg)
	fail := errors.New("x")
	l.add(k, fail)
	if err, ok := l.take(k); !ok || err != fail {
		t.Fatalf("take: %v %v", err, ok)
	}
	if _, ok := l.take(k); ok {
		t.Fatal("taken twice")
	}
	// Another attempt of the same message is another key.
	other := message.NewMessage("u1", nil)
	other.Metadata.Set(middleware.AttemptKey, "3")
	l.add(k, nil)
	if _, ok := l.take(lateKey(other)); ok {
		t.Fatal("attempt 3 matched attempt 2's result")
	}
	// Bounded: the oldest is forgotten.
	for i := range 4 {
		l.add(fmt.Sprint("k", i), nil)
	}
	if _, ok := l.take(k); ok {
		t.Fatal("oldest entry not evicted")
	}
	if _, ok := l.take("k3"); !ok || l.order.Len() != 2 || len(l.errs) != 2 {
		t.Fatalf("newest entry missing or sizes wrong: %d %d", l.order.Len(), len(l.errs))
	}
}

func TestClassicTimeoutIgnored(t *testing.T) {
	for _, c := range []struct {
		v, qt string
		want  bool
	}{{"4.3.6", QueueTypeClassic, true}, {"5.0.0", QueueTypeClassic, true}, {"4.2.1", QueueTypeClassic, false},
		{"3.10.8", QueueTypeClassic, false}, {"4.3.6", QueueTypeQuorum, false}, {"", QueueTypeClassic, false}} {
		if got := classicTimeoutIgnored(c.v, c.qt); got != c.want {
			t.Errorf("classicTimeoutIgnored(%q, %q) = %v", c.v, c.qt, got)
		}
	}
}
