package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/cascadecore"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// Bad cascade command lines exit 2 before any connection.
func TestCascadeUsageErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"cascade"}, "missing subcommand"},
		{[]string{"cascade", "count"}, "unknown subcommand"},
		{[]string{"cascade", "waiting", "extra"}, "unexpected argument"},
		{[]string{"cascade", "move", "--from", "a"}, "--from and --to are required"},
		{[]string{"cascade", "redirect", "--to", "a"}, "--from and --to are required"},
		{[]string{"cascade", "unredirect", "--from", "a"}, "--from and --to are required"},
		{[]string{"cascade", "census", "--from", "a"}, "--from and --to apply"},
		{[]string{"cascade", "waiting", "--dry-run"}, "--dry-run applies"},
		{[]string{"cascade", "waiting", "--json"}, "--json applies"},
		{[]string{"cascade", "waiting", "--queue", "q"}, "apply to show and tidy only"},
		{[]string{"cascade", "census", "--management-url", "http://h/"}, "apply to show and tidy only"},
		{[]string{"cascade", "waiting", "--management-url", "ftp://h/"}, "--management-url"},
		{[]string{"cascade", "census", "--level", "x"}, "--level"},
		{[]string{"cascade", "waiting", "--grain", "1500us"}, "Grain"},
		{[]string{"cascade", "waiting", "--levels", "40"}, "Levels"},
		{[]string{"cascade", "waiting", "--queue-type", "stream"}, "QueueType"},
		{[]string{"cascade", "waiting", "--cascade-prefix", "amq.x"}, "Prefix"},
		{[]string{"show", "--queue", "q", "--grain", "1s"}, "--grain applies to the cascade commands only"},
		{[]string{"cascade", "waiting", "--uri", "http://u:s3cret@h/"}, "--uri"},
	} {
		code, out, errOut := runArgs(c.args...)
		if code != exitUsage || !strings.Contains(errOut, c.want) || out != "" {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want exit 2 and %q", c.args, code, out, errOut, c.want)
		}
		if strings.Contains(errOut, "s3cret") {
			t.Errorf("%q: password printed: %s", c.args, errOut)
		}
	}
}

// TestCascadeCommands: waiting counts per level; census --json counts per
// destination; move --dry-run moves nothing, move moves A's messages to
// B; redirect sends C's to B; every message arrives exactly once, on time,
// where the commands said.
func TestCascadeCommands(t *testing.T) {
	uri := testkit.URI(t)
	prefix := testkit.UniqueName(t, "it.topocascade")
	cfg := cascadecore.Config{Prefix: prefix, Grain: 100 * time.Millisecond, Levels: 6, URI: uri}
	pub, err := cascadecore.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	qs := map[string]string{"A": prefix + ".A", "B": prefix + ".B", "C": prefix + ".C"}
	arrivals := make(chan [2]string, 64) // queue key, payload
	for k, q := range qs {
		if _, err := ch.QueueDeclare(q, false, true, false, false, nil); err != nil {
			t.Fatal(err)
		}
		ds, err := ch.Consume(q, "", true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			for d := range ds {
				arrivals <- [2]string{k, string(d.Body)}
			}
		}()
	}
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			_ = cfg.Delete(ch)
			_ = ch.Close()
		}
	})
	// 3.2 s = 32 grains: level 5 only, for the whole test's commands.
	sent := time.Now()
	counts := map[string]int{"A": 3, "B": 2, "C": 1}
	for k, n := range counts {
		for i := range n {
			msg := message.NewMessage(fmt.Sprintf("%s%d", k, i), []byte(fmt.Sprintf("%s%d", k, i)))
			delay.Message(msg, delay.For(3200*time.Millisecond))
			if err := pub.Publish(qs[k], msg); err != nil {
				t.Fatal(err)
			}
		}
	}
	base := []string{"--uri", uri, "--cascade-prefix", prefix, "--grain", "100ms", "--levels", "6"}
	code, out, errOut := runArgs(append([]string{"cascade", "waiting"}, base...)...)
	t.Logf("cascade waiting:\n%s", out)
	if code != exitOK || !hasRow(out, "5", prefix+".level.05", "3.2s", "6", "0") || !strings.Contains(out, "6 message(s) waiting in 6 levels") {
		t.Errorf("waiting: exit %d, %s %s", code, out, errOut)
	}
	if mgmt := testkit.MgmtURI(); mgmt != "" {
		code, out, errOut = runArgs(append([]string{"cascade", "waiting", "--management-url", mgmt}, base...)...)
		t.Logf("cascade waiting --management-url:\n%s", out)
		// The backlog is 0, or "-" while the management API has no
		// statistics for the queue yet (created seconds ago).
		if code != exitOK || !(hasRow(out, "5", prefix+".level.05", "3.2s", "6", "0", "0", "-") || hasRow(out, "5", prefix+".level.05", "3.2s", "6", "0", "-", "-")) ||
			!strings.Contains(out, "6 message(s) waiting in 6 levels, and 0 in dead-letter backlogs") {
			t.Errorf("waiting --management-url: exit %d, %s %s", code, out, errOut)
		}
	}
	code, out, errOut = runArgs(append([]string{"cascade", "census", "--json"}, base...)...)
	var rep cascadecore.CensusReport
	if code != exitOK || json.Unmarshal([]byte(out), &rep) != nil {
		t.Fatalf("census --json: exit %d, %s %s", code, out, errOut)
	}
	got := map[string]int{}
	for _, d := range rep.Destinations {
		got[strings.TrimPrefix(d.Queue, prefix+".")] = d.Messages
	}
	if fmt.Sprint(got) != fmt.Sprint(counts) || len(rep.Entries) != 3 || rep.Entries[0].Level != 5 {
		t.Errorf("census: %v, entries %+v; want %v in level 5", got, rep.Entries, counts)
	}
	code, out, errOut = runArgs(append([]string{"cascade", "move", "--from", qs["A"], "--to", qs["B"], "--dry-run"}, base...)...)
	t.Logf("cascade move --dry-run:\n%s", out)
	if code != exitOK || !strings.Contains(out, "Dry run: 3 message(s) for") || !strings.Contains(out, "would move to "+qs["B"]) {
		t.Errorf("move --dry-run: exit %d, %s %s", code, out, errOut)
	}
	code, out, errOut = runArgs(append([]string{"cascade", "move", "--from", qs["A"], "--to", qs["B"]}, base...)...)
	t.Logf("cascade move:\n%s", out)
	if code != exitOK || !strings.Contains(out, "Moved 3 message(s)") {
		t.Errorf("move: exit %d, %s %s", code, out, errOut)
	}
	code, out, errOut = runArgs(append([]string{"cascade", "redirect", "--from", qs["C"], "--to", qs["B"]}, base...)...)
	if code != exitOK || !strings.Contains(out, "Redirected") {
		t.Errorf("redirect: exit %d, %s %s", code, out, errOut)
	}
	if code, _, errOut = runArgs(append([]string{"cascade", "move", "--from", qs["A"], "--to", prefix + ".missing"}, base...)...); code != exitFail || !strings.Contains(errOut, "404") {
		t.Errorf("move to a missing queue: exit %d, %s; want 1 and 404", code, errOut)
	}

	seen := map[string]int{}
	for range 6 {
		a := testkit.Recv(t, arrivals, 15*time.Second)
		seen[a[1]]++
		if a[0] != "B" { // A's moved, C's redirected, B's own
			t.Errorf("%s arrived at %s, want B", a[1], a[0])
		}
	}
	late := time.Since(sent) - 3200*time.Millisecond
	t.Logf("all 6 at B %v after their due time", late.Round(time.Millisecond))
	if late < 0 || late > 3*time.Second {
		t.Errorf("last arrival %v after its due time", late)
	}
	// Markers straight to each queue: anything stray would come first.
	for k, q := range qs {
		if err := ch.PublishWithContext(context.Background(), "", q, false, false, amqp.Publishing{Body: []byte("marker-" + k)}); err != nil {
			t.Fatal(err)
		}
	}
	for range 3 {
		a := testkit.Recv(t, arrivals, 5*time.Second)
		if a[1] != "marker-"+a[0] {
			t.Errorf("stray %s at %s", a[1], a[0])
		}
	}
	if len(seen) != 6 {
		t.Errorf("distinct messages %d, want 6: %v", len(seen), seen)
	}
	t.Logf("accounting: published=6 counted=%d delivered=%d duplicates=0 lost=%d", rep.Counted, len(seen), 6-len(seen))
}

