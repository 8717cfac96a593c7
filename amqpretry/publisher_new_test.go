package amqpretry

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	crand "crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"fmt"
	"io"
	"math/big"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v2/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/rabbitretry/rabbitretry/internal/testkit"
)

// Item 12: New gives the retry publisher the subscriber's connection
// settings (watermill-amqp Config.Connection.AmqpConfig): Dial, Heartbeat.
func TestNew_PublisherUsesSubscriberAmqpConfig(t *testing.T) {
	uri := brokerURI(t)
	subName := uniqueName(t, "the-subscriber")
	var dials atomic.Int64
	sub := wamqp.NewDurableQueueConfig(uri)
	sub.Connection.AmqpConfig = &amqp.Config{
		Heartbeat:  4 * time.Second,
		Properties: amqp.Table{"connection_name": subName},
		Dial: func(network, addr string) (net.Conn, error) {
			dials.Add(1)
			return amqp.DefaultDial(5*time.Second)(network, addr)
		},
	}
	r, err := New(Config{Subscriber: sub})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Close() })
	if dials.Load() == 0 {
		t.Fatal("the subscriber's AmqpConfig.Dial was not used by the retry publisher")
	}
	c, err := r.Publisher().Connection()
	if err != nil {
		t.Fatal(err)
	}
	if hb := c.Config.Heartbeat; hb != 4*time.Second {
		t.Fatalf("retry publisher heartbeat %v, want the subscriber's 4s", hb)
	}
	// The subscriber's config is not modified (amqp091-go writes into the
	// Properties it dials with).
	if props := sub.Connection.AmqpConfig.Properties; len(props) != 1 || props["connection_name"] != subName {
		t.Fatalf("subscriber's AmqpConfig.Properties modified: %v", props)
	}
	// What the broker sees: the heartbeat, and a connection name of its own.
	if testkit.CtlCommand() != "" {
		// Found by its name (behind a load balancer the broker sees the
		// proxy's port, not ours).
		want := subName + ".retry-publisher"
		var bc brokerConn
		waitFor(t, 10*time.Second, "the publisher's connection in list_connections", func() bool {
			var ok bool
			bc, ok = brokerSideConnection(t, want)
			return ok
		})
		if bc.Timeout != 4 {
			t.Fatalf("broker sees heartbeat %d s for %q, want 4", bc.Timeout, want)
		}
	}
	// A redial goes through the same Dial.
	before := dials.Load()
	_ = c.Close()
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, testChannel(t), queue, nil)
	if err := r.Publisher().PublishRaw(context.Background(), "", queue, amqp.Publishing{}); err != nil {
		t.Fatal(err)
	}
	if dials.Load() == before {
		t.Fatal("redial did not use the subscriber's Dial")
	}
}

type brokerConn struct {
	Timeout int    // negotiated heartbeat, s
	Name    string // client-provided connection_name
}

// brokerSideConnection looks up the connection named name with rabbitmqctl
// list_connections.
func brokerSideConnection(t testing.TB, name string) (brokerConn, bool) {
	t.Helper()
	out, err := testkit.Ctl(t, 30*time.Second, "-q", "list_connections", "peer_port", "timeout", "client_properties", "--formatter", "json")
	if err != nil {
		t.Fatal(err)
	}
	var rows []struct {
		PeerPort         int             `json:"peer_port"`
		Timeout          int             `json:"timeout"`
		ClientProperties json.RawMessage `json:"client_properties"`
	}
	if err := json.Unmarshal([]byte(out), &rows); err != nil {
		t.Fatalf("parsing list_connections: %v\n%s", err, out)
	}
	for _, r := range rows {
		bc := brokerConn{Timeout: r.Timeout}
		// [key, type, value] triples; "none" for a connection still in its
		// handshake (another client's): skipped.
		var props []json.RawMessage
		_ = json.Unmarshal(r.ClientProperties, &props)
		for _, raw := range props {
			var triple []any
			if json.Unmarshal(raw, &triple) == nil && len(triple) == 3 && triple[0] == "connection_name" {
				bc.Name, _ = triple[2].(string)
			}
		}
		if bc.Name == name {
			return bc, true
		}
	}
	return brokerConn{}, false
}

