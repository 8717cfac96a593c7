package faults

import (
	"bufio"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// buildConsumer builds cmd/faults-consumer into dir.
func buildConsumer(t *testing.T, dir string) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = "/usr/local/go/bin/go"
	}
	bin := filepath.Join(dir, "consumer")
	cmd := exec.Command(goBin, "build", "-o", bin, "../cmd/faults-consumer")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ../cmd/faults-consumer: %v\n%s", err, out)
	}
	return bin
}

// consumerProc is one running consumer subprocess.
type consumerProc struct {
	cmd    *exec.Cmd
	out    string // its success file
	stderr *bytes.Buffer
	done   chan error
}

// startConsumer starts cmd/faults-consumer on e's queue; extra are more
// flags (e.g. -native-min).
func startConsumer(t *testing.T, bin string, e *env, out string, extra ...string) *consumerProc {
	t.Helper()
	cmd := exec.Command(bin, append([]string{
		"-uri", e.uri, "-exchange", e.exchange, "-routing-key", routingKey, "-queue", e.queue,
		"-naming-prefix", e.prefix, "-queue-type", e.queueType, "-tiers", "200ms,400ms",
		"-max-attempts", "5", "-initial-backoff", "200ms", "-fail-percent", "30", "-out", out}, extra...)...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p := &consumerProc{cmd: cmd, out: out, stderr: &bytes.Buffer{}, done: make(chan error, 1)}
	cmd.Stderr = &lockedWriter{w: p.stderr}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if cmd.ProcessState == nil {
			_ = cmd.Process.Kill()
			<-p.done
		}
	})
	ready := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if sc.Text() == "READY" {
				close(ready)
			}
		}
		p.done <- cmd.Wait()
	}()
	select {
	case <-ready:
	case err := <-p.done:
		t.Fatalf("consumer exited before READY: %v\n%s", err, p.stderr)
	case <-time.After(30 * time.Second):
		t.Fatalf("consumer not READY within 30 s\n%s", p.stderr)
	}
	return p
}

type lockedWriter struct {
	mu sync.Mutex
	w  *bytes.Buffer
}

func (l *lockedWriter) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.w.Len() > 1<<20 { // cap memory: only the latest output matters for diagnostics
		l.w.Reset()
	}
	return l.w.Write(b)
}

// successes reads a success file: complete lines only (a line cut by
// SIGKILL mid-write would have no newline; one write per line makes that
// practically impossible, but it must not count).
func successes(t *testing.T, files ...string) map[string]int {
	t.Helper()
	m := map[string]int{}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		s := string(b)
		if i := strings.LastIndexByte(s, '\n'); i >= 0 {
			s = s[:i]
		} else {
			s = ""
		}
		for _, line := range strings.Split(s, "\n") {
			if line != "" {
				m[line]++
			}
		}
	}
	return m
}

// A consumer process is SIGKILLed mid-run (its unacked deliveries go back to
// the queue, its confirmed retry copies stay in the wait queues); a second
// process takes over. The union of the success files and the poison queue
// accounts for every published message.
func TestConsumerKilled(t *testing.T) {
	requireLong(t)
	consumerKilled(t, newEnv(t, "classic"))
}

// consumerKilled runs the kill scenario on e; extra are more consumer flags
// (both processes get them).
func consumerKilled(t *testing.T, e *env, extra ...string) {
	bin := buildConsumer(t, t.TempDir())
	dir := t.TempDir()
	out1, out2 := filepath.Join(dir, "success-1.log"), filepath.Join(dir, "success-2.log")

	const n = 800
	uuids, ps := newMessages(n, nil)
	e.declare()
	e.publish(ps...)
	count := func() int { return len(successes(t, out1, out2)) }

	c1 := startConsumer(t, bin, e, out1, extra...)
	waitFor(t, 30*time.Second, "first consumer's progress", func() bool { return len(successes(t, out1)) >= n/3 })
	waiting := 0
	for _, wq := range e.waitQueues() {
		waiting += max(e.depth(wq), 0)
	}
	if err := c1.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	err := <-c1.done
	if ws, ok := c1.cmd.ProcessState.Sys().(syscall.WaitStatus); !ok || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Fatalf("first consumer did not die by SIGKILL: %v", err)
	}
	t.Logf("killed the first consumer after %d successes, %d retries waiting in wait queues (native delayed retries, held in Q, are not counted)", len(successes(t, out1)), waiting)

	c2 := startConsumer(t, bin, e, out2, extra...)
	settled := e.settle(n, count, 60*time.Second)
	if err := c2.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-c2.done:
		if err != nil {
			t.Errorf("second consumer exit: %v\n%s", err, c2.stderr)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("second consumer did not stop on SIGTERM")
	}
	poisoned, _ := e.poisoned()
	acc := account(t, uuids, successes(t, out1, out2), poisoned)
	if !settled {
		t.Errorf("messages did not settle within 60 s")
	}
	e.checkEmpty()
	if acc.Poisoned != 0 {
		t.Errorf("%d messages poisoned; each fails at most twice with 5 attempts", acc.Poisoned)
	}
	if len(successes(t, out2)) == 0 {
		t.Errorf("the second consumer handled nothing")
	}
}
