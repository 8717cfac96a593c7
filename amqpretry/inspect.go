package amqpretry

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/mgmt"

	"github.com/rabbitretry/rabbitretry/internal/redact"
	"github.com/rabbitretry/rabbitretry/internal/retrymeta"
)

// Roles of a queue in a TopologyReport (QueueState.Role).
const (
	// roleOrigin is the originating queue Q.
	roleOrigin = "origin"
	// roleWait is one of Q's wait queues for a configured tier.
	roleWait = "wait"
	// rolePoison is Q's poison queue.
	rolePoison = "poison"
	// roleOrphanWait is a wait queue of Q for a tier that is no longer
	// configured (an earlier deploy's tier): its messages still come back
	// to Q when its TTL expires, but nothing publishes into it any more.
	roleOrphanWait = "orphan-wait"
	// roleQuarantine is Q's quarantine queue (Naming.QuarantineQueue).
	roleQuarantine = "quarantine"
)

// QueueState is one queue of an originating queue's retry topology as the
// RabbitMQ management HTTP API ("Management Plugin") reports it.
type QueueState struct {
	// Name is the queue name.
	Name string
	// Role is "origin" (Q itself), "wait" (a wait queue of a configured
	// tier), "poison", "quarantine" or "orphan-wait" (a wait queue of a tier
	// no longer configured: its messages still come back to Q when their
	// TTL expires, but nothing publishes into it any more).
	Role string
	// Tier is a wait queue's delay: its x-message-ttl argument (ms) when
	// it exists, else the configured tier; 0 for the other roles.
	Tier time.Duration
	// Exists is false for an expected queue the broker does not have.
	Exists bool
	// Messages is the management API's "messages" of the queue: ready plus
	// unacknowledged (plus, on RabbitMQ 4.3 quorum queues, delayed). The
	// management API refreshes it every few seconds (collect_statistics_
	// interval, default 5 s), so it lags; 0 while the broker has not reported
	// it yet, or for a missing queue.
	Messages int
	// Expected is true for the queues the Topology declares (Q, its poison
	// queue, its quarantine queue and its configured wait queues), false
	// for orphans.
	Expected bool
	// Arguments are the queue's x-arguments (JSON numbers are float64).
	Arguments map[string]any
	// Policy is the name of the policy applied to the queue, or "".
	Policy string
	// Type is the queue type, "classic", "quorum" or "stream" ("" if
	// missing).
	Type string
}

// TopologyReport is what Topology.Inspect found for one originating queue.
type TopologyReport struct {
	// Queue is the originating queue Q.
	Queue string
	// Vhost is the virtual host inspected.
	Vhost string
	// Queues are Q, its wait queues in tier order, its poison queue, its
	// quarantine queue, then its orphan wait queues by tier: every queue of
	// the report, present or not.
	Queues []QueueState
	// Missing names the expected queues the broker does not have (the
	// subscriber declares them when it starts).
	Missing []string
	// Orphans are the orphan wait queues (also in Queues), by tier.
	Orphans []QueueState
}

// String renders the report as a table: queue, role, tier, messages and
// state ("ok", "missing" or "orphan").
func (r *TopologyReport) String() string {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "QUEUE\tROLE\tTIER\tMESSAGES\tSTATE")
	for _, q := range r.Queues {
		tier, msgs, state := "-", "-", "ok"
		if q.Tier > 0 {
			tier = retrymeta.FormatDelay(q.Tier)
		}
		if q.Exists {
			msgs = fmt.Sprint(q.Messages)
		}
		switch {
		case !q.Exists:
			state = "missing"
		case !q.Expected:
			state = "orphan"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", q.Name, q.Role, tier, msgs, state)
	}
	_ = tw.Flush()
	return b.String()
}

// mgmtListedQueue is one item of GET /api/queues/{vhost}?columns=...
type mgmtListedQueue struct {
	Name      string         `json:"name"`
	Messages  *int           `json:"messages"`
	Arguments map[string]any `json:"arguments"`
	Policy    *string        `json:"policy"`
	Type      string         `json:"type"`
}

type mgmtQueuePage struct {
	Items     []mgmtListedQueue `json:"items"`
	Page      int               `json:"page"`
	PageCount int               `json:"page_count"`
}

// inspectPageSize is the management API page size used to list a vhost's
// queues (the API's maximum is 500).
const inspectPageSize = 500

