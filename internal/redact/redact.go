// Package redact hides the passwords of AMQP URIs and PostgreSQL DSNs in
// text meant for people: error messages, log lines, metric labels.
//
// A valid URL (amqp://, amqps://, postgres://, postgresql://) is shown with
// net/url's URL.Redacted (password replaced by "xxxxx"). Error texts made by
// libraries from a URI that does not parse (net/url quotes it whole: `parse
// "amqp://guest:S3cret@host:56x4/": invalid port`) are scrubbed of the
// password, which is found the way net/url would find it (userinfo = the
// authority up to its last '@'), raw and percent-decoded; key=value DSNs
// (password=... or password='...') and a URL's password= / sslpassword=
// query parameters are scrubbed too.
package redact

import (
	"io"
	"net/url"
	"os"
	"regexp"
	"sort"
	"strings"
)

// Mask replaces a password.
const Mask = "xxxxx"

// URI returns s with its password replaced by Mask: URL.Redacted for a URL
// that parses, else s scrubbed of every secret Secrets finds.
func URI(s string) string {
	if u, err := url.Parse(s); err == nil && u.Scheme != "" && u.Host != "" {
		q := u.Query()
		changed := false
		for k := range q {
			if isPasswordKey(k) {
				q.Set(k, Mask)
				changed = true
			}
		}
		if changed {
			u.RawQuery = q.Encode()
		}
		return u.Redacted()
	}
	return String(s, s)
}

// Secrets returns the passwords found in the connection strings conns: a
// URL's userinfo password (raw and percent-decoded, also when the URL does
// not parse) and password= / sslpassword= values (URL query or key=value
// DSN), longest first. Empty strings are left out.
//
// Complexity (~22): one parser tolerant of every connection-string shape
// (URL, broken URL, key=value DSN); each branch is one shape.
func Secrets(conns ...string) []string {
	seen := map[string]bool{}
	var out []string
	add := func(s string) {
		if s == "" || seen[s] {
			return
		}
		seen[s] = true
		out = append(out, s)
		if d, err := url.PathUnescape(s); err == nil && d != s && !seen[d] && d != "" {
			seen[d] = true
			out = append(out, d)
		}
		if d, err := url.QueryUnescape(s); err == nil && d != s && !seen[d] && d != "" {
			seen[d] = true
			out = append(out, d)
		}
		// A password with an unencoded delimiter is quoted in pieces by
		// net/url ("invalid port \":S3cret\" after host").
		if strings.ContainsAny(s, "/?#@:") {
			for _, p := range strings.FieldsFunc(s, func(r rune) bool { return strings.ContainsRune("/?#@:", r) }) {
				if len(p) >= 3 && !seen[p] {
					seen[p] = true
					out = append(out, p)
				}
			}
		}
	}
	for _, c := range conns {
		if _, rest, ok := strings.Cut(c, "://"); ok {
			// The authority ends at the first '/', '?' or '#' after the
			// last '@' that precedes one: net/url takes userinfo up to the
			// last '@' of the authority. A malformed URI may have a '/' in
			// its password, so look for the last '@' before any '?' / '#'.
			auth := rest
			if i := strings.IndexAny(auth, "?#"); i >= 0 {
				auth = auth[:i]
			}
			if at := strings.LastIndex(auth, "@"); at >= 0 {
				if _, pw, ok := strings.Cut(auth[:at], ":"); ok {
					add(pw)
				}
			}
		}
		for _, m := range kvPassword.FindAllStringSubmatch(c, -1) {
			v := m[2]
			if strings.HasPrefix(v, "'") {
				v = strings.TrimSuffix(strings.TrimPrefix(v, "'"), "'")
				v = strings.ReplaceAll(v, `\'`, `'`)
			}
			add(v)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out
}

// kvPassword matches password=value in a key=value DSN (quoted or not) and
// in a URL query.
var kvPassword = regexp.MustCompile(`(?i)(^|[\s?&=])(?:ssl)?password\s*=\s*('(?:[^'\\]|\\.)*'|[^\s&#]*)`)

func isPasswordKey(k string) bool {
	k = strings.ToLower(k)
	return k == "password" || k == "sslpassword"
}

// String returns text with every secret of conns (Secrets) replaced by Mask.
func String(text string, conns ...string) string {
	for _, s := range Secrets(conns...) {
		text = strings.ReplaceAll(text, s, Mask)
	}
	return text
}

// Error returns err with every secret of conns replaced by Mask in its
// text; errors.Is and errors.As still see err's chain (the wrapper's
// Unwrap returns err). nil stays nil; an error whose text holds no secret
// is returned as is.
func Error(err error, conns ...string) error {
	if err == nil {
		return nil
	}
	msg := err.Error()
	safe := String(msg, conns...)
	if safe == msg {
		return err
	}
	return &redacted{msg: safe, err: err}
}

type redacted struct {
	msg string
	err error
}

func (r *redacted) Error() string { return r.msg }
func (r *redacted) Unwrap() error { return r.err }

// Writer returns w with every secret of conns (Secrets) replaced by Mask in
// each Write. Secrets are matched within one Write only: callers write
// whole messages or lines (fmt.Fprintf, a logger). A Write reports len(p)
// written when the scrubbed text was written whole.
func Writer(w io.Writer, conns ...string) io.Writer {
	s := Secrets(conns...)
	if len(s) == 0 {
		return w
	}
	return &writer{w: w, secrets: s}
}

type writer struct {
	w       io.Writer
	secrets []string
}

func (w *writer) Write(p []byte) (int, error) {
	text := string(p)
	for _, s := range w.secrets {
		text = strings.ReplaceAll(text, s, Mask)
	}
	if _, err := io.WriteString(w.w, text); err != nil {
		return 0, err
	}
	return len(p), nil
}

// CommandLine returns the connection strings a command line may hold: the
// arguments that look like a URL (contain "://") or a key=value DSN
// (contain "password"), and the values of the environment variables envs.
func CommandLine(args []string, envs ...string) []string {
	var out []string
	for _, a := range args {
		if strings.Contains(a, "://") || strings.Contains(strings.ToLower(a), "password") {
			out = append(out, a)
		}
	}
	for _, e := range envs {
		if v := os.Getenv(e); v != "" {
			out = append(out, v)
		}
	}
	return out
}
