package audit_test

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/rabbitretry/rabbitretry/audit"
	"github.com/rabbitretry/rabbitretry/internal/auditconst"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// The operator's story, on the real chain: a handler bug poisons every
// message of a queue; the audit (Recorder + Consumer, PostgreSQL) shows
// them; once the bug is fixed, Resend(to-queue) sends back exactly the
// poisoned messages of one tenant, to that queue only. The handler sees
// each once more as attempt 1 with rabbitretry-resent, another queue bound
// to the same exchange and key sees nothing new, and the audit then shows
// them succeeded.
func TestResendThroughTheRetryChainAfterABugFix(t *testing.T) {
	e := newBrokerEnv(t)
	store, _ := pgStore(t)
	queue := e.prefix + ".mailer"
	other := e.prefix + ".billing"
	e.queues = append(e.queues, other)
	if _, err := e.ch.QueueDeclare(other, false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	if err := e.ch.QueueBind(other, routingKey, e.exchange, false, nil); err != nil {
		t.Fatal(err)
	}

	var fixed atomic.Bool
	var mu sync.Mutex
	afterFix := map[string][]int{}
	resentHeader := map[string]string{}
	_, stopRetry := e.retryConsumer(queue, 3, func(msg *message.Message) error {
		if !fixed.Load() {
			return middleware.Permanent(errors.New("template missing: order-confirmation"))
		}
		mu.Lock()
		defer mu.Unlock()
		afterFix[msg.UUID] = append(afterFix[msg.UUID], middleware.Attempt(msg))
		resentHeader[msg.UUID] = msg.Metadata.Get(auditconst.ResentKey)
		return nil
	})
	_, stopCons := e.consumer(store, nil)

	const n = 20
	acme := map[string]bool{}
	var msgs []*message.Message
	for i := range n {
		m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"order":%d}`, i)))
		m.Metadata.Set("tenant", map[bool]string{true: "acme", false: "globex"}[i%2 == 0])
		if i%2 == 0 {
			acme[m.UUID] = true
		}
		msgs = append(msgs, m)
	}
	e.publish(msgs...)
	poisoned := audit.Filter{Queue: queue, LastOutcome: audit.OutcomePoisoned, Limit: 100}
	testkit.WaitFor(t, 30*time.Second, "20 poisoned messages in the audit", func() bool {
		got, err := store.Search(context.Background(), poisoned)
		return err == nil && len(got) == n
	})
	testkit.WaitFor(t, 10*time.Second, "the other queue's 20 copies", func() bool { return e.ready(other) == n })

	fixed.Store(true)
	r := newTestResender(t, store, &resendTopology{loopBack: "rabbitretry.loopback"})
	f := poisoned
	f.Headers = map[string]any{"tenant": "acme"}
	rep, err := r.Resend(context.Background(), f, audit.ResendOptions{Mode: audit.ResendToQueue})
	if err != nil || rep.Matched != n/2 || rep.Sent != n/2 {
		t.Fatalf("resend: %+v %v", rep, err)
	}
	for _, res := range rep.Results {
		if res.Queue != queue || !acme[res.MessageID] {
			t.Fatalf("result %+v", res)
		}
	}
	succeeded := audit.Filter{Queue: queue, LastOutcome: audit.OutcomeSuccess, Limit: 100}
	var ok []audit.Message
	testkit.WaitFor(t, 30*time.Second, "the resent messages recorded as succeeded", func() bool {
		ok, err = store.Search(context.Background(), succeeded)
		return err == nil && len(ok) == n/2
	})
	stopRetry()
	stopCons()

	mu.Lock()
	defer mu.Unlock()
	var wrong []string
	for id, attempts := range afterFix {
		if !acme[id] || len(attempts) != 1 || attempts[0] != 1 || resentHeader[id] == "" {
			wrong = append(wrong, fmt.Sprintf("%s acme=%v attempts=%v resent=%q", id, acme[id], attempts, resentHeader[id]))
		}
	}
	sort.Strings(wrong)
	if len(afterFix) != n/2 || len(wrong) > 0 {
		t.Fatalf("handled after the fix: %d messages, want the %d acme ones once each at attempt 1: %v", len(afterFix), n/2, wrong)
	}
	for _, m := range ok {
		if !acme[m.MessageID] {
			t.Fatalf("%s succeeded but was not resent", m.MessageID)
		}
	}
	still, err := store.Search(context.Background(), poisoned)
	if err != nil || len(still) != n/2 {
		t.Fatalf("still poisoned: %d %v, want the %d globex ones", len(still), err, n/2)
	}
	if got := e.ready(other); got != n {
		t.Fatalf("the other queue holds %d, want its original %d (nothing resent to it)", got, n)
	}
	t.Logf("accounting: published %d, poisoned %d, resent %d (acme), handled again %d (each once, attempt 1), still poisoned %d (globex), other queue +0",
		n, n, rep.Sent, len(afterFix), len(still))
}
