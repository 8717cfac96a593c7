package amqpretry

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"sort"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/mgmt"
	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// AdoptQueue makes the library adopt an originating queue Q that exists
// already (with a backlog, declared by someone else, or by an earlier
// version with other settings) instead of declaring it: Q's queue arguments
// are left alone, and what the retry mode needs from Q is set by a policy,
// which RabbitMQ lets an operator change on a live queue ("Policies", "Dead
// Letter Exchanges": policy keys dead-letter-exchange,
// dead-letter-routing-key, dead-letter-strategy, overflow, and on 4.3
// delayed-retry-type, -min, -max).
//
// What Q needs, by mode (Topology.QueuePolicy): a classic queue in the
// default mode needs nothing (its retries are published copies; no
// policy). A quorum queue gets its poison queue as dead-letter target
// (through the default exchange), the safety net for a message that
// reaches the delivery limit. The DeadLetterFirst mode needs its first wait
// queue as dead-letter target, NativeDelayed the delayed-retry keys:
// without them the mode cannot work, so New refuses these two with
// AdoptQueue unless ManagementURL is set.
//
// When BuildTopology runs (subscriber start and every reconnect) Q is
// declared passively; a missing Q is declared as usual, with only
// x-queue-type from the library. With ManagementURL the policy is applied
// and checked through the management HTTP API: Q's type must be
// Config.QueueType, Q must have no other policy (RabbitMQ applies one per
// queue: merge the keys into it instead), and no queue argument of Q may
// override a key of the policy (arguments win over a policy). Each problem
// is a *AdoptError naming the queue, what was found, what is wanted and
// the command that fixes it, and the subscriber fails to start. Without
// ManagementURL the library cannot see Q's type, policy or arguments: it
// logs the rabbitmqctl set_policy command once per queue (Error level) and
// goes on, and the operator applies it.
//
// After the start, the DeadLetterFirst and NativeDelayed modes check before
// each nack that relies on the policy (the result reused for 2 s per queue)
// that the policy applying to Q still carries the library's keys (GET
// /api/policies/{vhost}: an operator's policy of higher priority, or the
// library's deleted, is seen at once); if not, the retry takes the publish
// path, and the drift is logged and reported to a middleware.RouteObserver.
// The policy is not re-applied until the next start.
type AdoptQueue struct {
	// ManagementURL is the RabbitMQ management HTTP API's base URL with
	// credentials, e.g. "http://guest:guest@127.0.0.1:15672". Empty: the
	// policy is logged as a command, not applied.
	ManagementURL string
	// PolicyPriority is the priority of the library's policy. Default 10.
	PolicyPriority int
	// HTTPClient calls the management API. Default: a client with a 10 s
	// timeout.
	HTTPClient *http.Client
}

// PolicyNamePrefix starts the name of every policy the library applies:
// "rabbitretry.<Q>".
const PolicyNamePrefix = "rabbitretry."

// Policy is a RabbitMQ policy for one originating queue ("Policies").
type Policy struct {
	Name       string
	Pattern    string // ^<Q>$, regexp-quoted
	ApplyTo    string // "queues"
	Priority   int
	Definition map[string]any
}

