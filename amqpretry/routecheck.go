package amqpretry

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/confirm"
	"github.com/rabbitretry/rabbitretry/internal/mgmt"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// Names of the broker-side retry routes (the route argument of
// middleware.RouteObserver.RouteChecked).
const (
	// routeDeadLetterFirst is the DeadLetterFirst mode's route: the nack
	// dead-letters the original into Q's first wait queue.
	routeDeadLetterFirst = "dead-letter-first"
	// routeNativeDelayedRetry is the NativeDelayed mode's route: the nack with
	// requeue puts the original into Q's delayed state.
	routeNativeDelayedRetry = "native-delayed-retry"
)

// routeCheckInterval is how long the result of a check of a broker-side
// retry route is reused: an operator's change is seen within this time.
const routeCheckInterval = 2 * time.Second

// routeCheckTimeout bounds one check (passive declare and management API
// calls); a check that does not finish in time counts as a broken route.
const routeCheckTimeout = 3 * time.Second

// routeChecker checks, before the Delayer hands a retry to a broker-side
// route (a nack with no copy and no confirm), that the route is still in
// place, since nothing tells the library when it breaks: a nack into a
// dead-letter target that is gone or refuses is dropped or stuck in the
// queue's dead-letter buffer, a nack with requeue and no delayed-retry
// keys comes back at once. What it checks, per originating queue Q:
//
//   - DeadLetterFirst: Q's first wait queue exists (passive declare,
//     AMQP); with a management API, no policy or operator policy gives it
//     a length limit (max-length, max-length-bytes): a full target with
//     reject-publish holds at-least-once dead-letters in Q's dead-letter
//     buffer, invisible, until it has room;
//   - an adopted Q (AdoptQueue), both modes: the policy that applies to Q
//     (the matching policy of highest priority, all of them if several
//     share it, from GET
//     /api/policies/{vhost}, which is current; the queue's own view lags by
//     the statistics interval) carries the keys of the library's policy
//     (Topology.QueuePolicy) with the same values. A declared Q needs no
//     such check: queue arguments win over a policy for these keys
//     ("Policies", "Dead Letter Exchanges").
//
// A result is reused for routeCheckInterval (2 s). While a route is broken every
// retry takes the publish path (a confirmed copy into the wait queue, with
// the fallback behind it); the change is logged once each way and reported
// to a middleware.RouteObserver.
type routeChecker struct {
	topo     *Topology
	route    string
	mgmt     *mgmtClient // nil: AMQP checks only
	vhost    string
	priority int
	open     func() (*amqp.Channel, error)
	logger   watermill.LoggerAdapter
	observer middleware.RouteObserver // nil: none
	interval time.Duration

	mu      sync.Mutex
	entries map[string]*routeEntry
}

type routeEntry struct {
	mu      sync.Mutex
	checked time.Time
	known   bool
	reason  string // "": in place
}

// usable reports whether the route of queue q may be relied on now.
func (r *routeChecker) usable(q string) bool {
	if r == nil {
		return true
	}
	r.mu.Lock()
	e := r.entries[q]
	if e == nil {
		e = &routeEntry{}
		r.entries[q] = e
	}
	r.mu.Unlock()
	e.mu.Lock() // one check at a time per queue; the others wait for it
	defer e.mu.Unlock()
	if e.known && time.Since(e.checked) < r.interval {
		return e.reason == ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), routeCheckTimeout)
	reason := r.check(ctx, q)
	cancel()
	switch {
	case reason != "" && (!e.known || e.reason == ""):
		r.logger.Error("Broker-side retry route not in place; retries take the publish path until it is", errors.New(reason),
			watermill.LogFields{"queue": q, "route": r.route})
	case reason == "" && e.known && e.reason != "":
		r.logger.Info("Broker-side retry route in place again", watermill.LogFields{"queue": q, "route": r.route})
	}
	e.known, e.checked, e.reason = true, time.Now(), reason
	if r.observer != nil {
		r.observer.RouteChecked(q, r.route, reason)
	}
	return reason == ""
}

