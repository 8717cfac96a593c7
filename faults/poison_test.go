package faults

import (
	"errors"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// The poison publish fails and cannot be repaired: the poison exchange was
// replaced by a fanout exchange without bindings, so the publish is returned
// unroutable and the redeclare (direct) is refused with PRECONDITION_FAILED.
// The message is never acked before it is poisoned: after the fallback
// pause it is parked back in Q marked past its last attempt, so it comes
// back and only its poison publish is tried again (the handler does not run
// again), as long as the fault lasts. Once the operator
// deletes the bad exchange, the next poison publish finds it missing (404),
// the topology is redeclared and the message lands in the poison queue.
func TestPoisonPublishFails(t *testing.T) {
	e := newEnv(t, "classic", func(_ *env, c *amqpretry.Config) {
		c.FallbackPause = 50 * time.Millisecond
		c.MaxAttempts = 2
		c.Mode = amqpretry.Tiers(200 * time.Millisecond)
	})
	l := newLedger()
	e.declare()
	e.start(func(msg *message.Message) error {
		l.attempt(msg.UUID, middleware.Attempt(msg))
		if string(msg.Payload) == "permanent" {
			return middleware.Permanent(errors.New("order references unknown customer"))
		}
		return errTransient // exhausted after 2 attempts
	})

	// Break the poison exchange.
	ch := e.admin.channel()
	if err := ch.ExchangeDelete(e.naming.PoisonExchange, false, false); err != nil {
		t.Fatal(err)
	}
	if err := ch.ExchangeDeclare(e.naming.PoisonExchange, amqp.ExchangeFanout, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	_ = ch.Close()

	perm := message.NewMessage("perm-"+e.prefix, []byte("permanent"))
	exh := message.NewMessage("exh-"+e.prefix, []byte("transient"))
	var ps []amqp.Publishing
	for _, m := range []*message.Message{perm, exh} {
		p, err := amqpretry.Marshaler{}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p)
	}
	e.publish(ps...)

	// While broken: each message is parked back in Q past its last attempt
	// (after the fallback pause) and its poison publish is tried again; the
	// handler does not run again; the poison queue stays empty.
	waitFor(t, 30*time.Second, "several failed poison publishes while the poison exchange is broken", func() bool {
		return len(e.logs.find("error", "Poison publish failed; nacking message")) >= 6
	})
	if a, b := l.attemptsOf(perm.UUID), l.attemptsOf(exh.UUID); len(a) != 1 || len(b) != 2 {
		t.Fatalf("handler ran again while the poison publish failed: permanent %v, exhausted %v", a, b)
	}
	if d := e.poisonDepth(); d != 0 {
		t.Fatalf("poison queue has %d messages while its exchange is broken", d)
	}
	fails := e.logs.find("error", "Poison publish failed; nacking message")
	if len(fails) == 0 {
		t.Fatal("no failed poison publish logged")
	}
	var de *amqpretry.DeclareError
	if !errors.As(fails[0].Err, &de) || de.Kind != "exchange" || de.Name != e.naming.PoisonExchange {
		t.Errorf("logged error %v: want a *amqpretry.DeclareError for exchange %q", fails[0].Err, e.naming.PoisonExchange)
	}
	if !errors.Is(fails[0].Err, confirm.ErrUnroutable) {
		t.Errorf("logged error %v: want it to wrap ErrUnroutable (the first publish)", fails[0].Err)
	}
	t.Logf("while broken: %d failed poison publishes; perm attempts %v; exhausted attempts %v; first error: %v",
		len(fails), l.attemptsOf(perm.UUID), l.attemptsOf(exh.UUID), fails[0].Err)

	// Fix: delete the bad exchange; the library redeclares it.
	ch = e.admin.channel()
	if err := ch.ExchangeDelete(e.naming.PoisonExchange, false, false); err != nil {
		t.Fatal(err)
	}
	_ = ch.Close()
	waitFor(t, 30*time.Second, "both messages in the poison queue", func() bool { return e.poisonDepth() == 2 })
	settled := e.settle(2, func() int { return 0 }, 20*time.Second)
	e.stop()
	poisoned, ds := e.poisoned()
	account(t, []string{perm.UUID, exh.UUID}, l.successes(), poisoned)
	if !settled {
		t.Errorf("did not settle")
	}
	e.checkEmpty()
	for _, d := range ds {
		u := d.Headers[wamqp.DefaultMessageUUIDHeaderKey]
		class, _ := d.Headers[middleware.ErrorClassKey].(string)
		attempts, _ := d.Headers[middleware.PoisonAttemptsKey].(string)
		want := middleware.ClassExhausted
		if u == perm.UUID {
			want = middleware.ClassPermanent
		}
		if class != want {
			t.Errorf("%v: class %q, want %q", u, class, want)
		}
		t.Logf("poisoned %v: class %s, attempts %s", u, class, attempts)
	}
	if len(e.logs.find("error", "Poison publish found no poison queue; redeclaring topology")) == 0 {
		t.Errorf("no redeclare logged")
	}
}