// newInspectClient is newMgmtClient for Inspect (30 s per request): its
// error never shows the URL's password.
func newInspectClient(managementURL string) (*mgmtClient, error) {
	c, err := mgmt.New(managementURL, mgmt.Options{Field: "amqpretry: management URL", Timeout: 30 * time.Second, ErrPrefix: "amqpretry"})
	if err != nil {
		return nil, err
	}
	return &mgmtClient{c}, nil
}

// listQueues pages through GET /api/queues/{vhost}.
func (m *mgmtClient) listQueues(ctx context.Context, vhost string) ([]mgmtListedQueue, error) {
	var all []mgmtListedQueue
	for page := 1; ; page++ {
		var p mgmtQueuePage
		path := fmt.Sprintf("%s?columns=name,messages,arguments,policy,type&page=%d&page_size=%d",
			mgmt.Path("queues", vhost), page, inspectPageSize)
		if err := m.Do(ctx, http.MethodGet, path, nil, &p); err != nil {
			if mgmt.IsNotFound(err) {
				return nil, fmt.Errorf("amqpretry: management API: vhost %q not found", vhost)
			}
			return nil, err
		}
		all = append(all, p.Items...)
		if page >= p.PageCount || len(p.Items) == 0 {
			return all, nil
		}
	}
}

// argMillis reads a numeric queue argument (ms) from the management API.
func argMillis(args map[string]any, key string) (time.Duration, bool) {
	switch v := args[key].(type) {
	case float64:
		return time.Duration(v) * time.Millisecond, true
	case int64:
		return time.Duration(v) * time.Millisecond, true
	case int:
		return time.Duration(v) * time.Millisecond, true
	}
	return 0, false
}

