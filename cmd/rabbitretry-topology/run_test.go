package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

func runArgs(args ...string) (code int, stdout, stderr string) {
	var out, errOut bytes.Buffer
	code = run(args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// Bad command lines exit 2 with a message on stderr, before any
// connection; -h exits 0.
func TestUsageErrors(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "missing command"},
		{[]string{"frobnicate", "--queue", "q"}, "unknown command"},
		{[]string{"show"}, "--queue is required"},
		{[]string{"show", "--queue", "q", "extra"}, "unexpected argument"},
		{[]string{"show", "--queue", "q", "--tiers", "1s,soon"}, "--tiers"},
		{[]string{"show", "--queue", "q", "--tiers", "1500us"}, "not a whole number of milliseconds"},
		{[]string{"show", "--queue", "q", "--queue-type", "stream"}, "QueueType"},
		{[]string{"show", "--queue", "q", "--max-attempts", "0"}, "MaxAttempts"},
		{[]string{"show", "--queue", "q", "--dry-run"}, "--dry-run applies to tidy and cascade move only"},
		{[]string{"tidy", "--queue", "q", "--json"}, "--json applies to show and cascade census only"},
		{[]string{"show", "--queue", "q", "--management-url", "ftp://u:s3cret@h/"}, "--management-url"},
		{[]string{"show", "--queue", "q", "--uri", "http://u:s3cret@h/"}, "--uri"},
		{[]string{"show", "--no-such-flag"}, "flag provided but not defined"},
	} {
		code, out, errOut := runArgs(c.args...)
		if code != exitUsage || !strings.Contains(errOut, c.want) || out != "" {
			t.Errorf("%q: exit %d, stdout %q, stderr %q; want exit 2 and %q", c.args, code, out, errOut, c.want)
		}
		if strings.Contains(errOut, "s3cret") {
			t.Errorf("%q: password printed: %s", c.args, errOut)
		}
	}
	if code, _, errOut := runArgs("-h"); code != exitOK || !strings.Contains(errOut, "Usage: rabbitretry-topology show|tidy") || !strings.Contains(errOut, "cascade waiting|census|move|redirect|unredirect") ||
		strings.Contains(errOut, "guest:guest@127") {
		t.Errorf("-h: exit %d, %s", code, errOut)
	}
}

// A management API that does not answer is an operation failure (exit 1),
// reported without the password.
func TestManagementUnreachable(t *testing.T) {
	uri := testkit.URI(t)
	code, _, errOut := runArgs("show", "--uri", uri, "--queue", "q", "--management-url", "http://admin:s3cret@127.0.0.1:1/")
	if code != exitFail || errOut == "" || strings.Contains(errOut, "s3cret") {
		t.Errorf("exit %d, stderr %q; want 1 and no password", code, errOut)
	}
	if u, err := amqp.ParseURI(uri); err == nil && u.Password != "" && strings.Contains(errOut, ":"+u.Password+"@") {
		t.Errorf("AMQP password printed: %s", errOut)
	}
}

// A deploy moved Q from tiers [1s, 30s] to [2s] before its subscriber
// restarted: show lists 2s missing and 1s, 30s orphans; tidy --dry-run
// changes nothing; tidy deletes the empty 1s orphan and keeps the 30s one
// holding a message.
func TestShowAndTidy(t *testing.T) {
	mgmt := testkit.HaveMgmt(t)
	uri := testkit.URI(t)
	q := testkit.UniqueName(t, "it.topocmd")
	r, err := amqpretry.New(amqpretry.Config{URI: uri, Subscriber: wamqp.NewDurableQueueConfig(uri),
		Mode: amqpretry.Tiers(time.Second, 30*time.Second), Logger: watermill.NopLogger{}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	t.Cleanup(func() {
		if err := r.DeleteQueuesAndOrphans(context.Background(), mgmt, q); err != nil {
			t.Errorf("cleanup: %v", err)
		}
		_ = r.DeleteQueues(q)
	})
	sub, err := wamqp.NewSubscriber(r.SubscriberConfig(), watermill.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SubscribeInitialize(q); err != nil {
		t.Fatal(err)
	}
	_ = sub.Close()
	ch, err := r.Publisher().Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.PublishWithContext(context.Background(), "", q+".wait.30s", true, false, amqp.Publishing{Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	_ = ch.Close()

	base := []string{"--uri", uri, "--management-url", mgmt, "--queue", q, "--tiers", "2s"}
	var out string
	// The management API's counts refresh every few seconds: poll.
	testkit.WaitFor(t, 30*time.Second, "show to count the waiting message", func() bool {
		var code int
		var errOut string
		code, out, errOut = runArgs(append([]string{"show"}, base...)...)
		if code != exitOK {
			t.Fatalf("show: exit %d: %s", code, errOut)
		}
		for _, line := range strings.Split(out, "\n") { // column widths follow the longest name
			if f := strings.Fields(line); len(f) >= 4 && f[0] == q+".wait.30s" && f[1] == "orphan-wait" && f[2] == "30s" && f[3] == "1" {
				return true
			}
		}
		return false
	})
	t.Logf("show:\n%s", out)
	for _, want := range []string{
		q + ".wait.2s", "missing", q + ".wait.1s", "orphan-wait", "1 missing", "2 orphan wait queue(s)", "tiers 2s",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("show lacks %q", want)
		}
	}
	if strings.Contains(out, ":guest@") {
		t.Errorf("show printed a password")
	}

	code, jout, errOut := runArgs(append([]string{"show", "--json"}, base...)...)
	var rep amqpretry.TopologyReport
	if code != exitOK || json.Unmarshal([]byte(jout), &rep) != nil || len(rep.Orphans) != 2 || len(rep.Missing) != 1 {
		t.Errorf("show --json: exit %d, %s %s", code, jout, errOut)
	}

	code, out, errOut = runArgs(append([]string{"tidy", "--dry-run"}, base...)...)
	t.Logf("tidy --dry-run:\n%s", out)
	if code != exitOK || !strings.Contains(out, "delete (if still empty)") || !strings.Contains(out, "keep (not empty)") {
		t.Errorf("tidy --dry-run: exit %d, %s %s", code, out, errOut)
	}
	ch, err = r.Publisher().Channel()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ch.QueueDeclarePassive(q+".wait.1s", true, false, false, false, nil); err != nil {
		t.Fatalf("the dry run deleted the empty orphan: %v", err)
	}
	_ = ch.Close()

	code, out, errOut = runArgs(append([]string{"tidy"}, base...)...)
	t.Logf("tidy:\n%s", out)
	if code != exitOK || !strings.Contains(out, "deleted  "+q+".wait.1s\n") ||
		!strings.Contains(out, "kept     "+q+".wait.30s (tier 30s, not empty") || !strings.Contains(out, "1 deleted, 1 kept: run tidy again in 30s") {
		t.Errorf("tidy: exit %d, %s %s", code, out, errOut)
	}
	ch, err = r.Publisher().Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	if st, err := ch.QueueDeclarePassive(q+".wait.30s", true, false, false, false, nil); err != nil || st.Messages != 1 {
		t.Errorf("kept orphan: %+v, %v", st, err)
	}
}
