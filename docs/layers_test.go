package docs_test

import (
	"os/exec"
	"path"
	"slices"
	"strings"
	"testing"
)

const module = "github.com/rabbitretry/rabbitretry"

// layers lists, per library package, the packages of this module it may
// import (its non-test files; internal/... is allowed everywhere except in
// middleware, amqpwire and router). The list is the layer order of the
// README's layout section: imports point down only. A package of the module
// missing here fails the test, so a new package has to state its layer.
var layers = map[string][]string{
	// The broker-agnostic base: middlewares, the Delayer seam, the one
	// metadata vocabulary. Nothing of ours, no AMQP client.
	"middleware": {"internal/retrymeta", "internal/chainerr"},
	// The broker's attempt counts and x-death, on top of the vocabulary; the
	// wire codecs themselves are in internal/wire.
	"amqpwire": {"middleware", "internal/retrymeta", "internal/wire"},
	// The confirm publisher: the wire at most.
	"confirm": {"amqpwire"},
	// The chain: the middlewares, in their one order.
	"router": {"middleware", "internal/retrymeta", "internal/chainerr"},
	// RabbitMQ retry: the chain over AMQP. Never the audit, poison
	// operations or metrics.
	"amqpretry":         {"middleware", "amqpwire", "confirm", "router"},
	"amqpretry/cascade": {"middleware", "amqpwire", "confirm", "router", "amqpretry"},
	"poison/admin":      {"middleware", "amqpwire", "confirm"},
	"audit":             {"middleware", "amqpwire", "confirm", "audit/internal/deliverylog"},
	"audit/pgstore":     {"amqpwire", "audit", "audit/internal/deliverylog"},
	"audit/httpapi":     {"audit"},
	"audit/audittest":   {"audit", "audit/internal/memstore", "audit/internal/deliverylog"},
	// The in-memory store behind audittest, with its test hooks.
	"audit/internal/memstore": {"audit", "audit/internal/deliverylog"},
	// The delivery-log contract between the audit Consumer and the stores
	// of this module: nothing of ours (audit imports it).
	"audit/internal/deliverylog": {},
	"metrics":                    {"middleware", "audit"},
	// The one metadata vocabulary, under everything: Watermill only.
	"internal/retrymeta": {},
	// The errors the chain's middlewares return to one another and to the
	// router's fallback: nothing of ours.
	"internal/chainerr": {},
	// AMQP 0-9-1 wire details (field tables, x-death, properties, frame
	// size, the broker's count headers): the vocabulary only.
	"internal/wire": {"internal/retrymeta"},
	// Parsing of auditctl's and the HTTP API's filter syntax, on audit's types.
	"internal/auditparse": {"audit"},
	// The delay cascade's machinery behind amqpretry/cascade (its names,
	// declares, Delayer, Publisher, census, redirect), shared with
	// rabbitretry-topology: the cascade's layer.
	"internal/cascadecore": {"middleware", "amqpwire", "confirm", "amqpretry"},
}

// noInternal: packages that may not import internal/... either, except the
// internal packages their layer lists.
var noInternal = []string{"middleware", "amqpwire", "router"}

// forbiddenExternal: import paths (prefixes) a package must not import.
var forbiddenExternal = map[string][]string{
	"middleware": {"github.com/rabbitmq/amqp091-go", "github.com/ThreeDotsLabs/watermill-amqp"},
	"router":     {"github.com/rabbitmq/amqp091-go", "github.com/ThreeDotsLabs/watermill-amqp"},
}

// TestLayers: every package of the module imports only what its layer
// allows (see layers); internal/ imports only internal/; binaries
// (cmd/), examples, the fault suite and docs are imported by nobody.
// Go itself rejects import cycles; this keeps the direction.
func TestLayers(t *testing.T) {
	cmd := exec.Command("go", "list", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, "./...")
	cmd.Dir = ".."
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		pkg := strings.TrimPrefix(strings.TrimPrefix(f[0], module), "/")
		if pkg == "" || strings.HasPrefix(path.Base(pkg), ".doccheck-") {
			continue
		}
		top := strings.SplitN(pkg, "/", 2)[0]
		leaf := top == "cmd" || top == "examples" || top == "faults" || top == "docs"
		allowed, listed := layers[pkg]
		if !listed && !leaf && top != "internal" {
			t.Errorf("package %s has no layer in docs/layers_test.go", pkg)
			continue
		}
		for _, imp := range f[1:] {
			for _, bad := range forbiddenExternal[pkg] {
				if imp == bad || strings.HasPrefix(imp, bad+"/") {
					t.Errorf("%s imports %s", pkg, imp)
				}
			}
			if !strings.HasPrefix(imp, module+"/") {
				continue
			}
			dep := strings.TrimPrefix(imp, module+"/")
			depTop := strings.SplitN(dep, "/", 2)[0]
			switch {
			case depTop == "cmd" || depTop == "examples" || depTop == "faults" || depTop == "docs":
				t.Errorf("%s imports %s: binaries, examples, the fault suite and docs are leaves", pkg, dep)
			case top == "internal" && !listed:
				if depTop != "internal" {
					t.Errorf("%s imports %s: internal packages import only internal packages (or list the package in layers)", pkg, dep)
				}
			case leaf:
				// Binaries, examples and tests may use any library package.
			case depTop == "internal":
				if slices.Contains(noInternal, pkg) && !slices.Contains(allowed, dep) {
					t.Errorf("%s imports %s: it imports nothing of this module", pkg, dep)
				}
			case !slices.Contains(allowed, dep):
				t.Errorf("%s imports %s: its layer allows %v", pkg, dep, allowed)
			}
		}
	}
}
