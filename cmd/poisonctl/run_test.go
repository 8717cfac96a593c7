package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/testkit"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/poison/admin"
)

func uniqueName(t *testing.T) string {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		t.Fatal(err)
	}
	return "poisonctltest." + strings.ReplaceAll(t.Name(), "/", "_") + "." + hex.EncodeToString(b[:])
}

// fixture: Q bound to rabbitretry.loopback with key Q, and Q.poison holding
// n poisoned messages (classes alternate permanent / malformed).
type fixture struct {
	uri, Q, Poison string
	conn           *amqp.Connection
	uuids          []string
}

func newFixture(t *testing.T, n int) *fixture {
	t.Helper()
	uri := brokerURI(t)
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	fx := &fixture{uri: uri, conn: conn, Q: uniqueName(t)}
	fx.Poison = fx.Q + ".poison"
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			_, _ = ch.QueueDelete(fx.Q, false, false, false)
			_, _ = ch.QueueDelete(fx.Poison, false, false, false)
			_ = ch.Close()
		}
		_ = conn.Close()
	})
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	check := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	check(ch.ExchangeDeclare("rabbitretry.loopback", amqp.ExchangeDirect, true, false, false, false, nil))
	for _, q := range []string{fx.Q, fx.Poison} {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		check(err)
	}
	check(ch.QueueBind(fx.Q, fx.Q, "rabbitretry.loopback", false, nil))
	check(ch.Confirm(false))
	base := time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC)
	var confs []*amqp.DeferredConfirmation
	for i := range n {
		class := []string{"permanent", "malformed"}[i%2]
		uuid := fmt.Sprintf("u%03d-%s", i, fx.Q[len(fx.Q)-12:])
		fx.uuids = append(fx.uuids, uuid)
		at := base.Add(time.Duration(i) * time.Minute).Format(time.RFC3339Nano)
		dc, err := ch.PublishWithDeferredConfirmWithContext(context.Background(), "", fx.Poison, true, false, amqp.Publishing{
			Headers: amqp.Table{
				"_watermill_message_uuid":    uuid,
				"reason_poisoned":            fmt.Sprintf("decoding order %d: %s", i, strings.Repeat("very long reason ", 10)),
				"handler_poisoned":           "orders",
				"rabbitretry-attempts":       "3",
				"rabbitretry-poisoned-at":    at,
				"rabbitretry-original-queue": fx.Q,
				"rabbitretry-error-class":    class,
				"rabbitretry-attempt":        "3",
			},
			Body: []byte(fmt.Sprintf(`{"order":%d}`, i)),
		})
		check(err)
		confs = append(confs, dc)
	}
	for _, dc := range confs {
		if !dc.Wait() {
			t.Fatal("publish nacked")
		}
	}
	return fx
}

func (fx *fixture) depth(t *testing.T, q string) int {
	t.Helper()
	ch, err := fx.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	info, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return info.Messages
}

func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestListJSON(t *testing.T) {
	fx := newFixture(t, 4)
	code, out, errOut := runCLI(t, "--uri", fx.uri, "list", "--queue", fx.Poison, "--json")
	if code != exitOK {
		t.Fatalf("exit %d, stderr: %s", code, errOut)
	}
	var msgs []admin.Message
	if err := json.Unmarshal([]byte(out), &msgs); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out)
	}
	if len(msgs) != 4 || msgs[1].UUID != fx.uuids[1] || msgs[1].Class != "malformed" || msgs[1].Attempts != 3 ||
		msgs[1].OriginalQueue != fx.Q || string(msgs[1].Body) != `{"order":1}` || msgs[1].PoisonedAt.IsZero() {
		t.Fatalf("messages = %+v", msgs)
	}

	// Filters; flags before the command are global too.
	code, out, _ = runCLI(t, "--uri", fx.uri, "--queue", fx.Poison, "--json", "list", "--class", "malformed", "--since", "2024-05-01T12:02:00Z")
	if code != exitOK {
		t.Fatalf("exit %d", code)
	}
	msgs = nil
	if err := json.Unmarshal([]byte(out), &msgs); err != nil || len(msgs) != 1 || msgs[0].UUID != fx.uuids[3] {
		t.Fatalf("filtered list: %v %+v", err, msgs)
	}
	// Nothing matches: [] not null.
	code, out, _ = runCLI(t, "--uri", fx.uri, "list", "--queue", fx.Poison, "--json", "--uuid", "nope")
	if code != exitOK || strings.TrimSpace(out) != "[]" {
		t.Fatalf("empty list: exit %d, %q", code, out)
	}
	if d := fx.depth(t, fx.Poison); d != 4 {
		t.Fatalf("list changed the queue depth to %d", d)
	}
}

