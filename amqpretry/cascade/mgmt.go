package cascade

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"sort"
	"strings"
	"time"
)

// levelStat is what the management API reports about a level queue.
type levelStat struct {
	Name string `json:"name"`
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

// managementClient is a Config's management API client, or nil when
// ManagementURL is empty. The URL's password is sent as basic auth and
// never shown in errors.
func (c *Config) managementClient() (*url.URL, error) {
	if c.ManagementURL == "" {
		return nil, nil
	}
	u, err := url.Parse(strings.TrimSuffix(c.ManagementURL, "/"))
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		shown := "(unparseable)"
		if err == nil {
			shown = u.Redacted()
		}
		return nil, fmt.Errorf("cascade.Config.ManagementURL %s is not an http(s) URL", shown)
	}
	return u, nil
}

// levelStats reads every level queue of the cascade from the management API
// with one request (GET /api/queues/{vhost}, filtered by a name regex),
// keyed by queue name. A level missing from the answer is missing on the
// broker (or not yet known to the management database).
func (c *Config) levelStats(ctx context.Context) (map[string]levelStat, error) {
	base, err := c.managementClient()
	if err != nil || base == nil {
		return nil, err
	}
	pattern := "^" + regexp.QuoteMeta(c.Prefix) + `\.level\.[0-9][0-9]$`
	q := url.Values{}
	q.Set("page", "1")
	q.Set("page_size", "100")
	q.Set("use_regex", "true")
	q.Set("name", pattern)
	q.Set("columns", "name,messages_dlx,effective_policy_definition,arguments")
	target := *base
	target.User = nil
	raw := target.String() + "/api/queues/" + url.PathEscape(c.vhost()) + "?" + q.Encode()
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, raw, nil)
	if err != nil {
		return nil, fmt.Errorf("cascade: management API request: %w", err)
	}
	if base.User != nil {
		pw, _ := base.User.Password()
		req.SetBasicAuth(base.User.Username(), pw)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("cascade: management API GET %s/api/queues: %w", target.Redacted(), unwrapURLError(err))
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("cascade: management API GET %s/api/queues/%s: %s: %s", target.Redacted(), url.PathEscape(c.vhost()), resp.Status, strings.TrimSpace(string(b)))
	}
	var page struct {
		Items []levelStat `json:"items"`
	}
	if err := json.Unmarshal(b, &page); err != nil {
		return nil, fmt.Errorf("cascade: management API GET %s/api/queues: %w", target.Redacted(), err)
	}
	out := make(map[string]levelStat, len(page.Items))
	for _, s := range page.Items {
		out[s.Name] = s
	}
	return out, nil
}

// unwrapURLError drops *url.Error's URL (it could carry credentials).
func unwrapURLError(err error) error {
	if ue, ok := err.(*url.Error); ok {
		return ue.Err
	}
	return err
}

func (c *Config) vhost() string {
	if c.Vhost == "" {
		return "/"
	}
	return c.Vhost
}