// Command is the rabbitmqctl line that sets the policy on vhost.
func (p Policy) Command(vhost string) string {
	def, _ := json.Marshal(p.Definition) // map keys sorted: a stable line
	return fmt.Sprintf("rabbitmqctl set_policy -p %s --apply-to %s --priority %d %s %s %s",
		shellQuote(vhost), p.ApplyTo, p.Priority, shellQuote(p.Name), shellQuote(p.Pattern), shellQuote(string(def)))
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

// QueuePolicy returns the policy that gives Q what the configured mode
// needs from it when the queue is adopted (AdoptQueue); ok is false when it
// needs nothing (a classic queue in the default mode). The keys are those
// the declared queue arguments would set (see originArgs), as policy keys.
func (t *Topology) QueuePolicy(queue string, priority int) (p Policy, ok bool) {
	def := map[string]any{}
	for k, v := range t.retryArgs(queue) {
		def[strings.TrimPrefix(k, "x-")] = v
	}
	if len(def) == 0 {
		return Policy{}, false
	}
	return Policy{Name: PolicyNamePrefix + queue, Pattern: "^" + regexp.QuoteMeta(queue) + "$", ApplyTo: "queues",
		Priority: priority, Definition: def}, true
}

// AdoptError is returned when an adopted queue (AdoptQueue) does not match
// what the library needs and the library cannot fix it itself.
type AdoptError struct {
	Queue string
	// Problem says what was found and what is wanted.
	Problem string
	// Fix is the command or change that fixes it.
	Fix string
}

func (e *AdoptError) Error() string {
	return fmt.Sprintf("amqpretry: adopting queue %q: %s; fix: %s", e.Queue, e.Problem, e.Fix)
}

// mgmtQueue is the part of GET /api/queues/{vhost}/{name} the library reads.
type mgmtQueue struct {
	Type                      string         `json:"type"`
	Arguments                 map[string]any `json:"arguments"`
	Policy                    string         `json:"policy"`
	EffectivePolicyDefinition map[string]any `json:"effective_policy_definition"`
}

// mgmtClient adds the requests the library sends to the management API
// client of internal/mgmt.
type mgmtClient struct {
	*mgmt.Client
}

// newMgmtClient parses cfg.ManagementURL; field names it in the error.
func newMgmtClient(cfg *AdoptQueue, field string) (*mgmtClient, error) {
	c, err := mgmt.New(cfg.ManagementURL, mgmt.Options{Field: "amqpretry.Config." + field, HTTPClient: cfg.HTTPClient, ErrPrefix: "amqpretry"})
	if err != nil {
		return nil, err
	}
	return &mgmtClient{c}, nil
}

// queue reads GET /api/queues/{vhost}/{name}; nil, nil: no such queue.
func (m *mgmtClient) queue(ctx context.Context, vhost, q string) (*mgmtQueue, error) {
	var mq mgmtQueue
	if err := m.Do(ctx, http.MethodGet, mgmt.Path("queues", vhost, q), nil, &mq); err != nil {
		if mgmt.IsNotFound(err) {
			return nil, nil
		}
		return nil, err
	}
	return &mq, nil
}

func (m *mgmtClient) putPolicy(ctx context.Context, vhost string, p Policy) error {
	body := map[string]any{"pattern": p.Pattern, "apply-to": p.ApplyTo, "priority": p.Priority, "definition": p.Definition}
	err := m.Do(ctx, http.MethodPut, mgmt.Path("policies", vhost, p.Name), body, nil)
	if mgmt.IsNotFound(err) {
		err = fmt.Errorf("amqpretry: management API: vhost %q not found", vhost)
	}
	return err
}

// adopt applies and checks Q's policy through the management API (see
// AdoptQueue). It returns an *AdoptError for a mismatch the library cannot
// fix.
//
// Complexity (~22): each branch is one documented AdoptQueue case (policy
// missing, ours, overridden, conflicting arguments); kept in one place.
func (a *adopter) adopt(ctx context.Context, queue string) error {
	p, needed := a.topology.QueuePolicy(queue, a.cfg.PolicyPriority)
	if a.mgmt == nil {
		if needed {
			a.logOnce(queue, p)
		}
		return nil
	}
	mq, err := a.mgmt.queue(ctx, a.vhost, queue)
	if err != nil {
		return err
	}
	if mq == nil {
		return fmt.Errorf("amqpretry: adopting queue %q: the management API does not know it (vhost %q)", queue, a.vhost)
	}
	wantType := a.topology.queueType
	if mq.Type != "" && mq.Type != wantType {
		return &AdoptError{Queue: queue,
			Problem: fmt.Sprintf("it is a %s queue and Config.QueueType is %s", mq.Type, wantType),
			Fix:     fmt.Sprintf("set Config.QueueType to %q (a queue's type cannot change; moving to %s means a new queue and a shovel)", mq.Type, wantType)}
	}
	if !needed {
		return nil
	}
	if mq.Policy != "" && mq.Policy != p.Name {
		return &AdoptError{Queue: queue,
			Problem: fmt.Sprintf("policy %q applies to it, and RabbitMQ applies one policy per queue", mq.Policy),
			Fix:     fmt.Sprintf("add these keys to policy %q: %s (or give it a pattern that excludes %q and run again)", mq.Policy, jsonString(p.Definition), queue)}
	}
	var overridden []string
	for k, want := range p.Definition {
		if got, ok := mq.Arguments["x-"+k]; ok && !sameValue(got, want) {
			overridden = append(overridden, fmt.Sprintf("x-%s is %q, wanted %q", k, fmt.Sprint(got), fmt.Sprint(want)))
		}
	}
	if len(overridden) > 0 {
		sort.Strings(overridden)
		return &AdoptError{Queue: queue,
			Problem: "its queue arguments override the policy (" + strings.Join(overridden, "; ") + ")",
			Fix:     "queue arguments cannot change on a live queue: declare a new queue without them and move the messages (e.g. a shovel), then adopt that one"}
	}
	if err := a.mgmt.putPolicy(ctx, a.vhost, p); err != nil {
		return err
	}
	// The broker applies a policy to matching queues asynchronously.
	deadline := time.Now().Add(10 * time.Second)
	for {
		mq, err := a.mgmt.queue(ctx, a.vhost, queue)
		if err != nil {
			return err
		}
		if mq != nil && mq.Policy == p.Name {
			return nil
		}
		if time.Now().After(deadline) {
			return &AdoptError{Queue: queue, Problem: fmt.Sprintf("policy %q was set but does not apply to it after 10 s (effective policy %q)", p.Name, mq.Policy),
				Fix: "check for a policy of higher priority matching the queue: " + p.Command(a.vhost)}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond): // polling the management API
		}
	}
}

type adopter struct {
	cfg      AdoptQueue
	topology *Topology
	mgmt     *mgmtClient
	vhost    string
	logged   map[string]bool
}

func newAdopter(cfg *AdoptQueue, topo *Topology, uri string) (*adopter, error) {
	a := &adopter{cfg: *cfg, topology: topo, logged: map[string]bool{}}
	if a.cfg.PolicyPriority == 0 {
		a.cfg.PolicyPriority = 10
	}
	u, err := amqp.ParseURI(uri)
	if err != nil {
		return nil, fmt.Errorf("amqpretry: adopting queues: %w", redact.Error(err, uri))
	}
	a.vhost = u.Vhost
	if a.cfg.ManagementURL != "" {
		if a.mgmt, err = newMgmtClient(&a.cfg, "AdoptQueue.ManagementURL"); err != nil {
			return nil, err
		}
	}
	return a, nil
}

func (a *adopter) logOnce(queue string, p Policy) {
	a.topology.mu.Lock()
	seen := a.logged[queue]
	a.logged[queue] = true
	a.topology.mu.Unlock()
	if seen {
		return
	}
	a.topology.logger.Error("Adopted queue needs a policy the library cannot apply without AdoptQueue.ManagementURL; run this command",
		errors.New("policy not applied"), watermill.LogFields{"queue": queue, "command": p.Command(a.vhost)})
}

func jsonString(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

// sameValue compares a queue argument from the management API (JSON: a
// number is float64) with a policy value.
func sameValue(got, want any) bool {
	return fmt.Sprint(got) == fmt.Sprint(want)
}
