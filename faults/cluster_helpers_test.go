package faults

// Helpers of the cluster fault tests (cluster_test.go): the 3-node cluster
// (node control, queue leaders, connections), a storm producer that keeps
// publishing while nodes die, and a timeline of what the consumer did.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// ---------------------------------------------------------------------------
// cluster: the broker under test when RABBITRETRY_BROKER=cluster.

type cluster struct {
	t     *testing.T
	nodes []string          // short names, e.g. n1 n2 n3
	uris  map[string]string // short name -> AMQP URI of that node alone

	mu       sync.Mutex
	down     map[string]bool // nodes this test took down
	restorer bool            // restore registered with t.Cleanup
}

// requireCluster skips the test unless the broker under test is the 3-node
// cluster (RABBITRETRY_BROKER=cluster, from `scripts/brokers.sh env
// cluster`) and disruptive tests are allowed (RABBITRETRY_FAULTS=1). With
// RABBITRETRY_BROKER=cluster but an incomplete environment it fails under
// CI=true and skips otherwise. It waits until every node runs.
func requireCluster(t *testing.T) *cluster {
	t.Helper()
	if testkit.Broker() != "cluster" {
		t.Skip(`kills cluster nodes: run against the 3-node cluster (eval "$(scripts/brokers.sh env cluster)", RABBITRETRY_BROKER=cluster)`)
	}
	requireDisruptive(t)
	nodes := testkit.Nodes()
	uris := strings.Fields(os.Getenv("RABBITRETRY_NODE_URIS"))
	var missing string
	switch {
	case len(nodes) < 3:
		missing = "RABBITRETRY_NODES (3 node names)"
	case len(uris) != len(nodes):
		missing = "RABBITRETRY_NODE_URIS (one AMQP URI per node)"
	case os.Getenv("RABBITRETRY_NODE_CTL") == "":
		missing = "RABBITRETRY_NODE_CTL"
	case os.Getenv("RABBITRETRY_CTL") == "":
		missing = "RABBITRETRY_CTL"
	case os.Getenv("AMQP_URI") == "":
		missing = "AMQP_URI (the cluster's load balancer)"
	}
	if missing != "" {
		msg := fmt.Sprintf(`RABBITRETRY_BROKER=cluster without %s: eval "$(scripts/brokers.sh env cluster)"`, missing)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	haveRabbitmqctl(t)
	c := &cluster{t: t, uris: map[string]string{}, down: map[string]bool{}}
	for i, n := range nodes {
		s := shortNode(n)
		c.nodes = append(c.nodes, s)
		c.uris[s] = uris[i]
	}
	c.ensureUp()
	return c
}

// shortNode turns "n1@localhost" into "n1".
func shortNode(n string) string {
	if i := strings.IndexByte(n, '@'); i >= 0 {
		return n[:i]
	}
	return n
}

// running returns the running nodes (short names) as cluster_status sees them.
func (c *cluster) running() ([]string, error) {
	out, err := rabbitmqctl(c.t, 60*time.Second, "-q", "cluster_status", "--formatter", "json")
	if err != nil {
		return nil, err
	}
	var st struct {
		Running []string `json:"running_nodes"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		return nil, fmt.Errorf("parsing cluster_status: %w\n%s", err, out)
	}
	var r []string
	for _, n := range st.Running {
		r = append(r, shortNode(n))
	}
	sort.Strings(r)
	return r, nil
}

// ensureUp starts any node that does not run (left down by an earlier,
// failed run).
func (c *cluster) ensureUp() {
	c.t.Helper()
	run, err := c.running()
	if err != nil {
		c.t.Fatalf("cluster status: %v", err)
	}
	for _, n := range c.nodes {
		if !slices.Contains(run, n) {
			c.t.Logf("node %s is not running: starting it", n)
			if out, err := testkit.NodeCtl(c.t, 4*time.Minute, "start", n); err != nil {
				c.t.Fatalf("starting %s: %v\n%s", n, err, out)
			}
		}
	}
}

// restoreLater registers (once) a cleanup that starts every node this test
// took down, even when the test fails. It runs before the cleanups
// registered earlier (the env's queue deletion).
func (c *cluster) restoreLater() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.restorer {
		return
	}
	c.restorer = true
	c.t.Cleanup(func() {
		c.mu.Lock()
		var down []string
		for n := range c.down {
			down = append(down, n)
		}
		c.mu.Unlock()
		sort.Strings(down)
		for _, n := range down {
			start := time.Now()
			if out, err := testkit.NodeCtl(c.t, 4*time.Minute, "start", n); err != nil {
				c.t.Errorf("cleanup: starting %s: %v\n%s", n, err, out)
				continue
			}
			c.mu.Lock()
			delete(c.down, n)
			c.mu.Unlock()
			c.t.Logf("cleanup: %s started again and clustered in %v", n, time.Since(start).Round(100*time.Millisecond))
		}
		if run, err := c.running(); err != nil || len(run) != len(c.nodes) {
			c.t.Errorf("cleanup: cluster not whole again: running %v (%v)", run, err)
		}
	})
}

func (c *cluster) nodeCtl(verb, node string, timeout time.Duration) time.Duration {
	c.t.Helper()
	c.restoreLater()
	if verb != "start" {
		c.mu.Lock()
		c.down[node] = true
		c.mu.Unlock()
	}
	start := time.Now()
	if out, err := testkit.NodeCtl(c.t, timeout, verb, node); err != nil {
		c.t.Fatalf("%s %s: %v\n%s", verb, node, err, out)
	}
	if verb == "start" {
		c.mu.Lock()
		delete(c.down, node)
		c.mu.Unlock()
	}
	return time.Since(start)
}

// kill kill -9s the node's Erlang VM (a crash).
func (c *cluster) kill(node string) time.Duration { return c.nodeCtl("kill", node, time.Minute) }

// stop stops the node cleanly (rabbitmqctl stop).
func (c *cluster) stop(node string) time.Duration { return c.nodeCtl("stop", node, 3*time.Minute) }

// start starts the node and waits until it runs, is clustered and HAProxy
// sees it.
func (c *cluster) start(node string) time.Duration { return c.nodeCtl("start", node, 4*time.Minute) }

// queueInfo is one row of list_queues.
type queueInfo struct {
	Leader  string   // short name; "" when none is known
	Members []string // short names
	Online  []string // members on running nodes
}

// queues returns leader and members of the named queues (absent from the
// map: not listed). An error is returned, not fatal: the listing may time
// out while a node dies.
func (c *cluster) queues(names ...string) (map[string]queueInfo, error) {
	out, err := rabbitmqctl(c.t, 30*time.Second, "-q", "list_queues", "name", "leader", "members", "online", "--formatter", "json")
	if err != nil {
		return nil, err
	}
	var rows []struct {
		Name    string          `json:"name"`
		Leader  json.RawMessage `json:"leader"`
		Members json.RawMessage `json:"members"`
		Online  json.RawMessage `json:"online"`
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		return nil, fmt.Errorf("parsing list_queues: %w\n%.2000s", err, out)
	}
	want := map[string]bool{}
	for _, n := range names {
		want[n] = true
	}
	m := map[string]queueInfo{}
	for _, r := range rows {
		if !want[r.Name] {
			continue
		}
		var qi queueInfo
		var leader string
		if json.Unmarshal(r.Leader, &leader) == nil {
			qi.Leader = shortNode(leader)
		}
		qi.Members = shortNodes(r.Members)
		qi.Online = shortNodes(r.Online)
		m[r.Name] = qi
	}
	return m, nil
}

func shortNodes(raw json.RawMessage) []string {
	var ns []string
	if json.Unmarshal(raw, &ns) != nil {
		return nil
	}
	for i, n := range ns {
		ns[i] = shortNode(n)
	}
	sort.Strings(ns)
	return ns
}

// leaders returns queue -> leading node for the named queues.
func (c *cluster) leaders(names ...string) (map[string]string, error) {
	qs, err := c.queues(names...)
	if err != nil {
		return nil, err
	}
	m := map[string]string{}
	for n, qi := range qs {
		m[n] = qi.Leader
	}
	return m, nil
}

// waitLeaders waits until every named queue has a leader on a running node
// other than avoid, with want online members (0: don't check), and returns
// how long that took and the leaders.
func (c *cluster) waitLeaders(names []string, avoid string, want int, timeout time.Duration) (time.Duration, map[string]string) {
	c.t.Helper()
	start := time.Now()
	var last map[string]queueInfo
	var lastErr error
	ok := poll(timeout, func() bool {
		qs, err := c.queues(names...)
		if err != nil {
			lastErr = err
			return false
		}
		last = qs
		for _, n := range names {
			qi, found := qs[n]
			if !found || qi.Leader == "" || qi.Leader == avoid || !slices.Contains(qi.Online, qi.Leader) {
				return false
			}
			if want > 0 && len(qi.Online) < want {
				return false
			}
		}
		return true
	})
	if !ok {
		c.t.Fatalf("queues not led by a running node other than %q with %d online members within %v: %v (last error %v)", avoid, want, timeout, last, lastErr)
	}
	m := map[string]string{}
	for n, qi := range last {
		m[n] = qi.Leader
	}
	return time.Since(start), m
}

// connectionNodes returns, for each connection name given, the nodes its
// connections are on (list_connections pids name their node).
func (c *cluster) connectionNodes(names ...string) map[string][]string {
	c.t.Helper()
	m := map[string][]string{}
	for _, conn := range listConnections(c.t) {
		if !slices.Contains(names, conn.Name) {
			continue
		}
		node := strings.TrimPrefix(conn.PID, "<")
		if i := strings.IndexByte(node, '.'); i >= 0 {
			node = node[:i]
		}
		m[conn.Name] = append(m[conn.Name], shortNode(node))
	}
	return m
}

// declareSpread declares e's topology with Q led by qNode, the wait queues
// by waitNode and the poison queue by poisonNode. RabbitMQ 4.x places a new
// quorum queue's leader on the node the declaring client is connected to
// (queue_leader_locator client-local, the default; checked on 4.3.6). The
// library declares Q, the wait queues and the poison queue in one go, so
// the whole topology is declared through qNode, then the (still empty) wait
// and poison queues are deleted and declared again by the library's
// DeclareRetry through waitNode, then the poison queue once more through
// poisonNode. Every declare is the library's own (same arguments), so the
// consumer's redeclares later are no-ops. It fails the test unless the
// leaders are where asked.
func (c *cluster) declareSpread(e *env, qNode, waitNode, poisonNode string) {
	c.t.Helper()
	topo := e.retry.Topology()
	onNode := func(node string, f func(ch *amqp.Channel) error) {
		c.t.Helper()
		conn, err := amqp.DialConfig(c.uris[node], amqp.Config{Dial: amqp.DefaultDial(10 * time.Second)})
		if err != nil {
			c.t.Fatalf("dialling %s: %v", node, err)
		}
		defer conn.Close()
		ch, err := conn.Channel()
		if err != nil {
			c.t.Fatalf("channel on %s: %v", node, err)
		}
		defer ch.Close()
		if err := f(ch); err != nil {
			c.t.Fatalf("declaring through %s: %v", node, err)
		}
	}
	deleteQueues := func(ch *amqp.Channel, qs ...string) error {
		for _, q := range qs {
			if _, err := ch.QueueDelete(q, false, false, false); err != nil {
				return err
			}
		}
		return nil
	}
	onNode(qNode, func(ch *amqp.Channel) error {
		return topo.BuildTopology(ch, e.queue, e.exchange, e.retry.SubscriberConfig(), watermill.NopLogger{})
	})
	if waitNode != qNode {
		onNode(waitNode, func(ch *amqp.Channel) error {
			if err := deleteQueues(ch, append(e.waitQueues(), e.poisonQueue())...); err != nil {
				return err
			}
			return topo.DeclareRetry(ch, e.queue)
		})
	}
	if poisonNode != waitNode {
		onNode(poisonNode, func(ch *amqp.Channel) error {
			if err := deleteQueues(ch, e.poisonQueue()); err != nil {
				return err
			}
			return topo.DeclareRetry(ch, e.queue)
		})
	}
	want := map[string]string{e.queue: qNode, e.poisonQueue(): poisonNode}
	for _, wq := range e.waitQueues() {
		want[wq] = waitNode
	}
	var got map[string]string
	ok := poll(30*time.Second, func() bool {
		var err error
		got, err = c.leaders(e.allQueues()...)
		if err != nil {
			return false
		}
		for q, n := range want {
			if got[q] != n {
				return false
			}
		}
		return true
	})
	if !ok {
		c.t.Fatalf("quorum queue leaders %v, want %v", got, want)
	}
	c.t.Logf("leaders: Q %s on %s, wait queues %v on %s, poison %s on %s",
		e.queue, qNode, e.waitQueues(), waitNode, e.poisonQueue(), poisonNode)
}

// ---------------------------------------------------------------------------
// fates: what the handler does with each message.

var errRejected = errors.New("rejected by the downstream service")

type fate struct {
	transient int  // transient failures before the outcome
	poison    bool // then middleware.Permanent instead of success
}

type fates struct {
	mu sync.Mutex
	m  map[string]fate
}

func newFates() *fates { return &fates{m: map[string]fate{}} }

// add draws fates for uuids: poisonPercent% are poisoned (half of them on
// the first attempt, half after one transient failure); of the others, 30%
// fail transiently once or twice, the rest succeed at once.
func (f *fates) add(uuids []string, poisonPercent int, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, 0xc1a5))
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, u := range uuids {
		switch {
		case rng.IntN(100) < poisonPercent:
			f.m[u] = fate{transient: rng.IntN(2), poison: true}
		case rng.IntN(100) < 30:
			f.m[u] = fate{transient: 1 + rng.IntN(2)}
		default:
			f.m[u] = fate{}
		}
	}
}

func (f *fates) get(u string) (fate, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	x, ok := f.m[u]
	return x, ok
}

// ---------------------------------------------------------------------------
// timeline: when the consumer did what.

type timeline struct {
	mu     sync.Mutex
	events map[string][]time.Time
	// redelivered: UUID -> highest rabbitretry-redeliveries the handler saw.
	redelivered map[string]int
}

func newTimeline() *timeline {
	return &timeline{events: map[string][]time.Time{}, redelivered: map[string]int{}}
}

func (tl *timeline) add(kind string) {
	now := time.Now()
	tl.mu.Lock()
	tl.events[kind] = append(tl.events[kind], now)
	tl.mu.Unlock()
}

func (tl *timeline) count(kind string) int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return len(tl.events[kind])
}

// countSince returns the events of kind at or after t0.
func (tl *timeline) countSince(kind string, t0 time.Time) int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	n := 0
	for _, at := range tl.events[kind] {
		if !at.Before(t0) {
			n++
		}
	}
	return n
}

// pause returns the longest time without an event of kind in [from, to]
// (from counts as an event: the fault), and when that gap ended (relative to
// from). With no event in the window it returns the whole window and -1.
func (tl *timeline) pause(kind string, from, to time.Time) (gap, resumedAfter time.Duration) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	prev := from
	resumedAfter = -1
	for _, at := range tl.events[kind] {
		if at.Before(from) || at.After(to) {
			continue
		}
		if d := at.Sub(prev); d > gap {
			gap, resumedAfter = d, at.Sub(from)
		}
		prev = at
	}
	if prev == from {
		return to.Sub(from), -1
	}
	return gap, resumedAfter
}

func (tl *timeline) sawRedelivered(u string, n int) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	if n > tl.redelivered[u] {
		tl.redelivered[u] = n
	}
}

// redeliveredRuns returns how many UUIDs ran with rabbitretry-redeliveries
// >= 1, and the highest count seen.
func (tl *timeline) redeliveredRuns() (uuids, highest int) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	for _, n := range tl.redelivered {
		uuids++
		highest = max(highest, n)
	}
	return uuids, highest
}

// Event kinds.
const (
	evRun      = "handler run"      // any handler run
	evRetryRun = "retry run"        // a handler run with attempt > 1
	evSuccess  = "success"          // a handler run that succeeded
	evRetry    = "Retry scheduled"  // the library's log: retry copy confirmed
	evPoisoned = "Message poisoned" // the library's log: poison copy confirmed
	evRedeliv  = "Redelivered message counted and requeued as a copy"
)

// timedLogger forwards to next and timestamps the library's log messages
// listed in timedMessages.
type timedLogger struct {
	next watermill.LoggerAdapter
	tl   *timeline
}

var timedMessages = []string{evRetry, evPoisoned, evRedeliv}

func (l timedLogger) mark(msg string) {
	for _, m := range timedMessages {
		if msg == m {
			l.tl.add(m)
		}
	}
}
func (l timedLogger) Error(msg string, err error, f watermill.LogFields) {
	l.mark(msg)
	l.next.Error(msg, err, f)
}
func (l timedLogger) Info(msg string, f watermill.LogFields)  { l.mark(msg); l.next.Info(msg, f) }
func (l timedLogger) Debug(msg string, f watermill.LogFields) { l.mark(msg); l.next.Debug(msg, f) }
func (l timedLogger) Trace(msg string, f watermill.LogFields) { l.next.Trace(msg, f) }
func (l timedLogger) With(f watermill.LogFields) watermill.LoggerAdapter {
	return timedLogger{next: l.next.With(f), tl: l.tl}
}

// withTimeline makes the Retry log through a timedLogger feeding tl.
func withTimeline(tl *timeline) envOption {
	return func(e *env, c *amqpretry.Config) { c.Logger = timedLogger{next: e.logs, tl: tl} }
}

// clusterHandler acts out each message's fate, recording attempts and
// successes in l and the runs in tl.
func clusterHandler(l *ledger, tl *timeline, fs *fates) message.NoPublishHandlerFunc {
	return func(msg *message.Message) error {
		f, known := fs.get(msg.UUID)
		if !known {
			l.phantom(msg)
			return nil
		}
		a := middleware.Attempt(msg)
		l.attempt(msg.UUID, a)
		tl.add(evRun)
		if a > 1 {
			tl.add(evRetryRun)
		}
		if r, err := strconv.Atoi(msg.Metadata.Get(retrymeta.RedeliveriesKey)); err == nil && r > 0 {
			tl.sawRedelivered(msg.UUID, r)
		}
		time.Sleep(time.Millisecond) // simulated work
		switch {
		case a <= f.transient:
			return errTransient
		case f.poison:
			return middleware.Permanent(errRejected)
		}
		l.success(msg.UUID)
		tl.add(evSuccess)
		return nil
	}
}

// ---------------------------------------------------------------------------
// producer: publishes waves to the business exchange through the load
// balancer, with confirms, and publishes again what a dying node did not
// confirm. A message counts as published once confirmed.

type producer struct {
	t        *testing.T
	e        *env
	fs       *fates
	poisonPc int
	wave     int
	pace     time.Duration

	mu        sync.Mutex
	conn      *amqp.Connection
	published []string
	inDoubt   map[string]bool // given up on: never confirmed
	resent    int             // publishes repeated after no confirm
	returned  int             // basic.returns (unroutable), repeated too
	errs      []string
	seed      uint64
	// reported: errors and returns already failed the test (report may be
	// called more than once).
	reportedErrs, reportedReturns int

	stopCh chan struct{}
	done   chan struct{}
}

func newProducer(t *testing.T, e *env, fs *fates, poisonPercent, wave int, pace time.Duration) *producer {
	p := &producer{t: t, e: e, fs: fs, poisonPc: poisonPercent, wave: wave, pace: pace, inDoubt: map[string]bool{}}
	t.Cleanup(func() {
		p.stop()
		p.mu.Lock()
		defer p.mu.Unlock()
		if p.conn != nil {
			_ = p.conn.Close()
		}
	})
	return p
}

// run publishes waves every pace until stop, or until limit messages were
// published (limit 0: no limit), in the background.
func (p *producer) run(limit int) {
	p.stopCh, p.done = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(p.done)
		sent := 0
		for limit == 0 || sent < limit {
			select {
			case <-p.stopCh:
				return
			default:
			}
			n := p.wave
			if limit > 0 {
				n = min(n, limit-sent)
			}
			p.mu.Lock()
			p.seed++
			seed := p.seed
			p.mu.Unlock()
			uuids, ps := newMessages(n, nil)
			p.fs.add(uuids, p.poisonPc, seed)
			p.send(uuids, ps)
			sent += n
			select {
			case <-p.stopCh:
				return
			case <-time.After(p.pace): // paces the storm
			}
		}
	}()
}

// stop stops publishing and waits for the wave in progress.
func (p *producer) stop() {
	if p.stopCh == nil {
		return
	}
	select {
	case <-p.stopCh:
	default:
		close(p.stopCh)
	}
	<-p.done
}

func (p *producer) errorf(format string, args ...any) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.errs = append(p.errs, fmt.Sprintf(format, args...))
}

func (p *producer) channel() (*amqp.Channel, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.conn == nil || p.conn.IsClosed() {
		conn, err := amqp.DialConfig(p.e.uri, amqp.Config{
			Dial:       amqp.DefaultDial(5 * time.Second),
			Properties: amqp.Table{"connection_name": p.e.prefix + ".producer"},
		})
		if err != nil {
			return nil, err
		}
		p.conn = conn
	}
	return p.conn.Channel()
}

// send publishes ps until each is confirmed, for up to 90 s.
func (p *producer) send(uuids []string, ps []amqp.Publishing) {
	index := make(map[string]int, len(uuids))
	pending := make([]int, len(uuids))
	for i, u := range uuids {
		index[u], pending[i] = i, i
	}
	deadline := time.Now().Add(90 * time.Second)
	for round := 0; len(pending) > 0; round++ {
		if round > 0 {
			if time.Now().After(deadline) {
				p.mu.Lock()
				for _, i := range pending {
					p.inDoubt[uuids[i]] = true
				}
				p.mu.Unlock()
				p.errorf("gave up on %d publishes never confirmed in 90 s", len(pending))
				return
			}
			p.mu.Lock()
			p.resent += len(pending)
			p.mu.Unlock()
			time.Sleep(200 * time.Millisecond) // backoff before publishing again
		}
		pending = p.sendOnce(uuids, ps, pending, index)
	}
	p.mu.Lock()
	p.published = append(p.published, uuids...)
	p.mu.Unlock()
}

// sendOnce publishes ps[pending] on a fresh channel and returns the indices
// not confirmed (nacked, returned, or cut off by a closed channel).
func (p *producer) sendOnce(uuids []string, ps []amqp.Publishing, pending []int, index map[string]int) []int {
	ch, err := p.channel()
	if err != nil {
		return pending
	}
	defer ch.Close()
	if err := ch.Confirm(false); err != nil {
		return pending
	}
	returns := ch.NotifyReturn(make(chan amqp.Return, len(pending)+1))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	dcs := make([]*amqp.DeferredConfirmation, len(pending))
	for j, i := range pending {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, p.e.exchange, routingKey, true, false, ps[i])
		if err != nil {
			break
		}
		dcs[j] = dc
	}
	failed := map[int]bool{}
	for j, dc := range dcs {
		if dc == nil {
			failed[pending[j]] = true
			continue
		}
		if ok, err := dc.WaitContext(ctx); !ok || err != nil {
			failed[pending[j]] = true
		}
	}
	// Drain the returns that came; a closed channel (the connection died
	// mid-wave) closes returns too, and a receive from it must end the loop,
	// not spin on zero values.
drain:
	for {
		select {
		case r, ok := <-returns:
			if !ok {
				break drain
			}
			u, _ := r.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
			if i, ok := index[u]; ok {
				failed[i] = true
			}
			p.mu.Lock()
			p.returned++
			p.mu.Unlock()
		default:
			break drain
		}
	}
	var out []int
	for _, i := range pending {
		if failed[i] {
			out = append(out, i)
		}
	}
	return out
}

// report returns the confirmed UUIDs, those given up on, and logs the
// publishing trouble; producer errors fail the test.
func (p *producer) report() (published []string, inDoubt map[string]bool) {
	p.t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.t.Logf("producer: %d confirmed, %d publishes repeated after no confirm, %d returned unroutable",
		len(p.published), p.resent, p.returned)
	for _, e := range p.errs[p.reportedErrs:] {
		p.t.Errorf("producer: %s", e)
	}
	if p.returned > p.reportedReturns {
		p.t.Errorf("producer: %d messages returned unroutable by the business exchange", p.returned-p.reportedReturns)
	}
	p.reportedErrs, p.reportedReturns = len(p.errs), p.returned
	return slices.Clone(p.published), maps.Clone(p.inDoubt)
}

// ---------------------------------------------------------------------------
// leaderWatch samples the leaders of a set of queues (a list_queues call,
// about 1 s of CPU, then a 1 s pause: one sample every 2 s or so) and
// records every change.

type leaderWatch struct {
	c      *cluster
	labels map[string]string // queue -> label for the log
	t0     time.Time

	mu      sync.Mutex
	last    map[string]string
	changes []string
	stopCh  chan struct{}
	done    chan struct{}
}

func (c *cluster) watchLeaders(labels map[string]string) *leaderWatch {
	w := &leaderWatch{c: c, labels: labels, t0: time.Now(), last: map[string]string{},
		stopCh: make(chan struct{}), done: make(chan struct{})}
	var names []string
	for q := range labels {
		names = append(names, q)
	}
	go func() {
		defer close(w.done)
		for {
			if ls, err := c.leaders(names...); err == nil {
				w.record(ls)
			}
			select {
			case <-w.stopCh:
				return
			case <-time.After(time.Second): // sampling interval, spares the CPU
			}
		}
	}()
	c.t.Cleanup(w.stop)
	return w
}

func (w *leaderWatch) record(ls map[string]string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	var qs []string
	for q := range ls {
		qs = append(qs, q)
	}
	sort.Strings(qs)
	for _, q := range qs {
		now, before := ls[q], w.last[q]
		if now == before {
			continue
		}
		if before != "" {
			if now == "" {
				now = "(none)"
			}
			w.changes = append(w.changes, fmt.Sprintf("+%.1fs %s %s->%s", time.Since(w.t0).Seconds(), w.labels[q], before, now))
		}
		if ls[q] != "" {
			w.last[q] = ls[q]
		}
	}
}

// mark records an event (a kill, a start) in the same sequence.
func (w *leaderWatch) mark(what string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.changes = append(w.changes, fmt.Sprintf("+%.1fs [%s]", time.Since(w.t0).Seconds(), what))
}

func (w *leaderWatch) stop() {
	select {
	case <-w.stopCh:
	default:
		close(w.stopCh)
	}
	<-w.done
}

// report stops the watch and returns the sequence of changes and marks.
func (w *leaderWatch) report() string {
	w.stop()
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.changes) == 0 {
		return "none"
	}
	return strings.Join(w.changes, ", ")
}
