package amqpretry_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// inspectRetry makes a Retry for tiers and declares queue's topology as a
// subscriber does when it starts (SubscribeInitialize).
func inspectRetry(t *testing.T, uri, queueType, queue string, tiers ...time.Duration) *amqpretry.Retry {
	t.Helper()
	r, err := amqpretry.New(amqpretry.Config{URI: uri, Subscriber: wamqp.NewDurableQueueConfig(uri), QueueType: queueType,
		Mode: amqpretry.Tiers(tiers...), Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	sub, err := wamqp.NewSubscriber(r.SubscriberConfig(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Close()
	if err := sub.SubscribeInitialize(queue); err != nil {
		t.Fatal(err)
	}
	return r
}

func orphanNames(rep *amqpretry.TopologyReport) []string {
	var names []string
	for _, o := range rep.Orphans {
		names = append(names, o.Name)
	}
	return names
}

func queueState(rep *amqpretry.TopologyReport, name string) (amqpretry.QueueState, bool) {
	for _, q := range rep.Queues {
		if q.Name == name {
			return q, true
		}
	}
	return amqpretry.QueueState{}, false
}

// After a deploy changes the tiers from [1s, 2s, 30s] to [500ms, 2s], the
// 1s and 30s wait queues are orphans: Inspect reports them (and a queue
// that dead-letters to Q with a TTL under another name), not the unrelated
// "<Q>.wait.audit"; TidyOrphans deletes the empty orphans and keeps the
// one holding a message (the broker refuses an if-empty delete);
// DeleteQueuesAndOrphans removes everything.
func TestE2E_InspectAndTidyOrphans(t *testing.T) {
	mgmt := testkit.HaveMgmt(t)
	forEachQueueType(t, func(t *testing.T, queueType string) {
		uri := e2eURI(t)
		vhost := "/"
		if u, err := amqp.ParseURI(uri); err == nil {
			vhost = u.Vhost
		}
		q := testkit.UniqueName(t, "it.inspect")
		conn, err := amqp.Dial(uri)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		legacy := q + ".legacy-delay" // an orphan by its arguments, not its name
		unrelated := q + ".wait.audit"
		t.Cleanup(func() {
			ch, err := conn.Channel()
			if err != nil {
				return
			}
			defer ch.Close()
			for _, n := range []string{q, q + ".poison", q + ".wait.1s", q + ".wait.2s", q + ".wait.30s", q + ".wait.500ms", legacy, unrelated} {
				_, _ = ch.QueueDelete(n, false, false, false)
			}
		})

		inspectRetry(t, uri, queueType, q, time.Second, 2*time.Second, 30*time.Second) // the earlier deploy
		cur := inspectRetry(t, uri, queueType, q, 500*time.Millisecond, 2*time.Second)
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		side := amqp.Table{}
		if queueType == amqpretry.QueueTypeQuorum {
			side["x-queue-type"] = "quorum"
		}
		legacyArgs := amqp.Table{"x-message-ttl": int64(60000), "x-dead-letter-exchange": "", "x-dead-letter-routing-key": q}
		for k, v := range side {
			legacyArgs[k] = v
		}
		if _, err := ch.QueueDeclare(legacy, true, false, false, false, legacyArgs); err != nil {
			t.Fatal(err)
		}
		if _, err := ch.QueueDeclare(unrelated, true, false, false, false, side); err != nil {
			t.Fatal(err)
		}
		// One waiting retry in the 30s orphan (it comes back to Q in 30 s).
		if err := ch.PublishWithContext(context.Background(), "", q+".wait.30s", true, false,
			amqp.Publishing{Body: []byte("waiting"), DeliveryMode: amqp.Persistent}); err != nil {
			t.Fatal(err)
		}
		_ = ch.Close()

		ctx := context.Background()
		topo := cur.Topology()
		var rep *amqpretry.TopologyReport
		// The management API's counts refresh every few seconds: poll.
		waitFor(t, 30*time.Second, "the management API to count the waiting message", func() bool {
			rep, err = topo.Inspect(ctx, mgmt, vhost, q)
			if err != nil {
				t.Fatal(err)
			}
			s, ok := queueState(rep, q+".wait.30s")
			return ok && s.Messages == 1
		})
		t.Logf("report:\n%s", rep)
		if len(rep.Missing) != 0 {
			t.Errorf("Missing = %v, want none", rep.Missing)
		}
		wantOrphans := []string{q + ".wait.1s", q + ".wait.30s", legacy}
		if got := orphanNames(rep); !slices.Equal(got, wantOrphans) {
			t.Errorf("orphans = %v, want %v (by tier)", got, wantOrphans)
		}
		for _, c := range []struct {
			name, role string
			tier       time.Duration
			expected   bool
		}{
			{q, "origin", 0, true},
			{q + ".wait.500ms", "wait", 500 * time.Millisecond, true},
			{q + ".wait.2s", "wait", 2 * time.Second, true},
			{q + ".poison", "poison", 0, true},
			{q + ".wait.1s", "orphan-wait", time.Second, false},
			{q + ".wait.30s", "orphan-wait", 30 * time.Second, false},
			{legacy, "orphan-wait", time.Minute, false},
		} {
			s, ok := queueState(rep, c.name)
			if !ok || !s.Exists || s.Role != c.role || s.Tier != c.tier || s.Expected != c.expected {
				t.Errorf("%s: %+v (found %v), want role %s tier %v expected %v", c.name, s, ok, c.role, c.tier, c.expected)
			}
			if !ok || s.Type != queueType {
				t.Errorf("%s: type %q, want %q", c.name, s.Type, queueType)
			}
		}
		if _, ok := queueState(rep, unrelated); ok {
			t.Errorf("%s (no TTL, no dead-letter route to Q) reported", unrelated)
		}
		for _, want := range []string{"orphan-wait", "30s", "orphan"} {
			if !strings.Contains(rep.String(), want) {
				t.Errorf("table lacks %q:\n%s", want, rep)
			}
		}

		deleted, kept, err := topo.TidyOrphans(ctx, mgmt, vhost, q, conn.Channel)
		if err != nil {
			t.Fatal(err)
		}
		if want := []string{q + ".wait.1s", legacy}; !slices.Equal(deleted, want) {
			t.Errorf("deleted %v, want %v", deleted, want)
		}
		if len(kept) != 1 || kept[0].Name != q+".wait.30s" || kept[0].Reason != "not empty" {
			t.Errorf("kept %+v, want %s.wait.30s (not empty)", kept, q)
		}
		// The waiting message is still there.
		ch, err = conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if st, err := ch.QueueDeclarePassive(q+".wait.30s", true, false, false, false, nil); err != nil || st.Messages != 1 {
			t.Errorf("kept orphan: %+v, %v; want 1 message", st, err)
		}
		_ = ch.Close()
		rep, err = topo.Inspect(ctx, mgmt, vhost, q)
		if err != nil {
			t.Fatal(err)
		}
		if got := orphanNames(rep); !slices.Equal(got, []string{q + ".wait.30s"}) {
			t.Errorf("orphans after tidy = %v", got)
		}

		if err := cur.DeleteQueuesAndOrphans(ctx, mgmt, q); err != nil {
			t.Fatal(err)
		}
		rep, err = topo.Inspect(ctx, mgmt, vhost, q)
		if err != nil {
			t.Fatal(err)
		}
		if len(rep.Orphans) != 0 || len(rep.Missing) != 5 {
			t.Errorf("after DeleteQueuesAndOrphans: orphans %v, missing %v; want none, all 5 (Q, 2 wait queues, poison, quarantine)\n%s", orphanNames(rep), rep.Missing, rep)
		}
		if !strings.Contains(rep.String(), "missing") {
			t.Errorf("table lacks the missing state:\n%s", rep)
		}
		if _, ok := queueState(rep, unrelated); ok {
			t.Errorf("%s reported", unrelated)
		}
	})
}

// A management URL that is not http(s) is refused without showing its
// password; an unknown vhost is an error.
func TestInspectErrors(t *testing.T) {
	mgmt := testkit.HaveMgmt(t)
	uri := e2eURI(t)
	r, err := amqpretry.New(amqpretry.Config{URI: uri, Subscriber: wamqp.NewDurableQueueConfig(uri), Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	_, err = r.Topology().Inspect(context.Background(), "ftp://user:s3cret@host/", "/", "q")
	if err == nil || strings.Contains(err.Error(), "s3cret") {
		t.Errorf("bad URL: %v", err)
	}
	_, err = r.Topology().Inspect(context.Background(), mgmt, "no-such-vhost-"+watermill.NewShortUUID(), "q")
	if err == nil || !strings.Contains(err.Error(), "not found") {
		t.Errorf("unknown vhost: %v", err)
	}
}
