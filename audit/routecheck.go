package audit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/mgmt"
)

// errRoutedOnlyToAudit is the error of a ResendToExchange result whose
// exchange would route the copy to no queue but the audit's own arrivals
// queue (the business binding is gone): nothing is published, the
// message is reported failed. A mandatory publish cannot tell: the
// audit's binding alone makes it "routed".
var errRoutedOnlyToAudit = errors.New("audit: resend: the exchange routes this message only to the audit's arrivals queue (no business queue is bound for it); not published")

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
	mgmt       *mgmt.Client
	vhost      string
	auditQueue string
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
	m, err := mgmt.New(mgmtURL, mgmt.Options{Field: "audit: ResenderConfig.ManagementURL"})
	if err != nil {
		return nil, err
	}
	return &routeChecker{mgmt: m, vhost: vhost, auditQueue: auditQueue, cache: map[string]exchangeRoutes{}}, nil
}

func (c *routeChecker) routes(ctx context.Context, exchange string) (exchangeRoutes, error) {
	if r, ok := c.cache[exchange]; ok {
		return r, nil
	}
	var info struct {
		Type string `json:"type"`
	}
	if err := c.mgmt.Do(ctx, http.MethodGet, mgmt.Path("exchanges", c.vhost, exchange), nil, &info); err != nil {
		return exchangeRoutes{}, err
	}
	var bs []mgmtBinding
	if err := c.mgmt.Do(ctx, http.MethodGet, mgmt.Path("exchanges", c.vhost, exchange, "bindings", "source"), nil, &bs); err != nil {
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
