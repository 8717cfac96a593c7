package amqpretry_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/router"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
)

// forEachQueueType runs f for classic and quorum originating queues.
func forEachQueueType(t *testing.T, f func(t *testing.T, queueType string)) {
	for _, qt := range []string{amqpretry.QueueTypeClassic, amqpretry.QueueTypeQuorum} {
		t.Run(qt, func(t *testing.T) { f(t, qt) })
	}
}

// testEnv is one business exchange with queues bound by the same routing
// key, a retry chain and a router.
type testEnv struct {
	t         *testing.T
	uri       string
	prefix    string
	exchange  string
	queueType string
	retry     *amqpretry.Retry
	sub       *wamqp.Subscriber
	router    *message.Router
	conn      *amqp.Connection
	ch        *amqp.Channel
	queues    []string
	cancel    context.CancelFunc
	done      chan struct{}
}

type envOption func(*amqpretry.Config)

func newEnv(t *testing.T, queueType string, opts ...envOption) *testEnv {
	t.Helper()
	uri := e2eURI(t)
	prefix := fmt.Sprintf("it.%s.%s", strings.NewReplacer("/", ".", " ", "_").Replace(t.Name()), watermill.NewShortUUID()[:6])
	e := &testEnv{t: t, uri: uri, prefix: prefix, exchange: prefix + ".biz", queueType: queueType}

	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	e.conn = conn
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	e.ch = ch

	subCfg := wamqp.NewDurableQueueConfig(uri)
	subCfg.Exchange = wamqp.ExchangeConfig{GenerateName: func(string) string { return e.exchange }, Type: "direct", Durable: true}
	subCfg.QueueBind = wamqp.QueueBindConfig{GenerateRoutingKey: func(string) string { return "order.created" }}
	subCfg.Consume.Qos.PrefetchCount = 32

	cfg := amqpretry.Config{
		URI: uri, Subscriber: subCfg, QueueType: queueType, Policy: router.Policy{MaxAttempts: 3, Backoff: fixedBackoff(100 * time.Millisecond)},
		Logger: watermill.NopLogger{},
	}
	for _, o := range opts {
		o(&cfg)
	}
	r, err := amqpretry.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	e.retry = r
	sub, err := wamqp.NewSubscriber(r.SubscriberConfig(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	e.sub = sub
	rt, err := message.NewRouter(message.RouterConfig{CloseTimeout: 5 * time.Second}, watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	rt.AddMiddleware(r.Middleware)
	e.router = rt
	t.Cleanup(e.close)
	return e
}

// queue returns the name of the queue for a service and registers it for
// deletion.
func (e *testEnv) queue(service string) string {
	q := e.prefix + "." + service
	e.queues = append(e.queues, q)
	return q
}

func (e *testEnv) handle(service string, h message.NoPublishHandlerFunc) string {
	q := e.queue(service)
	e.router.AddConsumerHandler(service, q, e.sub, h)
	return q
}

func (e *testEnv) start() {
	ctx, cancel := context.WithCancel(context.Background())
	e.cancel = cancel
	e.done = make(chan struct{})
	go func() {
		defer close(e.done)
		if err := e.router.Run(ctx); err != nil {
			e.t.Errorf("router: %v", err)
		}
	}()
	select {
	case <-e.router.Running():
	case <-time.After(20 * time.Second):
		e.t.Fatal("router did not start")
	}
}

func (e *testEnv) stopRouter() {
	if e.cancel != nil {
		_ = e.router.Close()
		e.cancel()
		<-e.done
		e.cancel = nil
	}
}

func (e *testEnv) close() {
	e.stopRouter()
	_ = e.sub.Close()
	_ = e.retry.Close()
	ch, err := e.conn.Channel()
	if err == nil {
		for _, q := range e.queues {
			for _, name := range append(e.retry.Topology().WaitQueues(q), q, e.retry.Topology().Naming().PoisonQueue(q), e.retry.Topology().Naming().QuarantineQueue(q)) {
				_, _ = ch.QueueDelete(name, false, false, false)
			}
		}
		_ = ch.ExchangeDelete(e.exchange, false, false)
		_ = ch.Close()
	}
	_ = e.conn.Close()
}

// publish sends payloads to the business exchange with the shared routing key.
func (e *testEnv) publish(msgs ...*message.Message) {
	e.t.Helper()
	m := amqpretry.Marshaler{}
	for _, msg := range msgs {
		p, err := m.Marshal(msg)
		if err != nil {
			e.t.Fatal(err)
		}
		if err := e.ch.PublishWithContext(context.Background(), e.exchange, "order.created", false, false, p); err != nil {
			e.t.Fatal(err)
		}
	}
}

// depth returns the number of ready messages in queue q.
func (e *testEnv) depth(q string) int {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	st, err := ch.QueueDeclarePassive(q, false, false, false, false, nil)
	if err != nil {
		e.t.Fatalf("inspecting %s: %v", q, err)
	}
	return st.Messages
}

// waitQueuesEmpty waits until every wait queue of q is empty.
func (e *testEnv) waitQueuesEmpty(q string, timeout time.Duration) {
	e.t.Helper()
	waitFor(e.t, timeout, "wait queues of "+q+" to drain", func() bool {
		for _, wq := range e.retry.Topology().WaitQueues(q) {
			if e.depth(wq) != 0 {
				return false
			}
		}
		return true
	})
}

// drain gets all messages from q (acking them).
func (e *testEnv) drain(q string) []amqp.Delivery {
	e.t.Helper()
	ch, err := e.conn.Channel()
	if err != nil {
		e.t.Fatal(err)
	}
	defer ch.Close()
	var out []amqp.Delivery
	for {
		d, ok, err := ch.Get(q, true)
		if err != nil {
			e.t.Fatal(err)
		}
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

// recorder records attempts per message UUID.
type recorder struct {
	mu       sync.Mutex
	attempts map[string][]int
	times    map[string][]time.Time
	meta     map[string][]message.Metadata
}

func newRecorder() *recorder {
	return &recorder{attempts: map[string][]int{}, times: map[string][]time.Time{}, meta: map[string][]message.Metadata{}}
}

func (r *recorder) record(msg *message.Message, attempt int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.attempts[msg.UUID] = append(r.attempts[msg.UUID], attempt)
	r.times[msg.UUID] = append(r.times[msg.UUID], time.Now())
	md := message.Metadata{}
	for k, v := range msg.Metadata {
		md[k] = v
	}
	r.meta[msg.UUID] = append(r.meta[msg.UUID], md)
}

func (r *recorder) count(uuid string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.attempts[uuid])
}

func (r *recorder) get(uuid string) ([]int, []time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]int(nil), r.attempts[uuid]...), append([]time.Time(nil), r.times[uuid]...)
}

var errTransient = errors.New("dependency unavailable")

func e2eURI(t testing.TB) string { return testkit.URI(t) }

func waitFor(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	testkit.WaitFor(t, timeout, what, cond)
}

var fixedBackoff = testkit.ExactBackoff