// Inspect reports the retry topology of originating queue queue on vhost
// as the broker has it, read through the RabbitMQ management HTTP API
// ("Management Plugin"; managementURL is its base URL with credentials,
// e.g. "http://guest:guest@127.0.0.1:15672"): it lists every queue of the
// vhost (GET /api/queues/{vhost}, paged) and keeps Q, its poison queue,
// its quarantine queue, its wait queues for the configured tiers (WaitQueues) and its orphan
// wait queues.
//
// An orphan wait queue is a queue that is none of those and either
//   - has x-message-ttl and x-dead-letter-routing-key = Q: a wait queue
//     whose messages come back to Q when their queue TTL expires ("Dead
//     Letter Exchanges", "Time-To-Live and Expiration"), whatever its name;
//   - or is named "<Q>.wait.<d>" for a d that time.ParseDuration accepts:
//     a wait queue of the default Naming.WaitQueue for a tier no longer
//     configured (e.g. after the Mode's tiers or MaxAttempts changed between
//     deploys).
//
// With a custom Naming.WaitQueue only the first rule finds orphans, which
// covers every wait queue this library declares. Orphans keep working (a
// message in one still comes back to Q within its TTL) but nothing
// publishes into them any more; TidyOrphans deletes the empty ones.
//
// Message counts come from the management API, which refreshes them every
// few seconds. Inspect changes nothing. It returns an error when the
// management API fails or does not know vhost.
// Complexity (~22): one pass that classifies every queue of the vhost by
// the naming rules above; splitting it would scatter the rules.
func (t *Topology) Inspect(ctx context.Context, managementURL, vhost, queue string) (*TopologyReport, error) {
	if queue == "" {
		return nil, errors.New("amqpretry: Inspect: empty queue name")
	}
	m, err := newInspectClient(managementURL)
	if err != nil {
		return nil, err
	}
	listed, err := m.listQueues(ctx, vhost)
	if err != nil {
		return nil, err
	}
	byName := make(map[string]mgmtListedQueue, len(listed))
	for _, q := range listed {
		byName[q.Name] = q
	}

	rep := &TopologyReport{Queue: queue, Vhost: vhost}
	state := func(name, role string, tier time.Duration, expected bool) QueueState {
		s := QueueState{Name: name, Role: role, Tier: tier, Expected: expected}
		if lq, ok := byName[name]; ok {
			s.Exists = true
			if lq.Messages != nil {
				s.Messages = *lq.Messages
			}
			s.Arguments = lq.Arguments
			if lq.Policy != nil {
				s.Policy = *lq.Policy
			}
			s.Type = lq.Type
			if role == roleWait || role == roleOrphanWait {
				if ttl, ok := argMillis(lq.Arguments, "x-message-ttl"); ok {
					s.Tier = ttl
				}
			}
		}
		if expected && !s.Exists {
			rep.Missing = append(rep.Missing, name)
		}
		return s
	}

	known := map[string]bool{queue: true, t.naming.PoisonQueue(queue): true, t.naming.QuarantineQueue(queue): true}
	rep.Queues = append(rep.Queues, state(queue, roleOrigin, 0, true))
	for i, wq := range t.WaitQueues(queue) {
		known[wq] = true
		rep.Queues = append(rep.Queues, state(wq, roleWait, t.tiers[i], true))
	}
	rep.Queues = append(rep.Queues, state(t.naming.PoisonQueue(queue), rolePoison, 0, true))
	rep.Queues = append(rep.Queues, state(t.naming.QuarantineQueue(queue), roleQuarantine, 0, true))

	prefix := queue + ".wait."
	for _, lq := range listed {
		if known[lq.Name] {
			continue
		}
		ttl, hasTTL := argMillis(lq.Arguments, "x-message-ttl")
		dlrk, _ := lq.Arguments["x-dead-letter-routing-key"].(string)
		var tier time.Duration
		switch {
		case hasTTL && dlrk == queue:
			tier = ttl
		case strings.HasPrefix(lq.Name, prefix):
			d, err := time.ParseDuration(strings.TrimPrefix(lq.Name, prefix))
			if err != nil || d <= 0 {
				continue
			}
			tier = d
		default:
			continue
		}
		rep.Orphans = append(rep.Orphans, state(lq.Name, roleOrphanWait, tier, false))
	}
	slices.SortFunc(rep.Orphans, func(a, b QueueState) int {
		if c := cmp.Compare(a.Tier, b.Tier); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	rep.Queues = append(rep.Queues, rep.Orphans...)
	return rep, nil
}

// OrphanKept is an orphan wait queue TidyOrphans did not delete, and why.
type OrphanKept struct {
	QueueState
	// Reason says why it was kept: "not empty" (its messages come back to
	// the originating queue within its TTL; run TidyOrphans again after
	// that), or the broker's error.
	Reason string
}

// TidyOrphans deletes the orphan wait queues of queue (see Inspect) that
// are empty, on channels from open (e.g. (*amqp.Connection).Channel, or
// Retry.Publisher().Channel): a refused delete closes its channel, so each
// delete opens its own. Expected queues are never touched.
//
// A classic orphan is deleted by a queue.delete with if-empty set, so the
// broker itself refuses to delete one holding a message
// (PRECONDITION_FAILED, 406), even one that arrived after Inspect: no
// waiting retry is lost. Quorum queues do not support if-empty (the broker
// answers NOT_IMPLEMENTED, which closes the connection), so a quorum
// orphan is first unbound from the wait exchange (Naming.WaitExchange: a
// retry published for its tier by a process still running the old tiers
// is then returned unroutable, and that process redeclares its topology),
// then counted (a passive queue.declare: no wait queue has consumers, so
// its count is every message in it), and deleted only if the count is 0.
// A message published into a quorum orphan between that count and the
// delete (a process with the old tiers that redeclared it in that instant)
// would be lost: tidy once every process runs the new tiers.
//
// An orphan holding messages is returned in kept with Reason "not empty";
// its messages come back to Q when its TTL (Tier) expires, and a later run
// deletes it. The management API's (lagging) message counts are not used
// to decide: the broker decides.
//
// It returns the names deleted, the orphans kept, and an error when
// Inspect fails, a channel cannot be opened, or the broker refuses an
// operation for another reason (the remaining orphans are then not
// tried).
func (t *Topology) TidyOrphans(ctx context.Context, managementURL, vhost, queue string, open func() (*amqp.Channel, error)) (deleted []string, kept []OrphanKept, err error) {
	rep, err := t.Inspect(ctx, managementURL, vhost, queue)
	if err != nil {
		return nil, nil, err
	}
	for _, o := range rep.Orphans {
		if err := ctx.Err(); err != nil {
			return deleted, kept, err
		}
		ok, n, err := t.deleteIfEmpty(o, open)
		switch {
		case err != nil:
			return deleted, kept, fmt.Errorf("amqpretry: tidying orphan wait queue %q of %q: %w", o.Name, queue, err)
		case ok:
			deleted = append(deleted, o.Name)
		case n >= 0:
			if n > 0 {
				o.Messages = n
			}
			kept = append(kept, OrphanKept{QueueState: o, Reason: "not empty"})
		}
		// n < 0: gone meanwhile.
	}
	return deleted, kept, nil
}

// deleteIfEmpty deletes orphan o if it is empty: ok true. Otherwise n is
// its message count as far as known (0 when the broker only said "not
// empty"), or -1 when the queue no longer exists.
func (t *Topology) deleteIfEmpty(o QueueState, open func() (*amqp.Channel, error)) (ok bool, n int, err error) {
	ch, err := open()
	if err != nil {
		return false, 0, fmt.Errorf("opening a channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	var aerr *amqp.Error
	if o.Type != QueueTypeQuorum {
		_, err := ch.QueueDelete(o.Name, false, true, false)
		switch {
		case err == nil:
			return true, 0, nil
		case errors.As(err, &aerr) && aerr.Code == amqp.PreconditionFailed:
			return false, 0, nil
		}
		return false, 0, err
	}
	if err := ch.QueueUnbind(o.Name, o.Name, t.naming.WaitExchange, nil); err != nil {
		if !errors.As(err, &aerr) || aerr.Code != amqp.NotFound {
			return false, 0, fmt.Errorf("unbinding it from %q: %w", t.naming.WaitExchange, err)
		}
		// No wait exchange (or queue): nothing to unbind. The channel is closed.
		_ = ch.Close()
		if ch, err = open(); err != nil {
			return false, 0, fmt.Errorf("opening a channel: %w", err)
		}
	}
	st, err := ch.QueueDeclarePassive(o.Name, false, false, false, false, nil)
	if err != nil {
		if errors.As(err, &aerr) && aerr.Code == amqp.NotFound {
			return false, -1, nil
		}
		return false, 0, err
	}
	if st.Messages > 0 {
		return false, st.Messages, nil
	}
	if _, err := ch.QueueDelete(o.Name, false, false, false); err != nil {
		return false, 0, err
	}
	return true, 0, nil
}

// vhost is the virtual host of the subscriber's AMQP URI (amqp.Config.Vhost
// when the subscriber sets one).
func (r *Retry) vhost() (string, error) {
	c := r.subscriber.Connection
	if c.AmqpConfig != nil && c.AmqpConfig.Vhost != "" {
		return c.AmqpConfig.Vhost, nil
	}
	u, err := amqp.ParseURI(c.AmqpURI)
	if err != nil {
		return "", fmt.Errorf("amqpretry: the subscriber's AMQP URI: %w", redact.Error(err, c.AmqpURI))
	}
	return u.Vhost, nil
}

// inspect is Topology().Inspect on the vhost of the subscriber's AMQP URI
// (Config.Subscriber.Connection).
func (r *Retry) inspect(ctx context.Context, managementURL, queue string) (*TopologyReport, error) {
	vhost, err := r.vhost()
	if err != nil {
		return nil, err
	}
	return r.topology.Inspect(ctx, managementURL, vhost, queue)
}

// DeleteQueuesAndOrphans is DeleteQueues plus Q's orphan wait queues
// (found by Topology.Inspect through the management API at managementURL, on the
// vhost of the subscriber's AMQP URI): it deletes Q, its poison queue, its
// wait queues and its orphan wait queues with every message in them
// (queue.delete, unconditional; a missing queue is not an error). The
// shared exchanges stay. Meant for demos, tests and decommissioning; it
// returns the first management API or broker error.
func (r *Retry) DeleteQueuesAndOrphans(ctx context.Context, managementURL, queue string) error {
	rep, err := r.inspect(ctx, managementURL, queue)
	if err != nil {
		return err
	}
	if err := r.DeleteQueues(queue); err != nil {
		return err
	}
	if len(rep.Orphans) == 0 {
		return nil
	}
	ch, err := r.publisher.Channel()
	if err != nil {
		return err
	}
	defer ch.Close()
	for _, o := range rep.Orphans {
		if _, err := ch.QueueDelete(o.Name, false, false, false); err != nil {
			return fmt.Errorf("amqpretry: deleting queue %q: %w", o.Name, err)
		}
	}
	return nil
}
