package audit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// ErrRoutedOnlyToAudit is the error of a ResendToExchange result whose
// exchange would route the copy to no queue but the audit's own arrivals
// queue (the business binding is gone): nothing is published, the
// message is reported failed. A mandatory publish cannot tell: the
// audit's binding alone makes it "routed".
var ErrRoutedOnlyToAudit = errors.New("audit: resend: the exchange routes this message only to the audit's arrivals queue (no business queue is bound for it); not published")

// mgmtBinding is one item of GET /api/exchanges/{vhost}/{name}/bindings/source.
type mgmtBinding struct {
	Destination     string         `json:"destination"`
	DestinationType string         `json:"destination_type"`
	RoutingKey      string         `json:"routing_key"`
	Arguments       map[string]any `json:"arguments"`
}

type exchangeRoutes struct {
	typ      string
	bindings []mgmtBinding
}

// routeChecker tells, from the exchange's bindings as the management
// HTTP API lists them ("Management Plugin", HTTP API: /api/exchanges/
// {vhost}/{name} and .../bindings/source), whether a message would reach a
// queue other than the audit's arrivals queue. It evaluates the bindings
// as RabbitMQ's built-in exchange types route (direct: equal key; fanout:
// all; topic: "*" one word, "#" zero or more; headers: x-match all, any,
// all-with-x, any-with-x), follows exchange-to-exchange bindings, and
// counts a binding of any other exchange type (a plugin's) as routing.
type routeChecker struct {
	base       *url.URL // without user info
	user, pass string
	vhost      string
	auditQueue string
	client     *http.Client
	cache      map[string]exchangeRoutes
}

// managementURL derives the management API's URL from an AMQP URI: same
// host and credentials, http on 15672 (https on 15671 for amqps), the
// port the management plugin listens on by default.
func managementURL(amqpURI string) (string, error) {
	u, err := amqp.ParseURI(amqpURI)
	if err != nil {
		return "", err
	}
	m := url.URL{Scheme: "http", Host: fmt.Sprintf("%s:%d", u.Host, 15672), User: url.UserPassword(u.Username, u.Password)}
	if u.Scheme == "amqps" {
		m.Scheme, m.Host = "https", fmt.Sprintf("%s:%d", u.Host, 15671)
	}
	return m.String(), nil
}

func newRouteChecker(mgmtURL, vhost, auditQueue string) (*routeChecker, error) {
	u, err := url.Parse(mgmtURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, errors.New("audit: ResenderConfig.ManagementURL is not an http(s) URL")
	}
	c := &routeChecker{vhost: vhost, auditQueue: auditQueue, client: &http.Client{Timeout: 10 * time.Second}, cache: map[string]exchangeRoutes{}}
	if u.User != nil {
		c.user = u.User.Username()
		c.pass, _ = u.User.Password()
	}
	u.User = nil
	c.base = u
	return c, nil
}

func (c *routeChecker) get(ctx context.Context, path string, out any) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(c.base.String(), "/")+"/api/"+path, nil)
	if err != nil {
		return err
	}
	if c.user != "" {
		req.SetBasicAuth(c.user, c.pass)
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return fmt.Errorf("management API at %s: %w", c.base.Host, errors.Unwrap(err))
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusNotFound {
		return &mgmtNotFound{path: path}
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("management API at %s: GET /api/%s: %s", c.base.Host, path, resp.Status)
	}
	return json.NewDecoder(io.LimitReader(resp.Body, 64<<20)).Decode(out)
}

// mgmtNotFound: the management API answered 404 (no such exchange).
type mgmtNotFound struct{ path string }

func (e *mgmtNotFound) Error() string {
	return "management API: GET /api/" + e.path + ": 404 Not Found"
}

func (c *routeChecker) routes(ctx context.Context, exchange string) (exchangeRoutes, error) {
	if r, ok := c.cache[exchange]; ok {
		return r, nil
	}
	vh, ex := url.PathEscape(c.vhost), url.PathEscape(exchange)
	var info struct {
		Type string `json:"type"`
	}
	if err := c.get(ctx, "exchanges/"+vh+"/"+ex, &info); err != nil {
		return exchangeRoutes{}, err
	}
	var bs []mgmtBinding
	if err := c.get(ctx, "exchanges/"+vh+"/"+ex+"/bindings/source", &bs); err != nil {
		return exchangeRoutes{}, err
	}
	r := exchangeRoutes{typ: info.Type, bindings: bs}
	c.cache[exchange] = r
	return r, nil
}

// reachesOtherQueue reports whether a message published to exchange with
// key and headers would reach a queue other than the audit's arrivals
// queue (other), and whether it would reach that one (audit).
func (c *routeChecker) reachesOtherQueue(ctx context.Context, exchange, key string, headers amqp.Table) (other, audit bool, err error) {
	err = c.reaches(ctx, exchange, key, headers, map[string]bool{}, &other, &audit)
	return other, audit, err
}

func (c *routeChecker) reaches(ctx context.Context, exchange, key string, headers amqp.Table, seen map[string]bool, other, audit *bool) error {
	if seen[exchange] || len(seen) > 32 {
		return nil
	}
	seen[exchange] = true
	r, err := c.routes(ctx, exchange)
	if err != nil {
		return err
	}
	for _, b := range r.bindings {
		if !bindingMatches(r.typ, b, key, headers) {
			continue
		}
		switch {
		case b.DestinationType == "exchange":
			if err := c.reaches(ctx, b.Destination, key, headers, seen, other, audit); err != nil {
				return err
			}
		case b.Destination == c.auditQueue:
			*audit = true
		default:
			*other = true
		}
		if *other {
			return nil
		}
	}
	return nil
}

func bindingMatches(typ string, b mgmtBinding, key string, headers amqp.Table) bool {
	switch typ {
	case "fanout":
		return true
	case "direct":
		return b.RoutingKey == key
	case "topic":
		return topicMatch(strings.Split(b.RoutingKey, "."), strings.Split(key, "."))
	case "headers":
		return headersMatch(b.Arguments, headers)
	}
	return true // another type (a plugin's): cannot evaluate, count it
}

// topicMatch matches the words of a topic binding key against a routing
// key's ("*" one word, "#" zero or more).
func topicMatch(pat, words []string) bool {
	if len(pat) == 0 {
		return len(words) == 0
	}
	switch pat[0] {
	case "#":
		for i := 0; i <= len(words); i++ {
			if topicMatch(pat[1:], words[i:]) {
				return true
			}
		}
		return false
	case "*":
		return len(words) > 0 && topicMatch(pat[1:], words[1:])
	}
	return len(words) > 0 && words[0] == pat[0] && topicMatch(pat[1:], words[1:])
}

// headersMatch evaluates a headers-exchange binding's arguments.
func headersMatch(args map[string]any, headers amqp.Table) bool {
	mode, _ := args["x-match"].(string)
	if mode == "" {
		mode = "all"
	}
	withX := strings.HasSuffix(mode, "-with-x")
	all := strings.HasPrefix(mode, "all")
	matched, tested := 0, 0
	for k, want := range args {
		if k == "x-match" || (!withX && strings.HasPrefix(k, "x-")) {
			continue
		}
		tested++
		got, ok := headers[k]
		if ok && (want == nil || fmt.Sprint(want) == fmt.Sprint(got)) {
			matched++
		}
	}
	if all {
		return matched == tested
	}
	return matched > 0
}
