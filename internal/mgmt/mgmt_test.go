package mgmt

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// A bad URL is refused naming the field, never showing the password.
func TestParseURL(t *testing.T) {
	for _, raw := range []string{"ftp://u:S3cretPW@h/", "http://u:S3cretPW@/", "http://u:S3cretPW@h:99x/", "h:15672"} {
		_, err := ParseURL(raw, "x.Config.ManagementURL")
		if err == nil || strings.Contains(err.Error(), "S3cretPW") || !strings.Contains(err.Error(), "x.Config.ManagementURL") {
			t.Errorf("%q: %v", raw, err)
		}
	}
	u, err := ParseURL("https://u:p@h:15671/prefix/", "f")
	if err != nil || u.Path != "/prefix" {
		t.Fatalf("%v %v", u, err)
	}
}

// Do sends basic auth and JSON, escapes the vhost, and types a 404.
func TestDo(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		user, pass, ok := r.BasicAuth()
		switch {
		case !ok || user != "u" || pass != "S3cretPW":
			w.WriteHeader(http.StatusUnauthorized)
		case r.URL.EscapedPath() == "/api/queues/%2F/q%2F1":
			w.Write([]byte(`{"name":"q/1"}`))
		case r.URL.EscapedPath() == "/api/policies/%2F/p" && r.Method == http.MethodPut:
			w.WriteHeader(http.StatusInternalServerError)
			w.Write([]byte(`{"error":"boom"}`))
		default:
			http.Error(w, `{"error":"Object Not Found"}`, http.StatusNotFound)
		}
	}))
	defer srv.Close()
	c, err := New(strings.Replace(srv.URL, "http://", "http://u:S3cretPW@", 1)+"/", Options{Field: "f", ErrPrefix: "pkg"})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var q struct{ Name string }
	if err := c.Do(ctx, http.MethodGet, Path("queues", "/", "q/1"), nil, &q); err != nil || q.Name != "q/1" {
		t.Fatalf("%+v %v", q, err)
	}
	err = c.Do(ctx, http.MethodGet, Path("queues", "/", "nope")+"?columns=name", nil, &q)
	var nf *NotFoundError
	if !errors.As(err, &nf) || !IsNotFound(err) || nf.Path != "/api/queues/%2F/nope" || !strings.HasPrefix(err.Error(), "pkg: management API GET") {
		t.Fatalf("404: %v", err)
	}
	err = c.Do(ctx, http.MethodPut, Path("policies", "/", "p"), map[string]any{"a": 1}, nil)
	if err == nil || IsNotFound(err) || !strings.Contains(err.Error(), "500") || strings.Contains(err.Error(), "S3cretPW") {
		t.Fatalf("500: %v", err)
	}
	srv.Close()
	err = c.Do(ctx, http.MethodGet, Path("overview"), nil, nil)
	if err == nil || strings.Contains(err.Error(), "S3cretPW") {
		t.Fatalf("closed: %v", err)
	}
}