// check returns "" when the route of q is in place, else why not.
func (r *routeChecker) check(ctx context.Context, q string) string {
	var wq string
	if r.topo.deadLetterFirst {
		wq = r.topo.naming.WaitQueue(q, r.topo.tiers[0])
		if reason := r.queueMissing(wq); reason != "" {
			return reason
		}
	}
	if r.mgmt == nil {
		return ""
	}
	policies, err := r.mgmt.policies(ctx, mgmt.Path("policies", r.vhost))
	if err != nil {
		return "reading policies: " + err.Error()
	}
	if r.topo.adopt != nil {
		want, needed := r.topo.QueuePolicy(q, r.priority)
		for _, got := range topPolicies(policies, q) {
			if !needed {
				break
			}
			var bad []string
			for k, v := range want.Definition {
				have, ok := got.Definition[k]
				switch {
				case !ok:
					bad = append(bad, fmt.Sprintf("%s unset (wanted %v)", k, v))
				case !sameValue(have, v):
					bad = append(bad, fmt.Sprintf("%s is %v (wanted %v)", k, have, v))
				}
			}
			if len(bad) > 0 {
				sort.Strings(bad)
				name := got.Name
				if name == "" {
					name = "none"
				}
				return fmt.Sprintf("the policy applying to queue %q is %s, not the library's %q: %s", q, name, want.Name, strings.Join(bad, "; "))
			}
		}
	}
	if wq != "" {
		ops, err := r.mgmt.policies(ctx, mgmt.Path("operator-policies", r.vhost))
		if err != nil {
			return "reading operator policies: " + err.Error()
		}
		for kind, list := range map[string][]namedPolicy{"policy": topPolicies(policies, wq), "operator policy": topPolicies(ops, wq)} {
			for _, p := range list {
				for _, k := range []string{"max-length", "max-length-bytes"} {
					if v, ok := p.Definition[k]; ok {
						return fmt.Sprintf("%s %q gives the first wait queue %q a length limit (%s %v): dead-letters it refuses would wait unseen in %q's dead-letter buffer", kind, p.Name, wq, k, v, q)
					}
				}
			}
		}
	}
	return ""
}

// queueMissing declares q passively on a channel of its own.
func (r *routeChecker) queueMissing(q string) string {
	ch, err := r.open()
	if err != nil {
		return "opening a channel to check it: " + err.Error()
	}
	defer ch.Close()
	if _, err := ch.QueueDeclarePassive(q, false, false, false, false, nil); err != nil {
		var aerr *amqp.Error
		if errors.As(err, &aerr) && aerr.Code == amqp.NotFound {
			return fmt.Sprintf("the first wait queue %q does not exist", q)
		}
		return fmt.Sprintf("checking the first wait queue %q: %v", q, err)
	}
	return ""
}

// namedPolicy is a policy as GET /api/policies/{vhost} returns it.
type namedPolicy struct {
	Name       string         `json:"name"`
	Pattern    string         `json:"pattern"`
	ApplyTo    string         `json:"apply-to"`
	Priority   int            `json:"priority"`
	Definition map[string]any `json:"definition"`
}

func (m *mgmtClient) policies(ctx context.Context, path string) ([]namedPolicy, error) {
	var ps []namedPolicy
	if err := m.Do(ctx, http.MethodGet, path, nil, &ps); err != nil {
		if mgmt.IsNotFound(err) {
			return nil, nil
		}
		return nil, err
	}
	return ps, nil
}

// topPolicies returns the policies RabbitMQ may apply to the quorum queue
// q: among those whose apply-to covers quorum queues and whose pattern
// matches q, those of the highest priority ("Policies", "Priorities"): one,
// unless several share it (RabbitMQ then applies one of them; the check
// requires all to be right). A pattern Go cannot compile counts as
// matching (the check then errs towards the publish path). No match: one
// zero namedPolicy (no keys).
func topPolicies(ps []namedPolicy, q string) []namedPolicy {
	var top []namedPolicy
	for _, p := range ps {
		switch p.ApplyTo {
		case "all", "queues", "quorum_queues":
		default:
			continue
		}
		if re, err := regexp.Compile(p.Pattern); err == nil && !re.MatchString(q) {
			continue
		}
		switch {
		case len(top) == 0 || p.Priority > top[0].Priority:
			top = []namedPolicy{p}
		case p.Priority == top[0].Priority:
			top = append(top, p)
		}
	}
	if len(top) == 0 {
		return []namedPolicy{{}}
	}
	return top
}

// newRouteChecker returns the checker of the broker-side route the
// mode relies on: DeadLetterFirst's always, NativeDelayed's
// on an adopted queue (a declared queue's x-delayed-retry-* arguments cannot
// be overridden by a policy); nil when there is none.
func newRouteChecker(cfg Config, topo *Topology, pub *confirm.Publisher) (*routeChecker, error) {
	route := routeDeadLetterFirst
	switch {
	case topo.deadLetterFirst:
	case topo.native != nil && cfg.AdoptQueue != nil:
		route = routeNativeDelayedRetry
	default:
		return nil, nil
	}
	r := &routeChecker{topo: topo, route: route, open: pub.Channel, logger: cfg.Logger, interval: routeCheckInterval,
		priority: 10, entries: map[string]*routeEntry{}}
	if ro, ok := cfg.Observer.(middleware.RouteObserver); ok {
		r.observer = ro
	}
	u, err := amqp.ParseURI(cfg.URI)
	if err != nil {
		return nil, fmt.Errorf("amqpretry: %w", err)
	}
	r.vhost = u.Vhost
	mc := AdoptQueue{ManagementURL: cfg.ManagementURL}
	if a := cfg.AdoptQueue; a != nil {
		if a.PolicyPriority != 0 {
			r.priority = a.PolicyPriority
		}
		mc.HTTPClient = a.HTTPClient
		if mc.ManagementURL == "" {
			mc.ManagementURL = a.ManagementURL
		}
	}
	if mc.ManagementURL != "" {
		if r.mgmt, err = newMgmtClient(&mc, "ManagementURL"); err != nil {
			return nil, err
		}
	}
	return r, nil
}
