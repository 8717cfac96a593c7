package testkit

import (
	"net/url"
	"os"
	"strings"
	"testing"
)

// SentinelPassword is the password of SentinelURIs and SentinelDSNs: a
// test runs an entry point with them and fails if it finds it in any
// output (CheckNoSentinel).
const SentinelPassword = "S3ntinelPassw0rd"

// SentinelURIs returns AMQP URIs with SentinelPassword that fail in every
// way a URI can: it does not parse (bad port; an unencoded '/' in the
// password), the port refuses, the real broker ($AMQP_URI's host) refuses
// the login, a percent-encoded password.
func SentinelURIs() []string {
	host := "127.0.0.1:5672"
	if u, err := url.Parse(os.Getenv("AMQP_URI")); err == nil && u.Host != "" {
		host = u.Host
	}
	return []string{
		"amqp://guest:" + SentinelPassword + "@127.0.0.1:56x4/",
		"amqp://guest:" + SentinelPassword + "/x@127.0.0.1:5672/",
		"amqp://guest:" + SentinelPassword + "@127.0.0.1:1/",
		"amqp://guest:" + SentinelPassword + "@" + host + "/",
		"amqp://guest:" + url.PathEscape(SentinelPassword+"?#") + "@127.0.0.1:1/",
	}
}

// SentinelDSNs returns PostgreSQL DSNs with SentinelPassword, URL and
// key=value forms, that do not parse or whose port refuses.
func SentinelDSNs() []string {
	return []string{
		"postgres://postgres:" + SentinelPassword + "@127.0.0.1:54x2/test",
		"postgres://postgres:" + SentinelPassword + "/x@127.0.0.1:5432/test",
		"postgres://postgres:" + SentinelPassword + "@127.0.0.1:1/test?connect_timeout=2",
		"postgres://postgres@127.0.0.1:1/test?password=" + SentinelPassword,
		"host=127.0.0.1 port=5x user=postgres password=" + SentinelPassword,
		"host=127.0.0.1 port=1 user=postgres password='" + SentinelPassword + " x' connect_timeout=2",
	}
}

// CheckNoSentinel fails t for every line of texts that holds
// SentinelPassword; it returns how many did.
func CheckNoSentinel(t testing.TB, what string, texts ...string) int {
	t.Helper()
	n := 0
	for _, text := range texts {
		for _, line := range strings.Split(text, "\n") {
			if strings.Contains(line, SentinelPassword) {
				n++
				t.Errorf("%s: password in output: %s", what, line)
			}
		}
	}
	return n
}
