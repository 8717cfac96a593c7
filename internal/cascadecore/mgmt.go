package cascadecore

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"regexp"
	"sort"
	"strings"

	"github.com/rabbitretry/rabbitretry/internal/mgmt"
)

// levelStat is what the management API reports about a level queue.
type levelStat struct {
	Name string `json:"name"`
	// Messages: ready and unacknowledged.
	Messages *int `json:"messages"`
	// MessagesDLX: quorum queues only (messages_dlx, RabbitMQ 3.10+).
	MessagesDLX *int           `json:"messages_dlx"`
	Effective   map[string]any `json:"effective_policy_definition"`
	Arguments   map[string]any `json:"arguments"`
}

// lengthLimitKeys are the queue settings that bound a queue's length
// ("Queue Length Limit"), as policy keys (arguments carry "x-" in front).
var lengthLimitKeys = []string{"max-length", "max-length-bytes"}

// lengthLimit names the length limits that apply to the level queue, from
// its effective policy (policy and operator policy) or its arguments.
func (s levelStat) lengthLimit() string {
	var parts []string
	for _, k := range lengthLimitKeys {
		if v, ok := s.Effective[k]; ok {
			parts = append(parts, fmt.Sprintf("%s=%v", k, v))
		} else if v, ok := s.Arguments["x-"+k]; ok {
			parts = append(parts, fmt.Sprintf("%s=%v", k, v))
		}
	}
	sort.Strings(parts)
	return strings.Join(parts, " ")
}

// maxLength is the level queue's max-length (from its effective policy or
// its arguments), if it has one.
func (s levelStat) maxLength() (int, bool) {
	v, ok := s.Effective["max-length"]
	if !ok {
		v, ok = s.Arguments["x-max-length"]
	}
	limit, isNum := v.(float64)
	return int(limit), ok && isNum
}

// atLimit reports a level queue at its max-length: full, it refuses
// publishes and dead-lettering.
func (s levelStat) atLimit() bool {
	limit, ok := s.maxLength()
	return ok && s.Messages != nil && *s.Messages >= limit
}

// managementClient is a Config's management API client, or nil when
// ManagementURL is empty. The URL's password is sent as basic auth and
// never shown in errors.
func (c *Config) managementClient() (*mgmt.Client, error) {
	if c.ManagementURL == "" {
		return nil, nil
	}
	return mgmt.New(c.ManagementURL, mgmt.Options{Field: "cascade.Config.ManagementURL", ErrPrefix: "cascade"})
}

// levelStats reads every level queue of the cascade from the management API
// with one request (GET /api/queues/{vhost}, filtered by a name regex),
// keyed by queue name. A level missing from the answer is missing on the
// broker (or not yet known to the management database).
func (c *Config) levelStats(ctx context.Context) (map[string]levelStat, error) {
	q := url.Values{}
	q.Set("page", "1")
	q.Set("page_size", "100")
	q.Set("use_regex", "true")
	q.Set("name", c.levelQueuePattern())
	q.Set("columns", "name,messages,messages_dlx,effective_policy_definition,arguments")
	var page struct {
		Items []levelStat `json:"items"`
	}
	if err := c.management(ctx, http.MethodGet, mgmt.Path("queues", c.vhost())+"?"+q.Encode(), nil, &page); err != nil {
		return nil, err
	}
	out := make(map[string]levelStat, len(page.Items))
	for _, s := range page.Items {
		out[s.Name] = s
	}
	return out, nil
}

// levelQueuePattern matches the level queues' names, and nothing else.
func (c *Config) levelQueuePattern() string {
	return "^" + regexp.QuoteMeta(c.Prefix) + `\.level\.[0-9][0-9]$`
}

// nudgePolicyPriority is the priority of the short-lived policy
// nudgeDeadLetterWorkers applies to the level queues: above any policy an
// operator is likely to have, so that it takes effect.
const nudgePolicyPriority = 1 << 20

// nudgeDeadLetterWorkers makes the at-least-once dead-letter worker of every
// quorum level queue retry its dead-letter buffer now instead of at its
// next resend (dead_letter_worker_publisher_confirm_timeout, 3 min): it
// applies a policy to the level queues and deletes it again (PUT then
// DELETE /api/policies/{vhost}/{Prefix}.dead-letter-retry). A policy
// change makes a quorum queue tell its worker to look its dead-letter
// exchange up again and resend every buffered message that found no route
// (rabbit_fifo_dlx:update_config, rabbit_fifo_dlx_worker lookup_topology).
// The policy's one key, dead-letter-strategy at-least-once, is what the
// levels' arguments already say (arguments win), so nothing else changes,
// except that for the moment it applies it replaces any other policy on
// the level queues (only the highest-priority policy applies).
func (c *Config) nudgeDeadLetterWorkers(ctx context.Context) error {
	path := mgmt.Path("policies", c.vhost(), c.Prefix+".dead-letter-retry")
	body := map[string]any{"pattern": c.levelQueuePattern(), "apply-to": "queues", "priority": nudgePolicyPriority,
		"definition": map[string]any{"dead-letter-strategy": "at-least-once"}}
	if err := c.management(ctx, http.MethodPut, path, body, nil); err != nil {
		return err
	}
	return c.management(ctx, http.MethodDelete, path, nil, nil)
}

// management sends one request to the management API (Config.ManagementURL,
// see internal/mgmt's Client.Do). path is already escaped.
func (c *Config) management(ctx context.Context, method, path string, body, out any) error {
	m, err := c.managementClient()
	if err != nil {
		return err
	}
	if m == nil {
		return errors.New("cascade: Config.ManagementURL is not set")
	}
	return m.Do(ctx, method, path, body, out)
}

func (c *Config) vhost() string {
	if c.Vhost == "" {
		return "/"
	}
	return c.Vhost
}
