package faults

import (
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// poisonDeliveryLimit is the delivery-limit the README and poison/admin advise
// by policy for poison queues on RabbitMQ 4.0-4.2, where the poison tools' nacks
// count toward a quorum queue's delivery limit: a large finite
// delivery-limit (not -1, whose policy form has a history of loss and
// churn: NServiceBus.RabbitMQ 1688/1689, rabbitmq-server 14202, PR 16035).
const poisonDeliveryLimit = 1_000_000

// Issue 18 item 10: the advised policy works. On a library-declared poison
// queue (quorum) the policy {"delivery-limit": 1000000} is applied through
// the management API, the effective delivery limit is read back from the
// queue (delivery_limit), and a message returned 25 times with
// basic.reject requeue=true (which counts toward the limit on every 4.x) is
// still there, with x-delivery-count 25. The control, a poison queue
// without the policy, loses its message at the default limit of 20.
func TestPoisonQueueDeliveryLimitAdvice(t *testing.T) {
	if !brokerAtLeast4() {
		t.Skip("quorum queue delivery limits are 4.x (RABBITRETRY_BROKER_VERSION)")
	}
	mgmt := testkit.HaveMgmt(t)
	for _, withPolicy := range []bool{true, false} {
		name := map[bool]string{true: "advised-policy", false: "no-policy"}[withPolicy]
		t.Run(name, func(t *testing.T) {
			e := newEnv(t, amqpretry.QueueTypeQuorum)
			e.declare()
			pq := e.poisonQueue()
			wantLimit := "20"
			if withPolicy {
				pol := e.prefix + ".poison-limit"
				putPolicy(t, mgmt, pol, "^"+strings.ReplaceAll(pq, ".", `\.`)+"$", 0, map[string]any{"delivery-limit": poisonDeliveryLimit})
				awaitPolicy(t, mgmt, pq, pol)
				wantLimit = fmt.Sprint(poisonDeliveryLimit)
			}
			var q map[string]any
			if !mgmtGet(t, mgmt, "/api/queues/%2F/"+url.PathEscape(pq)+"?disable_stats=true", &q) {
				t.Fatalf("poison queue %s not found", pq)
			}
			if got := fmt.Sprint(q["delivery_limit"]); got != wantLimit && !(got == "1e+06" && wantLimit == "1000000") {
				t.Errorf("effective delivery limit of %s is %v, want %s (policy %v)", pq, q["delivery_limit"], wantLimit, q["policy"])
			}
			t.Logf("%s: effective delivery_limit %v, policy %v", pq, q["delivery_limit"], q["policy"])

			uuids, ps := newMessages(1, nil)
			e.admin.publish("", pq, ps...)
			ch := e.admin.channel()
			defer ch.Close()
			const returns = 25
			var last amqp.Delivery
			got := 0
			for i := 0; i < returns+1; i++ {
				var d amqp.Delivery
				ok := false
				deadline := time.Now().Add(5 * time.Second)
				for !ok && time.Now().Before(deadline) {
					var err error
					if d, ok, err = ch.Get(pq, false); err != nil {
						t.Fatal(err)
					}
					if !ok && e.depth(pq) == 0 {
						break // gone: the broker dropped it at the limit
					}
				}
				if !ok {
					break
				}
				got++
				last = d
				if i < returns {
					if err := d.Reject(true); err != nil {
						t.Fatal(err)
					}
				} else if err := d.Ack(false); err != nil {
					t.Fatal(err)
				}
			}
			handled := map[string]int{}
			if got == returns+1 {
				handled[uuids[0]] = 1
			}
			t.Logf("delivered %d times; last x-delivery-count %v", got, last.Headers["x-delivery-count"])
			if withPolicy {
				account(t, uuids, handled, nil)
				if n := fmt.Sprint(last.Headers["x-delivery-count"]); n != fmt.Sprint(returns) {
					t.Errorf("x-delivery-count after %d returns = %s", returns, n)
				}
			} else if got > 21 {
				t.Errorf("without the policy the message came back %d times; the default limit is 20", got)
			}
		})
	}
}
