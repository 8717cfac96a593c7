package redact

import (
	"errors"
	"fmt"
	"net/url"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
)

const pw = "S3cretSentinel"

func TestURIAndError(t *testing.T) {
	conns := []string{
		"amqp://guest:" + pw + "@127.0.0.1:5672/",
		"amqp://guest:" + pw + "@127.0.0.1:56x4/",
		"amqps://guest:" + pw + "@host/vh?heartbeat=10",
		"amqp://guest:" + url.PathEscape(pw+"/@:") + "@h/",
		"amqp://guest:" + pw + "/x@h:1/",
		"postgres://u:" + pw + "@localhost:5432/test?sslmode=disable",
		"postgres://u@localhost:5432/test?password=" + pw,
		"host=localhost user=u password=" + pw + " dbname=test",
		"host=localhost user=u password='" + pw + " x' dbname=test",
		"host=localhost port=5x user=u password=" + pw,
	}
	for _, c := range conns {
		if got := URI(c); strings.Contains(got, pw) {
			t.Errorf("URI(%q) = %q", c, got)
		}
		_, perr := amqp.ParseURI(c)
		_, uerr := url.Parse(c)
		for _, e := range []error{perr, uerr, fmt.Errorf("dial %s: %w", c, errors.New("x"))} {
			if e == nil {
				continue
			}
			if got := Error(e, c); strings.Contains(got.Error(), pw) {
				t.Errorf("Error(%q) = %q", c, got)
			} else if !errors.Is(got, e) {
				t.Errorf("Error(%q) lost the chain", c)
			}
		}
	}
	if got := URI("amqp://guest:" + pw + "@h:5672/v"); got != "amqp://guest:xxxxx@h:5672/v" {
		t.Errorf("URI = %q", got)
	}
	if Error(nil, conns...) != nil {
		t.Error("Error(nil) != nil")
	}
}

func TestWriterAndCommandLine(t *testing.T) {
	t.Setenv("REDACT_TEST_DSN", "host=h password="+pw+"2 user=u")
	conns := CommandLine([]string{"--uri", "amqp://g:" + pw + "@h/", "--dsn=password=" + pw + "3", "list"}, "REDACT_TEST_DSN", "REDACT_TEST_UNSET")
	if len(conns) != 3 {
		t.Fatalf("CommandLine = %q", conns)
	}
	var b strings.Builder
	w := Writer(&b, conns...)
	for _, s := range []string{"a " + pw + " b\n", "dsn " + pw + "2\n", "x=" + pw + "3\n"} {
		if n, err := fmt.Fprint(w, s); err != nil || n != len(s) {
			t.Fatalf("Write = %d, %v", n, err)
		}
	}
	if strings.Contains(b.String(), pw) || strings.Count(b.String(), Mask) != 3 {
		t.Errorf("Writer wrote %q", b.String())
	}
}
