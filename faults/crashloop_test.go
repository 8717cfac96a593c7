package faults

import (
	"bytes"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rabbitretry/rabbitretry/amqpretry"
	"github.com/rabbitretry/rabbitretry/middleware"
)

// A crash loop on a quorum queue (issue 18, item 2): one message kills its
// consumer process (SIGKILL) each time it runs; three innocent messages sit
// beside it in the prefetch buffer. A connection loss returns every unacked
// delivery with the redelivered flag, and on RabbitMQ 4.x raises both
// x-delivery-count and x-acquired-count for each of them (quorum queue docs,
// "When is delivery count incremented?"): nothing the broker sets says which
// message crashed. Must hold, for prefetch 1 and 4: the innocents are handled
// and succeed, only the crasher is poisoned (class redelivery-limit), after
// at most MaxRedeliveries crashes, and nothing is lost.
func TestCrashLoop(t *testing.T) {
	bin := buildConsumer(t, t.TempDir())
	for _, prefetch := range []int{1, 4} {
		t.Run(fmt.Sprintf("prefetch%d", prefetch), func(t *testing.T) { crashLoop(t, bin, prefetch) })
	}
}

func crashLoop(t *testing.T, bin string, prefetch int) {
	const maxRedeliveries = 3
	e := newEnv(t, amqpretry.QueueTypeQuorum)
	crashUUIDs, crashPs := newMessages(1, func(int) []byte { return []byte("crash") })
	okUUIDs, okPs := newMessages(3, nil)
	e.declare()
	e.publish(crashPs...) // first in the queue: the innocents are prefetched behind it
	e.publish(okPs...)
	dir := t.TempDir()
	var outs []string
	crashes := 0
	done := func() bool { // every message handled or poisoned, nothing left to run
		return len(successes(t, outs...))+e.poisonDepth() >= 1+len(okUUIDs) && e.quiet()
	}
	for !done() {
		if crashes > 2*maxRedeliveries+2 {
			t.Fatalf("still crashing after %d crashes; innocents handled: %d of %d", crashes, len(successes(t, outs...)), len(okUUIDs))
		}
		out := filepath.Join(dir, fmt.Sprintf("success-%d.log", len(outs)))
		outs = append(outs, out)
		c := startCrashingConsumer(t, bin, e, out, "-prefetch", fmt.Sprint(prefetch), "-fail-percent", "0",
			"-crash-payload", "crash", "-max-redeliveries", fmt.Sprint(maxRedeliveries))
		exited := false
		waitFor(t, 60*time.Second, "a crash or the end", func() bool {
			select {
			case <-c.done:
				exited = true
				return true
			default:
				return done()
			}
		})
		if exited {
			if !strings.Contains(c.stderr.String(), "CRASH") {
				t.Fatalf("consumer exited without crashing:\n%s", c.stderr)
			}
			crashes++
			continue
		}
		_ = c.cmd.Process.Kill() // the end: no more work for it
		<-c.done
	}
	poisoned, ds := e.poisoned()
	acc := account(t, append(append([]string{}, crashUUIDs...), okUUIDs...), successes(t, outs...), poisoned)
	t.Logf("prefetch %d: %d crashes (MaxRedeliveries %d)", prefetch, crashes, maxRedeliveries)
	if poisoned[crashUUIDs[0]] != 1 || acc.Handled != len(okUUIDs) || acc.Poisoned != 1 {
		t.Errorf("crasher poisoned %d times; %d of %d innocents handled; %d poisoned", poisoned[crashUUIDs[0]], acc.Handled, len(okUUIDs), acc.Poisoned)
	}
	for _, d := range ds {
		if c, _ := d.Headers[middleware.ErrorClassKey].(string); c != string(middleware.ClassRedeliveryLimit) {
			t.Errorf("poisoned with class %q, want %q", c, middleware.ClassRedeliveryLimit)
		}
	}
	if crashes > maxRedeliveries {
		t.Errorf("%d crashes, more than MaxRedeliveries %d", crashes, maxRedeliveries)
	}
	e.checkEmpty()
}

// startCrashingConsumer is startConsumer without the wait for READY: the
// process may crash before it prints it.
func startCrashingConsumer(t *testing.T, bin string, e *env, out string, extra ...string) *consumerProc {
	t.Helper()
	cmd := exec.Command(bin, append([]string{
		"-uri", e.uri, "-exchange", e.exchange, "-routing-key", routingKey, "-queue", e.queue,
		"-naming-prefix", e.prefix, "-queue-type", e.queueType, "-tiers", "200ms,400ms",
		"-max-attempts", "5", "-initial-backoff", "200ms", "-out", out}, extra...)...)
	p := &consumerProc{cmd: cmd, out: out, stderr: &bytes.Buffer{}, done: make(chan error, 1)}
	cmd.Stderr = &lockedWriter{w: p.stderr}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- cmd.Wait() }()
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}