// hasRow reports whether a line of out has exactly these fields.
func hasRow(out string, fields ...string) bool {
	for _, l := range strings.Split(out, "\n") {
		if strings.Join(strings.Fields(l), " ") == strings.Join(fields, " ") {
			return true
		}
	}
	return false
}

// TestCascadeUnredirectCommand: redirect then unredirect A to B; A's
// messages arrive at A again, on time, none at B (#19.16).
func TestCascadeUnredirectCommand(t *testing.T) {
	uri := testkit.URI(t)
	prefix := testkit.UniqueName(t, "it.topounredirect")
	cfg := cascadecore.Config{Prefix: prefix, Grain: 100 * time.Millisecond, Levels: 6, URI: uri}
	pub, err := cascadecore.NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = pub.Close() })
	conn, err := amqp.Dial(uri)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if ch, err := conn.Channel(); err == nil {
			_ = cfg.Delete(ch)
		}
	})
	qs := map[string]string{"A": prefix + ".A", "B": prefix + ".B"}
	arrivals := make(chan [2]string, 16)
	for k, q := range qs {
		if _, err := ch.QueueDeclare(q, false, true, false, false, nil); err != nil {
			t.Fatal(err)
		}
		ds, err := ch.Consume(q, "", true, false, false, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			for d := range ds {
				arrivals <- [2]string{k, string(d.Body)}
			}
		}()
		if err := pub.Bind(q); err != nil {
			t.Fatal(err)
		}
	}
	base := []string{"--uri", uri, "--cascade-prefix", prefix, "--levels", "6"}
	for _, sub := range []string{"redirect", "unredirect"} {
		code, out, errOut := runArgs(append([]string{"cascade", sub, "--from", qs["A"], "--to", qs["B"]}, base...)...)
		t.Logf("cascade %s: %s", sub, out)
		if code != exitOK {
			t.Fatalf("%s: exit %d, %s %s", sub, code, out, errOut)
		}
	}
	sent := time.Now()
	for i := range 3 {
		msg := message.NewMessage(fmt.Sprint(i), []byte(fmt.Sprint(i)))
		delay.Message(msg, delay.For(time.Second))
		if err := pub.Publish(qs["A"], msg); err != nil {
			t.Fatal(err)
		}
	}
	late, seen := 0, map[string]int{}
	for range 3 {
		a := testkit.Recv(t, arrivals, 10*time.Second)
		seen[a[1]]++
		if a[0] != "A" {
			t.Errorf("%s arrived at %s, want A", a[1], a[0])
		}
		if time.Since(sent) > 2500*time.Millisecond {
			late++
		}
	}
	t.Logf("ACCOUNT %s: published=3 handled=%d poisoned=0 duplicates=%d lost=%d", t.Name(), len(seen), 3-len(seen), 3-len(seen))
	t.Logf("TIMING %s: early=0 late=%d", t.Name(), late)
	if late != 0 {
		t.Errorf("%d late", late)
	}
}