func TestListTable(t *testing.T) {
	fx := newFixture(t, 2)
	code, out, errOut := runCLI(t, "list", "--uri", fx.uri, "--queue", fx.Poison)
	if code != exitOK {
		t.Fatalf("exit %d: %s", code, errOut)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "UUID") || !strings.Contains(lines[0], "ORIGINAL QUEUE") {
		t.Fatalf("table:\n%s", out)
	}
	if !strings.Contains(lines[1], fx.uuids[0]) || !strings.Contains(lines[1], "2024-05-01T12:00:00Z") || !strings.Contains(lines[1], "permanent") {
		t.Fatalf("row: %q", lines[1])
	}
	reason := lines[1][strings.Index(lines[1], "decoding order"):]
	if n := len([]rune(reason)); n != reasonWidth || !strings.HasSuffix(reason, "...") {
		t.Fatalf("reason cell %q has %d runes, want %d ending in ...", reason, n, reasonWidth)
	}
}

func TestShow(t *testing.T) {
	fx := newFixture(t, 3)
	code, out, errOut := runCLI(t, "show", fx.uuids[2], "--uri", fx.uri, "--queue", fx.Poison)
	if code != exitOK || !strings.Contains(out, "UUID:") || !strings.Contains(out, fx.uuids[2]) ||
		!strings.Contains(out, `{"order":2}`) || !strings.Contains(out, "rabbitretry-error-class:") {
		t.Fatalf("exit %d\n%s\n%s", code, out, errOut)
	}
	code, _, errOut = runCLI(t, "show", "missing-uuid", "--uri", fx.uri, "--queue", fx.Poison)
	if code != exitFail || !strings.Contains(errOut, "missing-uuid") {
		t.Fatalf("show of a missing uuid: exit %d, %s", code, errOut)
	}
	if code, _, _ = runCLI(t, "show", "--queue", fx.Poison); code != exitUsage {
		t.Fatalf("show without uuid: exit %d", code)
	}
}

func TestMissingQueue(t *testing.T) {
	uri := brokerURI(t)
	q := uniqueName(t) + ".poison"
	for _, cmd := range []string{"list", "stats", "replay"} {
		code, _, errOut := runCLI(t, cmd, "--uri", uri, "--queue", q)
		if code != exitFail || !strings.Contains(errOut, q) || !strings.Contains(errOut, "does not exist") {
			t.Fatalf("%s: exit %d, stderr %q", cmd, code, errOut)
		}
	}
}

func TestBrokerUnreachable(t *testing.T) {
	code, _, errOut := runCLI(t, "list", "--uri", "amqp://guest:s3cret@127.0.0.1:1/", "--queue", "q.poison")
	if code != exitFail || !strings.Contains(errOut, "broker") || strings.Contains(errOut, "s3cret") {
		t.Fatalf("exit %d, stderr %q", code, errOut)
	}
}

