package amqpretry_test

import (
	"bytes"
	"context"
	"errors"
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

func mgmtDo(t *testing.T, base, method, path, body string) {
	t.Helper()
	req, err := http.NewRequestWithContext(context.Background(), method, strings.TrimSuffix(base, "/")+path, bytes.NewBufferString(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode >= 300 && !(method == http.MethodDelete && resp.StatusCode == http.StatusNotFound) {
		t.Fatalf("%s %s: %s", method, path, resp.Status)
	}
}

// Each mismatch the library cannot fix on an adopted queue is a
// *AdoptError naming the queue, what was found and the fix, and the
// subscriber does not start: a queue of the other type, a queue another
// policy applies to (RabbitMQ applies one policy per queue), a queue
// argument that would override the library's policy.
func TestE2E_AdoptQueueMismatches(t *testing.T) {
	mgmt := testkit.HaveMgmt(t)
	cases := []struct {
		name  string
		args  amqp.Table // the existing queue's arguments
		setup func(t *testing.T, q string)
		want  string // in the AdoptError's text
	}{
		{name: "classic-queue", args: nil, want: "it is a classic queue and Config.QueueType is quorum"},
		{name: "other-policy", args: amqp.Table{"x-queue-type": "quorum"}, setup: func(t *testing.T, q string) {
			name := "it.other." + q
			mgmtDo(t, mgmt, http.MethodPut, "/api/policies/%2F/"+url.PathEscape(name),
				`{"pattern":"^`+strings.ReplaceAll(q, ".", `\\.`)+`$","apply-to":"queues","priority":50,"definition":{"max-length":100000}}`)
			t.Cleanup(func() { mgmtDo(t, mgmt, http.MethodDelete, "/api/policies/%2F/"+url.PathEscape(name), "") })
			// Wait until the broker applied it.
			waitFor(t, 10*time.Second, "the other policy to apply", func() bool {
				req, _ := http.NewRequest(http.MethodGet, strings.TrimSuffix(mgmt, "/")+"/api/queues/%2F/"+url.PathEscape(q), nil)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					return false
				}
				defer resp.Body.Close()
				var b bytes.Buffer
				_, _ = b.ReadFrom(resp.Body)
				return strings.Contains(b.String(), `"policy":"`+name+`"`)
			})
		}, want: "applies to it, and RabbitMQ applies one policy per queue"},
		{name: "overriding-argument", args: amqp.Table{"x-queue-type": "quorum", "x-dead-letter-exchange": "legacy.dlx"},
			want: "its queue arguments override the policy (x-dead-letter-exchange is \"legacy.dlx\", wanted \"\")"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			uri := e2eURI(t)
			q := testkit.UniqueName(t, "it.adopt")
			conn, err := amqp.Dial(uri)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			ch, err := conn.Channel()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := ch.QueueDeclare(q, true, false, false, false, c.args); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if ch, err := conn.Channel(); err == nil {
					_, _ = ch.QueueDelete(q, false, false, false)
					_, _ = ch.QueueDelete(q+".poison", false, false, false)
					for _, w := range []string{".wait.100ms"} {
						_, _ = ch.QueueDelete(q+w, false, false, false)
					}
				}
				mgmtDo(t, mgmt, http.MethodDelete, "/api/policies/%2F/"+url.PathEscape(amqpretry.PolicyNamePrefix+q), "")
			})
			if c.setup != nil {
				c.setup(t, q)
			}
			r, err := amqpretry.New(amqpretry.Config{
				URI: uri, Subscriber: wamqp.NewDurableQueueConfig(uri), QueueType: amqpretry.QueueTypeQuorum,
				Mode: amqpretry.Tiers(100 * time.Millisecond), AdoptQueue: &amqpretry.AdoptQueue{ManagementURL: mgmt},
			})
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			sub, err := wamqp.NewSubscriber(r.SubscriberConfig(), watermill.NopLogger{})
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Close()
			err = sub.SubscribeInitialize(q)
			var ae *amqpretry.AdoptError
			if !errors.As(err, &ae) {
				t.Fatalf("err = %v, want an *amqpretry.AdoptError", err)
			}
			if ae.Queue != q || !strings.Contains(ae.Error(), c.want) || ae.Fix == "" {
				t.Errorf("AdoptError = %v; want queue %q and %q", ae, q, c.want)
			}
			t.Logf("%v", ae)
		})
	}
}

// DeadLetterFirstRetry and NativeDelayedRetry need their policy in force
// before the first nack: New refuses them on an adopted queue without a
// management API to apply and check it.
func TestAdoptQueueNeedsManagementForNackModes(t *testing.T) {
	cfg := amqpretry.Config{URI: "amqp://127.0.0.1:1/", Subscriber: wamqp.NewDurableQueueConfig("amqp://127.0.0.1:1/"),
		QueueType: amqpretry.QueueTypeQuorum, Mode: amqpretry.DeadLetterFirst(), AdoptQueue: &amqpretry.AdoptQueue{}}
	if _, err := amqpretry.New(cfg); err == nil || !strings.Contains(err.Error(), "AdoptQueue.ManagementURL is empty") {
		t.Errorf("New = %v, want the ManagementURL error", err)
	}
	cfg.AdoptQueue.ManagementURL = "ftp://x"
	if _, err := amqpretry.New(cfg); err == nil || !strings.Contains(err.Error(), "ManagementURL") {
		t.Errorf("New = %v, want the ManagementURL error", err)
	}
}
