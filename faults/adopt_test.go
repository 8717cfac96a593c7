package faults

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// mgmtGet GETs a management API path (e.g. /api/queues/%2F/q) into out;
// false when the object does not exist.
func mgmtGet(t *testing.T, base, path string, out any) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(base, "/")+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNotFound {
		return false
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", path, resp.Status)
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		t.Fatal(err)
	}
	return true
}

// deletePolicyAtCleanup removes the library's policy for q when the test ends.
func deletePolicyAtCleanup(t *testing.T, base, q string) {
	t.Cleanup(func() {
		req, err := http.NewRequest(http.MethodDelete, strings.TrimSuffix(base, "/")+"/api/policies/%2F/"+url.PathEscape(amqpretry.PolicyNamePrefix+q), nil)
		if err != nil {
			return
		}
		if resp, err := http.DefaultClient.Do(req); err == nil {
			_ = resp.Body.Close()
		}
	})
}

// An existing durable queue, declared by someone else with an argument the
// library does not set (x-max-length) and a backlog of 1,000 messages, is
// adopted under load (1,000 more published while it runs): without
// AdoptQueue the library refuses it (DeclareError naming the argument);
// with it, Q's arguments are left alone, every message is handled, retried
// (10 % fail once) or poisoned (3 % always fail, MaxAttempts 3) as usual,
// and nothing is lost. A quorum queue gets its dead-letter safety net by a
// policy: applied through the management API when the broker has one
// (RABBITRETRY_MGMT_URI), else logged as a rabbitmqctl command.
func TestAdoptExistingQueue(t *testing.T) {
	requireLong(t)
	mgmt := testkit.MgmtURI()
	forEachQueueType(t, func(t *testing.T, qt string) {
		e := newEnv(t, qt, func(_ *env, c *amqpretry.Config) {
			c.MaxAttempts = 3
			c.AdoptQueue = &amqpretry.AdoptQueue{ManagementURL: mgmt}
		})
		if mgmt != "" {
			deletePolicyAtCleanup(t, mgmt, e.queue)
		}
		// 1. The queue as someone else left it, with a backlog.
		foreign := amqp.Table{"x-max-length": int64(1_000_000)}
		if qt == amqpretry.QueueTypeQuorum {
			foreign["x-queue-type"] = amqpretry.QueueTypeQuorum
		}
		ch := e.admin.channel()
		if _, err := ch.QueueDeclare(e.queue, true, false, false, false, foreign); err != nil {
			t.Fatal(err)
		}
		if err := ch.ExchangeDeclare(e.exchange, "direct", true, false, false, false, nil); err != nil {
			t.Fatal(err)
		}
		if err := ch.QueueBind(e.queue, routingKey, e.exchange, false, nil); err != nil {
			t.Fatal(err)
		}
		_ = ch.Close()
		const n = 2000
		uuids, ps := newMessages(n, nil)
		e.publish(ps[:n/2]...)
		if d := e.depth(e.queue); d != n/2 {
			t.Fatalf("backlog: %d messages in %s, want %d", d, e.queue, n/2)
		}

		// 2. Without AdoptQueue: refused, naming the argument.
		plainCfg := e.cfg
		plainCfg.AdoptQueue = nil
		plain, err := amqpretry.New(plainCfg)
		if err != nil {
			t.Fatal(err)
		}
		sub, err := wamqp.NewSubscriber(plain.SubscriberConfig(), watermill.NopLogger{})
		if err != nil {
			t.Fatal(err)
		}
		err = sub.SubscribeInitialize(e.queue)
		_ = sub.Close()
		_ = plain.Close()
		var de *amqpretry.DeclareError
		if !errors.As(err, &de) || de.Argument == "" {
			t.Fatalf("declaring the existing queue without AdoptQueue: err = %v, want a *DeclareError naming the argument", err)
		}
		t.Logf("without AdoptQueue: %v", err)

		// 3. Adopted, under load.
		plan := map[string]int{}
		poisonWanted, retried := 0, 0
		for i, u := range uuids {
			switch {
			case i%33 == 0:
				plan[u] = 99 // always fails: poisoned after 3 attempts
				poisonWanted++
			case i%10 == 0:
				plan[u] = 1
				retried++
			default:
				plan[u] = 0
			}
		}
		l := newLedger()
		e.start(planHandler(l, staticPlan(plan), 0, nil))
		e.publish(ps[n/2:]...)
		settled := e.settle(n, l.handled, 2*time.Minute)
		e.stop()
		poisoned, _ := e.poisoned()
		acc := account(t, uuids, l.successes(), poisoned)
		if !settled {
			t.Errorf("messages did not settle within 2 min")
		}
		e.checkEmpty()
		if acc.Poisoned != poisonWanted || acc.Handled != n-poisonWanted {
			t.Errorf("handled %d, poisoned %d; want %d and %d (%d retried once)", acc.Handled, acc.Poisoned, n-poisonWanted, poisonWanted, retried)
		}

		// 4. Q keeps its own arguments; the policy applies (quorum) or was
		// logged as a command.
		policy, needed := e.retry.Topology().QueuePolicy(e.queue, 10)
		if needed != (qt == amqpretry.QueueTypeQuorum) {
			t.Errorf("QueuePolicy needed = %v for a %s queue", needed, qt)
		}
		if mgmt != "" {
			var q struct {
				Arguments map[string]any `json:"arguments"`
				Policy    string         `json:"policy"`
				Type      string         `json:"type"`
			}
			if !mgmtGet(t, mgmt, "/api/queues/%2F/"+url.PathEscape(e.queue), &q) {
				t.Fatalf("queue %s not found through the management API", e.queue)
			}
			if fmt.Sprint(q.Arguments["x-max-length"]) != "1e+06" || q.Arguments["x-dead-letter-exchange"] != nil {
				t.Errorf("adopted queue's arguments changed: %v", q.Arguments)
			}
			if needed && q.Policy != policy.Name {
				t.Errorf("policy on %s = %q, want %q", e.queue, q.Policy, policy.Name)
			}
			if !needed && q.Policy != "" {
				t.Errorf("classic queue got policy %q; it needs none", q.Policy)
			}
			t.Logf("management API: type %s, arguments %v, policy %q", q.Type, q.Arguments, q.Policy)
		} else if needed {
			logged := e.logs.find("error", "run this command")
			if len(logged) == 0 || !strings.Contains(fmt.Sprint(logged[0].Fields["command"]), "rabbitmqctl set_policy") {
				t.Errorf("without a management API the policy command was not logged: %v", logged)
			}
		}
	})
}