func TestUsageErrors(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"frobnicate", "--queue", "q"},
		{"list", "--bogus"},
		{"list"}, // no --queue
		{"list", "--queue", "q", "extra"},
		{"list", "--queue", "q", "--since", "yesterday"},
		{"list", "--queue", "q", "--reason-regexp", "("},
		{"list", "--queue", "q", "--header", "novalue"},
		{"list", "--queue", "q", "--limit", "-1"},
		{"purge", "--queue", "q"}, // no --yes
		{"move", "--queue", "q"},  // no --to
		{"stats", "--queue", "q", "--class", "x"},
	} {
		code, _, errOut := runCLI(t, append([]string{"--uri", "amqp://127.0.0.1:1/"}, args...)...)
		if code != exitUsage {
			t.Errorf("%v: exit %d, want %d (stderr %q)", args, code, exitUsage, errOut)
		}
	}
	if code, _, errOut := runCLI(t, "purge", "--queue", "q"); !strings.Contains(errOut, "--yes") || code != exitUsage {
		t.Errorf("purge without --yes: %d %q", code, errOut)
	}
	if code, _, _ := runCLI(t, "-h"); code != exitOK {
		t.Errorf("-h: exit %d", code)
	}
	if code, _, _ := runCLI(t, "list", "-h"); code != exitOK {
		t.Errorf("list -h: exit %d", code)
	}
}

func TestReplayPurgeStats(t *testing.T) {
	fx := newFixture(t, 6)

	code, out, errOut := runCLI(t, "stats", "--uri", fx.uri, "--queue", fx.Poison, "--json")
	var st admin.Stats
	if code != exitOK || json.Unmarshal([]byte(out), &st) != nil || st.Depth != 6 || st.ByClass["malformed"] != 3 {
		t.Fatalf("stats: exit %d %s %s", code, out, errOut)
	}
	if code, out, _ = runCLI(t, "stats", "--uri", fx.uri, "--queue", fx.Poison); code != exitOK || !strings.Contains(out, "malformed") {
		t.Fatalf("stats table: %d\n%s", code, out)
	}

	code, out, _ = runCLI(t, "purge", "--uri", fx.uri, "--queue", fx.Poison, "--class", "malformed", "--dry-run")
	if code != exitOK || !strings.Contains(out, "would delete 3") || fx.depth(t, fx.Poison) != 6 {
		t.Fatalf("purge dry run: %d %q", code, out)
	}
	code, out, _ = runCLI(t, "purge", "--uri", fx.uri, "--queue", fx.Poison, "--class", "malformed", "--yes")
	if code != exitOK || !strings.Contains(out, "deleted 3") || fx.depth(t, fx.Poison) != 3 {
		t.Fatalf("purge: %d %q", code, out)
	}

	code, out, errOut = runCLI(t, "replay", "--uri", fx.uri, "--queue", fx.Poison, "--json")
	var res struct {
		DryRun   bool     `json:"dry_run"`
		Matched  int      `json:"matched"`
		Replayed int      `json:"replayed"`
		Errors   []string `json:"errors"`
	}
	if code != exitOK || json.Unmarshal([]byte(out), &res) != nil || res.Replayed != 3 || res.Matched != 3 || len(res.Errors) != 0 {
		t.Fatalf("replay: exit %d\n%s\n%s", code, out, errOut)
	}
	if !strings.Contains(errOut, "replayed 3/3") {
		t.Fatalf("no progress on stderr: %q", errOut)
	}
	if fx.depth(t, fx.Poison) != 0 || fx.depth(t, fx.Q) != 3 {
		t.Fatalf("after replay: poison %d, Q %d", fx.depth(t, fx.Poison), fx.depth(t, fx.Q))
	}
}

func TestTruncate(t *testing.T) {
	if got := truncate("héllo wörld", 8); got != "héllo..." {
		t.Fatalf("truncate = %q", got)
	}
	if got := truncate("short", 60); got != "short" {
		t.Fatalf("truncate = %q", got)
	}
	if got := oneLine("a\nb\tc"); got != "a b c" {
		t.Fatalf("oneLine = %q", got)
	}
}

func brokerURI(t *testing.T) string { return testkit.URI(t) }
