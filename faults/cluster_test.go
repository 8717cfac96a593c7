package faults

// Cluster faults: a RabbitMQ 3-node cluster behind a load balancer
// (scripts/brokers.sh up cluster), quorum queues with their leaders spread
// over the nodes (Q on the first node, the wait queues on the second, the
// poison queue on the third), a storm of messages of which 30% fail
// transiently once or twice (and, in the poison test, 20% are rejected with
// middleware.Permanent), and a node killed with kill -9, stopped, or left
// down. Every test ends with the ACCOUNT line: nothing may be lost.
//
// Duplicates are allowed (at-least-once) and counted. Seen: acks lost with
// the subscriber's connection when its node dies (the prefetch window is
// redelivered, counted by the RedeliveryGuard and run again); a retry or
// poison copy whose confirm died with the retry publisher's connection (the
// fallback copies it back to Q, the unconfirmed copy may have arrived too);
// and, with no redelivery at all, a retry copy run twice after its wait
// queue's leader died (quorum at-least-once dead-lettering done again by
// the new leader).
//
// Run: eval "$(scripts/brokers.sh env cluster)" && RABBITRETRY_FAULTS=1 \
//	go test -race -count=1 -p 1 -run TestCluster -v ./faults/

import (
	"fmt"
	"sort"
	"strings"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// retryPublisherSuffix: amqpretry.New names the retry publisher's
// connection after the subscriber's connection_name.
const retryPublisherSuffix = ".subscriber.retry-publisher"

// clusterRun is one cluster scenario: the cluster, an env with quorum
// queues spread over the nodes, a consumer acting out the fates, and a
// producer.
type clusterRun struct {
	t  *testing.T
	c  *cluster
	e  *env
	l  *ledger
	tl *timeline
	fs *fates
	p  *producer
	lw *leaderWatch

	// Leaders at the start.
	qNode, waitNode, poisonNode string
	poisonPercent               int
}

func newClusterRun(t *testing.T, poisonPercent int) *clusterRun {
	t.Helper()
	c := requireCluster(t)
	tl := newTimeline()
	e := newEnv(t, amqpretry.QueueTypeQuorum, withTimeline(tl))
	r := &clusterRun{
		t: t, c: c, e: e, l: newLedger(), tl: tl, fs: newFates(),
		qNode: c.nodes[0], waitNode: c.nodes[1], poisonNode: c.nodes[2],
		poisonPercent: poisonPercent,
	}
	c.declareSpread(e, r.qNode, r.waitNode, r.poisonNode)
	labels := map[string]string{e.queue: "Q", e.poisonQueue(): "poison"}
	for _, wq := range e.waitQueues() {
		labels[wq] = wq[strings.LastIndexByte(wq, '.')+1:]
	}
	r.lw = c.watchLeaders(labels)
	e.start(clusterHandler(r.l, r.tl, r.fs))
	// 25 messages every 200 ms: about 125 messages/s, less than
	// one consumer (prefetch 16, the harness default) handles on this
	// cluster, so retries are always in flight and Q builds no long backlog.
	r.p = newProducer(t, e, r.fs, poisonPercent, 25, 200*time.Millisecond)
	return r
}

func (r *clusterRun) waiting() int {
	sum := 0
	for _, wq := range r.e.waitQueues() {
		sum += max(r.e.depth(wq), 0)
	}
	return sum
}

// waitStorm waits until minHandled messages were handled with retries
// waiting in the wait queues (and, with poisoning, some poisoned).
func (r *clusterRun) waitStorm(minHandled int) {
	r.t.Helper()
	waitFor(r.t, 60*time.Second, "the storm under way (handled, retries waiting, poisoned)", func() bool {
		if r.l.handled() < minHandled || r.waiting() == 0 {
			return false
		}
		return r.poisonPercent == 0 || r.e.poisonDepth() > 0
	})
}

// logState logs the queues' leaders and depths, and which node each of
// the test's connections is on.
func (r *clusterRun) logState(when string) {
	r.t.Helper()
	qs, err := r.c.queues(r.e.allQueues()...)
	var lead []string
	if err == nil {
		lead = append(lead, fmt.Sprintf("Q@%s", qs[r.e.queue].Leader))
		for _, wq := range r.e.waitQueues() {
			lead = append(lead, fmt.Sprintf("%s@%s", wq[strings.LastIndexByte(wq, '.')+1:], qs[wq].Leader))
		}
		lead = append(lead, fmt.Sprintf("poison@%s", qs[r.e.poisonQueue()].Leader))
	} else {
		lead = []string{"(list_queues failed: " + err.Error() + ")"}
	}
	conns := r.c.connectionNodes(r.e.prefix+".subscriber", r.e.prefix+retryPublisherSuffix, r.e.prefix+".producer")
	r.t.Logf("%s: handled %d, Q %d ready, %d in wait queues, %d in the poison queue; leaders %s; connections: subscriber %v, retry publisher %v, producer %v",
		when, r.l.handled(), r.e.depth(r.e.queue), r.waiting(), r.e.poisonDepth(), strings.Join(lead, " "),
		conns[r.e.prefix+".subscriber"], conns[r.e.prefix+retryPublisherSuffix], conns[r.e.prefix+".producer"])
}

// logPauses logs the longest time without each kind of event in
// [from, to]: how long the fault stopped messages from flowing.
func (r *clusterRun) logPauses(label string, from, to time.Time) {
	r.t.Helper()
	var parts []string
	for _, k := range []string{evRun, evSuccess, evRetryRun, evRetry, evPoisoned} {
		if k == evPoisoned && r.poisonPercent == 0 {
			continue
		}
		gap, resumed := r.tl.pause(k, from, to)
		if resumed < 0 {
			parts = append(parts, fmt.Sprintf("%s: none in %v", k, gap.Round(10*time.Millisecond)))
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %v (ended +%v)", k, gap.Round(10*time.Millisecond), resumed.Round(10*time.Millisecond)))
	}
	r.t.Logf("PAUSE %s (window %v): %s; redeliveries counted since: %d",
		label, to.Sub(from).Round(100*time.Millisecond), strings.Join(parts, ", "), r.tl.countSince(evRedeliv, from))
}

// finish stops the producer, waits for every message to settle, stops the
// consumer and does the accounting: nothing lost; every message rejected
// with Permanent poisoned (class permanent); no other message poisoned,
// except with class redelivery-limit (a node kill counts a redelivery
// against every message in the consumer's prefetch window), which is logged
// as a FINDING with its numbers.
func (r *clusterRun) finish() accounting {
	t := r.t
	t.Helper()
	r.p.stop()
	r.t.Logf("LEADERS (sampled) and node events: %s", r.lw.report())
	published, inDoubt := r.p.report()
	settled := r.e.settle(len(published), r.l.handled, 90*time.Second)
	r.e.stop()
	poisoned, ds := r.e.poisoned()
	handled := r.l.successes()
	for u := range inDoubt { // never confirmed: not published, whatever became of them
		if handled[u] > 0 || poisoned[u] > 0 {
			t.Logf("unconfirmed publish %s still arrived (handled %d, poisoned %d)", u, handled[u], poisoned[u])
		}
		delete(handled, u)
		delete(poisoned, u)
	}
	acc := account(t, published, handled, poisoned)
	if !settled {
		t.Errorf("messages did not settle within 90 s (Q %d, waiting %d)", r.e.depth(r.e.queue), r.waiting())
	}
	r.e.checkEmpty()

	classes := map[string]int{}
	unplanned := map[string][]string{}
	for _, d := range ds {
		u, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
		class, _ := d.Headers[middleware.ErrorClassKey].(string)
		classes[class]++
		if f, _ := r.fs.get(u); !f.poison {
			unplanned[class] = append(unplanned[class], u)
		}
	}
	plannedPoison, handledTwice, poisonedTwice, both := 0, 0, 0, 0
	var dups []string
	for _, u := range published {
		f, _ := r.fs.get(u)
		if f.poison {
			plannedPoison++
			if handled[u] > 0 {
				t.Errorf("%s was rejected with Permanent on every attempt, yet handled", u)
			}
		}
		switch {
		case handled[u] > 0 && poisoned[u] > 0:
			both++
		case handled[u] > 1:
			handledTwice++
		case poisoned[u] > 1:
			poisonedTwice++
		default:
			continue
		}
		if len(dups) < 5 {
			dups = append(dups, fmt.Sprintf("%s handled %d poisoned %d attempts %v", u, handled[u], poisoned[u], r.l.attemptsOf(u)))
		}
	}
	t.Logf("outcomes: %d rejected by plan, poison copies by class %v; duplicates: %d handled more than once, %d poisoned more than once, %d both handled and poisoned",
		plannedPoison, classes, handledTwice, poisonedTwice, both)
	if len(dups) > 0 {
		t.Logf("duplicates, e.g.: %s", strings.Join(dups, "; "))
	}
	for class, us := range unplanned {
		if class == middleware.ClassRedeliveryLimit {
			t.Logf("FINDING: %d message(s) poisoned with class %s (not rejected by the handler; a kill counts a redelivery against each message in the prefetch window), e.g. %v, attempts %v",
				len(us), class, us[:min(3, len(us))], r.l.attemptsOf(us[0]))
			continue
		}
		t.Errorf("%d message(s) poisoned with class %q although the handler never rejected them, e.g. %v (attempts %v)",
			len(us), class, us[:min(3, len(us))], r.l.attemptsOf(us[0]))
	}
	if ph := r.l.phantomDeliveries(); len(ph) > 0 {
		t.Errorf("%d phantom deliveries (messages nobody published) reached the handler: %v", len(ph), ph[:min(len(ph), 5)])
	}
	ru, highest := r.tl.redeliveredRuns()
	t.Logf("redeliveries: %d counted by the RedeliveryGuard; %d messages ran again carrying rabbitretry-redeliveries (highest %d); retries scheduled %d, poisonings %d",
		r.tl.count(evRedeliv), ru, highest, r.tl.count(evRetry), r.tl.count(evPoisoned))
	r.logErrors()
	return acc
}

// logErrors logs the error-level log messages of the library and the
// subscriber, counted by message.
func (r *clusterRun) logErrors() {
	r.t.Helper()
	counts := map[string]int{}
	for _, e := range r.e.logs.find("error", "") {
		counts[e.Msg]++
	}
	var lines []string
	for m, n := range counts {
		lines = append(lines, fmt.Sprintf("%dx %q", n, m))
	}
	sort.Strings(lines)
	if len(lines) == 0 {
		lines = []string{"none"}
	}
	r.t.Logf("error logs: %s", strings.Join(lines, "; "))
}

// killLeader is tests 1 to 3: kill -9 the node leading the queues of one
// role mid-storm, wait for a new leader and for the role's work to flow
// again with the node down, start the node again, let the storm run on,
// then account.
func killLeader(t *testing.T, role string, poisonPercent int) {
	r := newClusterRun(t, poisonPercent)
	var target, event string
	var queues []string
	switch role {
	case "Q":
		target, queues, event = r.qNode, []string{r.e.queue}, evSuccess
	case "wait":
		target, queues, event = r.waitNode, r.e.waitQueues(), evRetryRun
	case "poison":
		target, queues, event = r.poisonNode, []string{r.e.poisonQueue()}, evPoisoned
	}
	began := time.Now()
	r.p.run(0)
	r.waitStorm(300)
	r.logState("before the kill")

	killAt := time.Now()
	r.lw.mark("kill -9 " + target)
	took := r.c.kill(target)
	elected, leaders := r.c.waitLeaders(queues, target, 2, 60*time.Second)
	// list_queues reads the leader from the metadata store, which can lag
	// the election by seconds: the PAUSE lines below tell when messages
	// flowed again.
	t.Logf("kill -9 %s (leader of the %s queue(s)) took %v; list_queues shows new leaders %v %v after the kill",
		target, role, took.Round(time.Millisecond), leaders, elected.Round(10*time.Millisecond))
	base := r.l.handled()
	waitFor(t, 60*time.Second, "messages handled and "+event+" events again with "+target+" down", func() bool {
		return r.l.handled() >= base+200 && r.tl.countSince(event, killAt.Add(elected)) > 0
	})
	t.Logf("flowing again with %s down: %d handled since the kill, %d %q events since the election (%v after the kill)",
		target, r.l.handled()-base, r.tl.countSince(event, killAt.Add(elected)), event, time.Since(killAt).Round(10*time.Millisecond))
	r.logState(target + " down")

	startAt := time.Now()
	r.lw.mark("start " + target)
	startTook := r.c.start(target)
	r.lw.mark(target + " clustered")
	back, _ := r.c.waitLeaders(r.e.allQueues(), "", 3, 60*time.Second)
	base = r.l.handled()
	waitFor(t, 60*time.Second, "the storm to go on after the restart", func() bool { return r.l.handled() >= base+200 })
	stopAt := time.Now()
	t.Logf("%s started and clustered again in %v (all members online %v later); down for %v",
		target, startTook.Round(100*time.Millisecond), back.Round(100*time.Millisecond), startAt.Add(startTook).Sub(killAt).Round(100*time.Millisecond))
	r.logState("after the restart")
	r.logPauses("after kill -9 "+target, killAt, startAt)
	r.logPauses("after restarting "+target, startAt, stopAt)
	acc := r.finish()
	t.Logf("%s: %d published in %v", t.Name(), acc.Published, time.Since(began).Round(100*time.Millisecond))
}

// 1. kill -9 the node leading Q mid-storm (30% transient failures, retries
// in flight), then start it again.
func TestClusterKillQueueLeader(t *testing.T) { killLeader(t, "Q", 0) }

// 2. The same for the node leading the wait queues: retries waiting in
// them are dead-lettered back to Q by the new leader (at-least-once).
func TestClusterKillWaitQueueLeader(t *testing.T) { killLeader(t, "wait", 0) }

// 3. The same for the poison queue's leader while 20% of the messages are
// rejected with middleware.Permanent: a poison copy the broker does not
// confirm is copied back to Q after the fallback pause and poisoned on its
// next delivery; every rejected message ends in the poison queue once the
// new leader takes over.
func TestClusterKillPoisonQueueLeader(t *testing.T) { killLeader(t, "poison", 20) }

// 4. A rolling restart: each node in turn is stopped cleanly (rabbitmqctl
// stop) and started again, waiting until it is clustered and every queue
// member is online before the next one, while the storm runs.
func TestClusterRollingRestart(t *testing.T) {
	r := newClusterRun(t, 0)
	began := time.Now()
	r.p.run(0)
	r.waitStorm(300)
	type window struct {
		node          string
		from, restart time.Time
		until         time.Time
	}
	var windows []window
	for _, n := range r.c.nodes {
		r.logState("before restarting " + n)
		base := r.l.handled()
		at := time.Now()
		r.lw.mark("stop " + n)
		stopTook := r.c.stop(n)
		r.lw.mark(n + " stopped")
		elected, leaders := r.c.waitLeaders(r.e.allQueues(), n, 2, 60*time.Second)
		restartAt := time.Now()
		r.lw.mark("start " + n)
		startTook := r.c.start(n)
		r.lw.mark(n + " clustered")
		back, _ := r.c.waitLeaders(r.e.allQueues(), "", 3, 60*time.Second)
		waitFor(t, 60*time.Second, "the storm to go on after restarting "+n, func() bool { return r.l.handled() >= base+200 })
		windows = append(windows, window{n, at, restartAt, time.Now()})
		t.Logf("%s: stopped in %v, list_queues shows every queue led by a running node %v after the stop began (%v), started and clustered in %v, members online %v later; %d handled meanwhile",
			n, stopTook.Round(100*time.Millisecond), elected.Round(100*time.Millisecond), leaders,
			startTook.Round(100*time.Millisecond), back.Round(100*time.Millisecond), r.l.handled()-base)
	}
	r.logState("after the rolling restart")
	for _, w := range windows {
		r.logPauses("stopping "+w.node, w.from, w.restart)
		r.logPauses("starting "+w.node, w.restart, w.until)
	}
	acc := r.finish()
	t.Logf("%s: %d published in %v", t.Name(), acc.Published, time.Since(began).Round(100*time.Millisecond))
}

// 5. A node that stays down: a storm fully handled with the whole cluster,
// then the node leading the wait queues is killed and not started again
// until the test's cleanup; a second storm is fully handled by the two
// remaining nodes, retries included (the wait queues' new leader
// dead-letters them back to Q).
func TestClusterNodeStaysDown(t *testing.T) {
	r := newClusterRun(t, 0)
	began := time.Now()
	const perPhase = 600
	r.p.run(perPhase)
	<-r.p.done
	published, _ := r.p.report()
	if !r.e.settle(len(published), r.l.handled, 60*time.Second) {
		t.Fatalf("first storm (whole cluster) did not settle: handled %d of %d", r.l.handled(), len(published))
	}
	phase1 := r.l.handled()
	retries1 := r.tl.count(evRetry)
	r.logState("first storm done, whole cluster")

	target := r.waitNode
	killAt := time.Now()
	r.lw.mark("kill -9 " + target)
	took := r.c.kill(target)
	elected, leaders := r.c.waitLeaders(r.e.allQueues(), target, 2, 60*time.Second)
	t.Logf("kill -9 %s (leader of the wait queues) took %v; list_queues shows every queue led by a running node %v after the kill: %v",
		target, took.Round(time.Millisecond), elected.Round(10*time.Millisecond), leaders)

	r.p.run(perPhase)
	<-r.p.done
	published, _ = r.p.report()
	if !r.e.settle(len(published), r.l.handled, 90*time.Second) {
		t.Errorf("second storm (%s down) did not settle: handled %d of %d", target, r.l.handled(), len(published))
	}
	r.logState("second storm done, " + target + " still down")
	retries2 := r.tl.countSince(evRetry, killAt)
	t.Logf("with %s down: %d more handled (first storm %d), %d retries scheduled (first storm %d), %d retried runs since the kill",
		target, r.l.handled()-phase1, phase1, retries2, retries1, r.tl.countSince(evRetryRun, killAt))
	if retries2 == 0 || r.tl.countSince(evRetryRun, killAt) == 0 {
		t.Errorf("no retry went through the wait queues with %s down", target)
	}
	if run, err := r.c.running(); err != nil || len(run) != len(r.c.nodes)-1 {
		t.Errorf("expected %s to be down through the test: running %v (%v)", target, run, err)
	}
	acc := r.finish()
	t.Logf("%s: %d published in %v (the cleanup starts %s again)", t.Name(), acc.Published, time.Since(began).Round(100*time.Millisecond), target)
}