// Item 12: New gives the retry publisher the subscriber's TLS settings, both
// watermill-amqp's Connection.TLSConfig and AmqpConfig.TLSClientConfig,
// against a TLS endpoint whose certificate only the test's CA pool trusts.
func TestNew_PublisherUsesSubscriberTLSConfig(t *testing.T) {
	uri := brokerURI(t)
	u, err := amqp.ParseURI(uri)
	if err != nil {
		t.Fatal(err)
	}
	proxy := startTLSProxy(t, net.JoinHostPort(u.Host, strconv.Itoa(u.Port)))
	tlsURI := fmt.Sprintf("amqps://%s:%s@localhost:%d/", u.Username, u.Password, proxy.port)
	queue := uniqueName(t, "rabbitretry.test")
	declareTempQueue(t, testChannel(t), queue, nil)

	// Without the subscriber's TLS settings the certificate is refused.
	if r, err := New(Config{Subscriber: wamqp.NewDurableQueueConfig(tlsURI)}); err == nil {
		_ = r.Close()
		t.Fatal("New without TLS settings connected through a TLS endpoint with an untrusted certificate")
	}

	// Both TLS settings at once: refused, as watermill-amqp refuses it.
	both := wamqp.NewDurableQueueConfig(tlsURI)
	both.Connection.TLSConfig = &tls.Config{RootCAs: proxy.roots}
	both.Connection.AmqpConfig = &amqp.Config{TLSClientConfig: &tls.Config{RootCAs: proxy.roots}}
	if r, err := New(Config{Subscriber: both}); err == nil {
		_ = r.Close()
		t.Fatal("New accepted both Connection.TLSConfig and AmqpConfig.TLSClientConfig")
	} else if !strings.Contains(err.Error(), "both TLSConfig and AmqpConfig.TLSClientConfig") {
		t.Fatalf("New with both TLS settings: %v", err)
	}

	for _, viaAmqpConfig := range []bool{false, true} {
		t.Run(fmt.Sprintf("AmqpConfig=%v", viaAmqpConfig), func(t *testing.T) {
			sub := wamqp.NewDurableQueueConfig(tlsURI)
			tc := &tls.Config{RootCAs: proxy.roots}
			if viaAmqpConfig {
				sub.Connection.AmqpConfig = &amqp.Config{TLSClientConfig: tc}
			} else {
				sub.Connection.TLSConfig = tc
			}
			before := proxy.handshakes.Load()
			r, err := New(Config{Subscriber: sub})
			if err != nil {
				t.Fatalf("New with the subscriber's TLS settings: %v", err)
			}
			defer r.Close()
			if err := r.Publisher().PublishRaw(context.Background(), "", queue, amqp.Publishing{Body: []byte("over TLS")}); err != nil {
				t.Fatal(err)
			}
			if proxy.handshakes.Load() == before {
				t.Fatal("no TLS handshake through the test endpoint")
			}
		})
	}
}

type tlsProxy struct {
	port       int
	roots      *x509.CertPool
	handshakes atomic.Int64
}

// startTLSProxy terminates TLS on 127.0.0.1 (certificate for "localhost",
// self-signed, trusted only by proxy.roots) and forwards to target.
func startTLSProxy(t *testing.T, target string) *tlsProxy {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), crand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "localhost"},
		DNSNames: []string{"localhost"}, IPAddresses: []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage:    x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}, IsCA: true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(crand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	px := &tlsProxy{roots: x509.NewCertPool()}
	px.roots.AddCert(cert)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}})
	if err != nil {
		t.Fatal(err)
	}
	px.port = ln.Addr().(*net.TCPAddr).Port
	var mu sync.Mutex
	var conns []net.Conn
	var wg sync.WaitGroup
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				if err := c.(*tls.Conn).Handshake(); err != nil {
					return
				}
				px.handshakes.Add(1)
				b, err := net.Dial("tcp", target)
				if err != nil {
					return
				}
				defer b.Close()
				mu.Lock()
				conns = append(conns, c, b)
				mu.Unlock()
				done := make(chan struct{}, 2)
				go func() { _, _ = io.Copy(b, c); done <- struct{}{} }()
				go func() { _, _ = io.Copy(c, b); done <- struct{}{} }()
				<-done
			}()
		}
	}()
	return px
}
