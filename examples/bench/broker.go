package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// nativeNA is the value of every native delayed retry row on a broker that
// does not have the feature.
const nativeNA = "n/a (needs RabbitMQ 4.3+)"

// nativeSupported reports whether the bench's broker has quorum-queue
// delayed retry (RabbitMQ 4.3+), from the server's "version" connection
// property: amqpretry.New refuses the NativeDelayed mode below 4.3, and
// the native rows then say nativeNA instead of failing the run.
func (e *env) nativeSupported() bool {
	v, _ := e.admin.Properties["version"].(string)
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return false
	}
	lead := func(s string) int {
		i := 0
		for i < len(s) && s[i] >= '0' && s[i] <= '9' {
			i++
		}
		n, _ := strconv.Atoi(s[:i])
		return n
	}
	major, minor := lead(parts[0]), lead(parts[1])
	return major > 4 || (major == 4 && minor >= 3)
}

// ctlPrefix is the command that controls the bench's broker, to which
// rabbitmqctl arguments are appended: $RABBITRETRY_CTL split on spaces (e.g.
// "/work/main/scripts/brokers.sh ctl dev2 --", which `scripts/brokers.sh env
// dev2` sets), else plain "rabbitmqctl", which reaches the machine's own
// broker only. A prefix that reaches another broker than -uri is caught
// where it matters: broker figures are only reported for a queue of this
// run that the command lists.
func ctlPrefix() []string {
	if f := strings.Fields(os.Getenv("RABBITRETRY_CTL")); len(f) > 0 {
		return f
	}
	return []string{"rabbitmqctl"}
}

// ctl runs the control command with args.
func ctl(args ...string) (string, error) {
	p := ctlPrefix()
	return command(p[0], append(p[1:], args...)...)
}

// brokerQueue is one line of `rabbitmqctl list_queues name memory messages`.
type brokerQueue struct {
	MemoryBytes int64
	Messages    int64
}

// brokerQueueStats asks the control command for queue q's memory (for a
// quorum queue: its Ra leader process) and message count; ok is false when
// the command is unavailable or does not list q (another broker).
func brokerQueueStats(q string) (st brokerQueue, ok bool) {
	out, err := ctl("-q", "list_queues", "name", "memory", "messages", "--no-table-headers")
	if err != nil {
		return st, false
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 3 && f[0] == q {
			st.MemoryBytes, _ = strconv.ParseInt(f[1], 10, 64)
			st.Messages, _ = strconv.ParseInt(f[2], 10, 64)
			return st, true
		}
	}
	return st, false
}

// nodeMemory is the node's total memory from `rabbitmqctl status --formatter
// json` (memory.total): rss (the OS's view, the figure RabbitMQ checks its
// memory alarm against with the default strategy) and erlang (what the
// Erlang VM allocated), plus the quorum-queue parts of the breakdown.
type nodeMemory struct {
	RSS         int64 `json:"rss_bytes"`
	Erlang      int64 `json:"erlang_bytes"`
	QuorumProcs int64 `json:"quorum_queue_procs_bytes"`
	QuorumETS   int64 `json:"quorum_ets_bytes"`
	QueueProcs  int64 `json:"queue_procs_bytes"`
	Binary      int64 `json:"binary_bytes"`
}

// readNodeMemory reads the node's memory with the control command; ok is
// false when it is unavailable.
func readNodeMemory() (m nodeMemory, ok bool) {
	out, err := ctl("-q", "status", "--formatter", "json")
	if err != nil {
		return m, false
	}
	var st struct {
		Memory map[string]json.RawMessage `json:"memory"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil || st.Memory == nil {
		return m, false
	}
	var total struct {
		RSS    int64 `json:"rss"`
		Erlang int64 `json:"erlang"`
	}
	if err := json.Unmarshal(st.Memory["total"], &total); err != nil {
		return m, false
	}
	part := func(k string) int64 {
		var v int64
		_ = json.Unmarshal(st.Memory[k], &v)
		return v
	}
	m = nodeMemory{RSS: total.RSS, Erlang: total.Erlang, QuorumProcs: part("quorum_queue_procs"),
		QuorumETS: part("quorum_ets"), QueueProcs: part("queue_procs"), Binary: part("binary")}
	return m, m.RSS > 0 || m.Erlang > 0
}

// mgmtBase is the management HTTP API of the bench's broker:
// $RABBITRETRY_MGMT_URL when set (e.g. http://guest:guest@127.0.0.1:15694),
// else the AMQP URI's host and credentials on port AMQP port + 10000 (the
// convention of every broker on this machine: 5672 -> 15672, 5694 -> 15694).
func mgmtBase(uri string) (base *url.URL, vhost string, err error) {
	u, err := amqp.ParseURI(uri)
	if err != nil {
		return nil, "", err
	}
	if s := os.Getenv("RABBITRETRY_MGMT_URL"); s != "" {
		base, err = url.Parse(s)
		return base, u.Vhost, err
	}
	return &url.URL{Scheme: "http", User: url.UserPassword(u.Username, u.Password),
		Host: net.JoinHostPort(u.Host, strconv.Itoa(u.Port+10000))}, u.Vhost, nil
}

// mgmtQueue GETs /api/queues/<vhost>/<q> from the management API: the
// queue's "memory", "messages", "messages_ready" and whatever else the
// broker reports for its type.
func mgmtQueue(uri, q string) (map[string]any, error) {
	base, vhost, err := mgmtBase(uri)
	if err != nil {
		return nil, err
	}
	// The vhost "/" must reach the API as %2F: url.Parse keeps the escaped
	// form (RawPath) of a path that differs from its decoding.
	addr := *base
	addr.User = nil
	target := strings.TrimSuffix(addr.String(), "/") + "/api/queues/" + url.PathEscape(vhost) + "/" + url.PathEscape(q)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
	if err != nil {
		return nil, err
	}
	if pw, ok := base.User.Password(); ok {
		req.SetBasicAuth(base.User.Username(), pw)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer func() { _ = resp.Body.Close() }()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("management API %s: %s", target, resp.Status)
	}
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		return nil, err
	}
	return m, nil
}

// mib converts bytes to MiB.
func mib(b int64) float64 { return float64(b) / (1 << 20) }
