package testkit

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// The broker a test controls comes from the environment, never from whatever
// the machine's default rabbitmqctl happens to reach (scripts/brokers.sh env
// NAME prints these):
//
//	AMQP_URI                the broker the test connects to
//	RABBITRETRY_CTL         a command prefix; appending rabbitmqctl arguments
//	                        runs them against that broker (default "rabbitmqctl",
//	                        which is right only for the machine's own broker)
//	RABBITRETRY_BROKER      local | 43 | cluster (default local)
//	RABBITRETRY_NODES       the cluster's node names, space separated
//	RABBITRETRY_NODE_CTL    a command prefix taking "kill|start|stop NODE"
//	                        (scripts/brokers.sh node-...)

// CtlCommand returns the rabbitmqctl command prefix for the broker under
// test: RABBITRETRY_CTL, else the machine's rabbitmqctl, but only when the
// broker under test is the machine's default one (AMQP_URI unset or
// DefaultURI). For any other broker without RABBITRETRY_CTL it returns "":
// a test must never control a broker it was not given.
func CtlCommand() string {
	if c := strings.TrimSpace(os.Getenv("RABBITRETRY_CTL")); c != "" {
		return c
	}
	if u := os.Getenv("AMQP_URI"); u != "" && u != DefaultURI {
		return ""
	}
	for _, p := range []string{"rabbitmqctl", "/usr/sbin/rabbitmqctl"} {
		if path, err := exec.LookPath(p); err == nil {
			return path
		}
	}
	return ""
}

// Broker names the broker under test: "local" (default), "43" or "cluster".
func Broker() string {
	if b := os.Getenv("RABBITRETRY_BROKER"); b != "" {
		return b
	}
	return "local"
}

// HaveCtl skips the test when no rabbitmqctl can reach the broker under test
// (fails under CI=true).
func HaveCtl(t testing.TB) {
	t.Helper()
	if CtlCommand() == "" {
		if os.Getenv("CI") == "true" {
			t.Fatal("no rabbitmqctl for the broker under test (set RABBITRETRY_CTL)")
		}
		t.Skip("no rabbitmqctl for the broker under test (set RABBITRETRY_CTL)")
	}
}

// Ctl runs rabbitmqctl args against the broker under test, bounded by
// timeout, and returns its combined output.
func Ctl(t testing.TB, timeout time.Duration, args ...string) (string, error) {
	t.Helper()
	return runPrefix(CtlCommand(), timeout, args...)
}

// NodeCtl runs "VERB NODE" through RABBITRETRY_NODE_CTL (cluster tests:
// kill, start, stop one node).
func NodeCtl(t testing.TB, timeout time.Duration, verb, node string) (string, error) {
	t.Helper()
	prefix := os.Getenv("RABBITRETRY_NODE_CTL")
	if prefix == "" {
		return "", fmt.Errorf("RABBITRETRY_NODE_CTL is not set")
	}
	return runPrefix(prefix, timeout, verb, node)
}

// Nodes returns the cluster's node names (RABBITRETRY_NODES), or nil.
func Nodes() []string { return strings.Fields(os.Getenv("RABBITRETRY_NODES")) }

func runPrefix(prefix string, timeout time.Duration, args ...string) (string, error) {
	if prefix == "" {
		return "", fmt.Errorf("no broker control command (set RABBITRETRY_CTL)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	quoted := make([]string, len(args))
	for i, a := range args {
		quoted[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	cmd := exec.CommandContext(ctx, "/bin/sh", "-c", prefix+" "+strings.Join(quoted, " "))
	cmd.Env = append(os.Environ(), "PATH="+os.Getenv("PATH")+":/usr/sbin:/sbin")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("%s %s: %w: %s", prefix, strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// MgmtURI is the management HTTP API of the broker under test:
// RABBITRETRY_MGMT_URI when set (scripts/brokers.sh env prints it, empty
// for a broker without one), else http://guest:guest@127.0.0.1:15672/ for
// the machine's default broker, else "".
func MgmtURI() string {
	if v, ok := os.LookupEnv("RABBITRETRY_MGMT_URI"); ok {
		return strings.TrimSpace(v)
	}
	if u := os.Getenv("AMQP_URI"); u != "" && u != DefaultURI {
		return ""
	}
	return "http://guest:guest@127.0.0.1:15672/"
}

// HaveMgmt returns MgmtURI, skipping the test when the broker under test
// has no management API that answers (the cluster here runs without one).
// Under CI=true a missing API on a broker that should have one fails.
func HaveMgmt(t testing.TB) string {
	t.Helper()
	u := MgmtURI()
	if u == "" {
		t.Skip("the broker under test has no management API (RABBITRETRY_MGMT_URI is empty)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(u, "/")+"/api/overview", nil)
	if err == nil {
		var resp *http.Response
		if resp, err = http.DefaultClient.Do(req); err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				err = fmt.Errorf("GET /api/overview: %s", resp.Status)
			}
		}
	}
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("management API %s does not answer: %v (scripts/ensure-broker.sh enables it)", RedactURI(u), err)
		}
		t.Skipf("management API %s does not answer: %v (scripts/ensure-broker.sh enables it)", RedactURI(u), err)
	}
	return u
}
