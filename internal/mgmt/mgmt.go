package mgmt

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/rabbitretry/rabbitretry/internal/redact"
)

// DefaultTimeout bounds one request (connect to last byte of the answer)
// when Options.HTTPClient is nil and Options.Timeout is 0.
const DefaultTimeout = 10 * time.Second

// maxBody bounds how much of an answer is read (64 MiB: a vhost's
// bindings or a 500-queue page with arguments stay well below).
const maxBody = 64 << 20

// maxErrBody bounds how much of an error answer's body an error shows.
const maxErrBody = 4 << 10

// ParseURL parses a management API base URL: scheme http or https and a
// host are required; a trailing "/" is dropped. field names the setting
// in the error ("amqpretry.Config.ManagementURL"), which shows the URL
// with its password redacted.
func ParseURL(raw, field string) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("%s %s is not an http(s) URL (scheme http or https and a host)", field, redact.URI(raw))
	}
	u.Path = strings.TrimSuffix(u.Path, "/")
	u.RawPath = strings.TrimSuffix(u.RawPath, "/")
	return u, nil
}

// Options configure New.
type Options struct {
	// Field names the URL's setting in a URL error (see ParseURL).
	Field string
	// HTTPClient sends the requests. Default: a client with Timeout.
	HTTPClient *http.Client
	// Timeout of the default HTTPClient. Default: DefaultTimeout.
	Timeout time.Duration
	// ErrPrefix starts every request error ("amqpretry" gives
	// "amqpretry: management API GET /api/...: ...").
	ErrPrefix string
}

// Client sends requests to one management API. Safe for concurrent use.
type Client struct {
	base   *url.URL // without user info
	user   *url.Userinfo
	http   *http.Client
	prefix string
}

// New returns the client of the management API at raw (see ParseURL).
func New(raw string, o Options) (*Client, error) {
	u, err := ParseURL(raw, o.Field)
	if err != nil {
		return nil, err
	}
	c := &Client{user: u.User, http: o.HTTPClient, prefix: o.ErrPrefix}
	if c.http == nil {
		t := o.Timeout
		if t <= 0 {
			t = DefaultTimeout
		}
		c.http = &http.Client{Timeout: t}
	}
	u.User = nil
	c.base = u
	return c, nil
}

// Path returns "/api/" followed by parts, each path-escaped (a vhost "/"
// becomes "%2F"): Path("queues", vhost, name).
func Path(parts ...string) string {
	esc := make([]string, len(parts))
	for i, p := range parts {
		esc[i] = url.PathEscape(p)
	}
	return "/api/" + strings.Join(esc, "/")
}

// NotFoundError is the error of a request the management API answered
// 404 Not Found (no such vhost, queue, exchange, policy). Test with
// errors.As.
type NotFoundError struct {
	Method, Path string // Path without the query
	Body         string // the answer's body, trimmed
	prefix       string
}

func (e *NotFoundError) Error() string {
	return fmt.Sprintf("%smanagement API %s %s: 404 Not Found: %s", e.prefix, e.Method, e.Path, e.Body)
}

// IsNotFound reports whether err is (or wraps) a *NotFoundError.
func IsNotFound(err error) bool {
	var nf *NotFoundError
	return errors.As(err, &nf)
}

// Do sends method path (path already escaped, from "/api/", query
// allowed; see Path) with body as JSON (nil: none) and decodes the JSON
// answer into out (nil: ignored). A 404 answer is a *NotFoundError; any
// other status >= 300, a transport error or an undecodable answer is an
// error naming the method and path (never the URL's user info).
func (c *Client) Do(ctx context.Context, method, path string, body, out any) error {
	shown := strings.SplitN(path, "?", 2)[0]
	pfx := ""
	if c.prefix != "" {
		pfx = c.prefix + ": "
	}
	fail := func(format string, args ...any) error {
		return fmt.Errorf("%smanagement API %s %s: "+format, append([]any{pfx, method, shown}, args...)...)
	}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return fail("%w", err)
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base.String()+path, rd)
	if err != nil {
		return fail("%w", err)
	}
	if c.user != nil {
		pw, _ := c.user.Password()
		req.SetBasicAuth(c.user.Username(), pw)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.http.Do(req)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // its URL is not needed again
		}
		return fail("%w", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxBody))
	if err != nil {
		return fail("%w", err)
	}
	if resp.StatusCode >= 300 {
		text := strings.TrimSpace(string(b))
		if len(text) > maxErrBody {
			text = text[:maxErrBody] + "..."
		}
		if resp.StatusCode == http.StatusNotFound {
			return &NotFoundError{Method: method, Path: shown, Body: text, prefix: pfx}
		}
		return fail("%s: %s", resp.Status, text)
	}
	if out != nil {
		if err := json.Unmarshal(b, out); err != nil {
			return fail("%w", err)
		}
	}
	return nil
}
