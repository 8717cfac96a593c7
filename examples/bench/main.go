// Command bench measures the retry library against a RabbitMQ broker, in one
// process, scenario by scenario, each on its own queues and exchanges (all
// named "bench.<run-id>.…" and deleted afterwards):
//
//	overhead     bare watermill-amqp router vs the same router with
//	             retry.Middleware, no failures, prefetch 256 and 1
//	storm        2,000-message backlog, 10% fail once: this library in its
//	             three modes (publish path on classic queues, quorum +
//	             DeadLetterFirstRetry, quorum + NativeDelayedRetry) vs
//	             Watermill's Retry + PoisonQueue middlewares
//	retry        rate of scheduled retries of each library mode vs a raw
//	             amqp091 republish-with-confirm loop (one confirm at a time,
//	             and pipelined, on classic and on quorum queues)
//	delay        observed minus intended delay for tiers 200ms, 1s, 3s, a
//	             head-of-line check, and the native delayed retry (1s)
//	memory       consumer RSS and goroutines with 0 vs 100,000 messages
//	             waiting in a wait queue; broker memory for them, and for
//	             100,000 held in a quorum queue's native delayed state
//	concurrency  retry chain throughput with 1, 2, 4, 8 handlers
//	tracing      (not in the default list: ~1 min) the retry chain with and
//	             without middleware.Tracing on the no-op TracerProvider
//	compare      (not in the default list; needs -baseline) the healthy path
//	             (overhead scenario, retry chain, prefetch 256 and 1) of this
//	             build vs a baseline build, interleaved in one run
//	cascade      (not in the default list: ~12 min) amqpretry's tiered
//	             wait queues vs the delay cascade (amqpretry/cascade):
//	             delay accuracy for RetryAfter 1 s .. 10 min, hops and
//	             publishes per delayed message, scheduling throughput, and
//	             broker/client memory with 100,000 messages waiting
//
// The native delayed retry (amqpretry.NativeDelayed mode) needs
// RabbitMQ 4.3+; on an older broker its rows say "n/a (needs RabbitMQ
// 4.3+)" and the rest runs as usual.
//
// Broker figures (queue and node memory) come from rabbitmqctl: the command
// in $RABBITRETRY_CTL, split on spaces, with rabbitmqctl's arguments appended
// (e.g. "scripts/brokers.sh ctl dev2 --"; `scripts/brokers.sh env dev2` sets
// it), else plain rabbitmqctl (the machine's own broker). The management API
// is reached at $RABBITRETRY_MGMT_URL, else on the AMQP port + 10000.
//
// Usage:
//
//	go run ./examples/bench                          # all, table + JSON on stdout
//	go run ./examples/bench -scenarios overhead -cpuprofile cpu.out
//	go run ./examples/bench -json out.json -md examples/bench/RESULTS.md
//	go run ./examples/bench -n overhead=5000,memory=10000
//	eval "$(scripts/brokers.sh env dev2)"; go run ./examples/bench -uri "$AMQP_URI" -scenarios storm
//
// Progress goes to stderr; the table (Markdown) and the JSON go to stdout.
package main

import (
	"context"
	"encoding/json"

	"flag"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

var allScenarios = []string{"overhead", "storm", "retry", "delay", "memory", "concurrency"}

// extraScenarios run only when named in -scenarios (they take long).
var extraScenarios = []string{"cascade", "audit", "tracing", "compare"}

// defaultSizes are the message counts of each scenario (-n overrides).
var defaultSizes = map[string]int{
	"overhead": 20000, "storm": 2000, "retry": 5000, "delay": 200, "memory": 100000, "concurrency": 20000,
	"cascade": 20, "cascade-sched": 20000, "cascade-mem": 100000, "audit": 10000, "tracing": 20000,
}

type row struct {
	Scenario string `json:"scenario"`
	Metric   string `json:"metric"`
	Value    string `json:"value"`
	Goal     string `json:"goal,omitempty"`
	Result   string `json:"result,omitempty"`
}

type machine struct {
	Date          string `json:"date"`
	NumCPU        int    `json:"nproc"`
	GOMAXPROCS    int    `json:"gomaxprocs"`
	GoVersion     string `json:"go"`
	Memory        string `json:"free_h,omitempty"`
	RabbitMQ      string `json:"rabbitmqctl_version,omitempty"`
	Ctl           string `json:"rabbitmqctl_command,omitempty"` // $RABBITRETRY_CTL or rabbitmqctl
	ServerVersion string `json:"server_version,omitempty"`
}

type summary struct {
	Machine     machine            `json:"machine"`
	Scenarios   []string           `json:"scenarios"`
	DurationS   float64            `json:"duration_s"`
	Errors      map[string]string  `json:"errors,omitempty"`
	Overhead    *overheadResult    `json:"overhead,omitempty"`
	Storm       *stormResult       `json:"failure_storm,omitempty"`
	RetryPath   *retryPathResult   `json:"retry_path,omitempty"`
	Delay       *delayResult       `json:"delay_accuracy,omitempty"`
	Memory      *memoryResult      `json:"memory,omitempty"`
	Concurrency *concurrencyResult `json:"concurrency,omitempty"`
	Cascade     *cascadeResult     `json:"tiers_vs_cascade,omitempty"`
	Audit       *auditResult       `json:"audit,omitempty"`
	Tracing     *tracingResult     `json:"tracing,omitempty"`
	Compare     *compareResult     `json:"compare,omitempty"`
	Table       []row              `json:"table"`
}

type bench struct {
	baseline      string
	compareRounds int
	uri           string
	env           *env
	sizes         map[string]int
	runs          int
	runsP1        int
	stormHandlers int
	stormRuns     int
	stormVariants []string
	retryHandlers []int
	cascade       cascadeOpts
	summary       summary
}

func (b *bench) size(scenario string, def int) int {
	if n, ok := b.sizes[scenario]; ok {
		return n
	}
	return def
}

func (b *bench) row(scenario, metric, value, goal, result string) {
	b.summary.Table = append(b.summary.Table, row{scenario, metric, value, goal, result})
}

func passMiss(ok bool) string {
	if ok {
		return "PASS"
	}
	return "MISS"
}

func fmtRate(r float64) string { return fmt.Sprintf("%.0f msg/s", r) }

func main() {
	uri := flag.String("uri", envOr("AMQP_URI", "amqp://guest:guest@127.0.0.1:5672/"), "AMQP URI of the broker")
	scenarios := flag.String("scenarios", strings.Join(allScenarios, ","), "comma list of scenarios: "+strings.Join(allScenarios, ",")+" (the default), and "+strings.Join(extraScenarios, ",")+" (long: only when named; cascade takes ~12 min)")
	jsonOut := flag.String("json", "-", "write the JSON summary to this file; - prints it to stdout after the table; empty: none")
	mdOut := flag.String("md", "", "also write a Markdown report (machine info + table) to this file, e.g. examples/bench/RESULTS.md")
	sizes := flag.String("n", "", "message counts, comma list of scenario=N (defaults: overhead=20000,storm=2000,retry=5000,delay=200 per tier and for the native retry,memory=100000 in the wait queue and in the native delayed state,concurrency=20000; cascade=20 messages per delay band per variant, cascade-sched=20000 schedules timed per variant, cascade-mem=100000 waiting per variant)")
	runs := flag.Int("runs", 7, "overhead at prefetch 256: runs per variant (alternating bare/retry); the median is reported")
	runsP1 := flag.Int("runs-p1", 3, "overhead at prefetch 1 (watermill-amqp's default): runs per variant")
	stormHandlers := flag.Int("storm-handlers", 1, "failure storm: handlers (subscriptions) per variant, the same for all")
	stormRuns := flag.Int("storm-runs", 5, "failure storm: runs of each rabbitretry variant with and without failures (interleaved); medians are reported. Watermill Retry runs once (its failure run takes minutes)")
	stormVariants := flag.String("storm-variants", strings.Join(stormVariantNames, ","), "failure storm: comma list of variants to run (rows of the others are left out)")
	retryHandlers := flag.String("retry-handlers", "1,4", "retry path: handler counts to measure (library and raw one-at-a-time get the same count)")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file")
	cascadeMaxDelay := flag.Duration("cascade-max-delay", 10*time.Minute, "cascade scenario: longest delay band of the accuracy part (bands 1s,1.7s,3s,7s,13s,37s,61s,100s,4m,10m up to it)")
	cascadePartsFlag := flag.String("cascade-parts", strings.Join(cascadeParts, ","), "cascade scenario: comma list of parts to run: "+strings.Join(cascadeParts, ","))
	cascadeWorkers := flag.Int("cascade-workers", 64, "cascade scenario: goroutines scheduling concurrently in the throughput and memory parts")
	fillChildSpec := flag.String("fill-child", "", "internal: run as the memory scenario's publishing child process")
	baseline := flag.String("baseline", "", "compare scenario: the bench binary built from the baseline commit (see scripts/bench-compare.sh)")
	compareRounds := flag.Int("compare-rounds", 7, "compare scenario: rounds; each runs this binary's and the baseline's overhead scenario once, order flipping")
	flag.Parse()

	if *fillChildSpec != "" {
		if err := fillChild(*uri, *fillChildSpec); err != nil {
			fmt.Fprintln(os.Stderr, "fill child:", err)
			os.Exit(1)
		}
		return
	}

	b := &bench{baseline: *baseline, compareRounds: max(*compareRounds, 1), uri: *uri, sizes: map[string]int{}, runs: max(*runs, 1), runsP1: max(*runsP1, 1), stormHandlers: max(*stormHandlers, 1), stormRuns: max(*stormRuns, 1)}
	for _, v := range strings.Split(*stormVariants, ",") {
		v = strings.TrimSpace(v)
		if !slices.Contains(stormVariantNames, v) {
			fatal(fmt.Errorf("unknown storm variant %q (have %s)", v, strings.Join(stormVariantNames, ",")))
		}
		b.stormVariants = append(b.stormVariants, v)
	}
	b.cascade = cascadeOpts{maxDelay: *cascadeMaxDelay, workers: max(*cascadeWorkers, 1)}
	for _, p := range strings.Split(*cascadePartsFlag, ",") {
		p = strings.TrimSpace(p)
		if !slices.Contains(cascadeParts, p) {
			fatal(fmt.Errorf("unknown -cascade-parts entry %q (have %s)", p, strings.Join(cascadeParts, ",")))
		}
		b.cascade.parts = append(b.cascade.parts, p)
	}
	if err := parseSizes(*sizes, b.sizes); err != nil {
		fatal(err)
	}
	for _, s := range strings.Split(*retryHandlers, ",") {
		h, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || h < 1 {
			fatal(fmt.Errorf("bad -retry-handlers %q", *retryHandlers))
		}
		b.retryHandlers = append(b.retryHandlers, h)
	}
	var selected []string
	for _, s := range strings.Split(*scenarios, ",") {
		s = strings.TrimSpace(s)
		if s == "" {
			continue
		}
		if !slices.Contains(allScenarios, s) && !slices.Contains(extraScenarios, s) {
			fatal(fmt.Errorf("unknown scenario %q (have %s)", s, strings.Join(append(slices.Clone(allScenarios), extraScenarios...), ",")))
		}
		selected = append(selected, s)
	}

	e, err := newEnv(*uri)
	if err != nil {
		fatal(err)
	}
	defer e.close()
	b.env = e
	b.summary.Machine = machineInfo(e)
	b.summary.Scenarios = selected

	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			fatal(err)
		}
		defer func() {
			pprof.StopCPUProfile()
			_ = f.Close()
		}()
	}

	run := map[string]func() error{
		"overhead": b.scenarioOverhead, "storm": b.scenarioStorm, "retry": b.scenarioRetryPath,
		"delay": b.scenarioDelay, "memory": b.scenarioMemory, "concurrency": b.scenarioConcurrency,
		"cascade": b.scenarioCascade,
		"audit":   b.scenarioAudit,
		"tracing": b.scenarioTracing,
		"compare": b.scenarioCompare,
	}
	start := time.Now()
	logf("bench run %s against %s (queues and exchanges %s.*)", e.prefix, redact(*uri), e.prefix)
	failed := false
	for _, s := range selected {
		logf("== %s", s)
		t0 := time.Now()
		if err := run[s](); err != nil {
			failed = true
			if b.summary.Errors == nil {
				b.summary.Errors = map[string]string{}
			}
			b.summary.Errors[s] = err.Error()
			logf("%s FAILED: %v", s, err)
			b.row(s, "ERROR", err.Error(), "", "ERROR")
			if cerr := e.cleanup(); cerr != nil {
				logf("cleanup after %s: %v", s, cerr)
			}
		}
		logf("%s took %.1fs", s, time.Since(t0).Seconds())
	}
	b.summary.DurationS = time.Since(start).Seconds()
	if n := e.logger.errors.Load(); n > 0 {
		logf("watermill logged %d errors (see above)", n)
	}
	if n := e.logger.retries.Load(); n > 0 {
		logf("watermill logged %d handler errors that are retries by nack (DeadLetterFirstRetry, NativeDelayedRetry; not printed)", n)
	}

	table := markdownTable(b.summary.Table)
	fmt.Println(table)
	fmt.Printf("total %.0f s\n", b.summary.DurationS)
	js, _ := json.MarshalIndent(b.summary, "", "  ")
	switch *jsonOut {
	case "":
	case "-":
		fmt.Println()
		fmt.Println(string(js))
	default:
		if err := os.WriteFile(*jsonOut, append(js, '\n'), 0o644); err != nil {
			logf("writing %s: %v", *jsonOut, err)
			failed = true
		}
	}
	if *mdOut != "" {
		if err := os.WriteFile(*mdOut, []byte(markdownReport(b.summary, table)), 0o644); err != nil {
			logf("writing %s: %v", *mdOut, err)
			failed = true
		}
	}
	if failed {
		pprof.StopCPUProfile()
		os.Exit(1)
	}
}

func parseSizes(spec string, into map[string]int) error {
	for _, kv := range strings.Split(spec, ",") {
		kv = strings.TrimSpace(kv)
		if kv == "" {
			continue
		}
		k, v, ok := strings.Cut(kv, "=")
		n, err := strconv.Atoi(v)
		if _, known := defaultSizes[k]; !ok || !known || err != nil || n < 2 {
			return fmt.Errorf("bad -n entry %q (want scenario=N, N >= 2, scenario one of %s)", kv, strings.Join(allScenarios, ","))
		}
		into[k] = n
	}
	return nil
}

func markdownTable(rows []row) string {
	var sb strings.Builder
	sb.WriteString("| Scenario | Metric | Value | Goal | Result |\n|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&sb, "| %s | %s | %s | %s | %s |\n", r.Scenario, r.Metric, r.Value, r.Goal, r.Result)
	}
	return sb.String()
}

func markdownReport(s summary, table string) string {
	var sb strings.Builder
	m := s.Machine
	sb.WriteString("# Benchmark results\n\n")
	fmt.Fprintf(&sb, "Produced by `go run ./examples/bench` on %s (total %.0f s).\n\n", m.Date, s.DurationS)
	if len(os.Args) > 1 {
		args := slices.Clone(os.Args[1:])
		for i, a := range args {
			if strings.Contains(a, "://") {
				args[i] = redactArg(a)
			}
		}
		fmt.Fprintf(&sb, "Command: `go run ./examples/bench %s`\n\n", strings.Join(args, " "))
	}
	fmt.Fprintf(&sb, "- CPUs (`nproc`): %d, GOMAXPROCS %d, %s\n", m.NumCPU, m.GOMAXPROCS, m.GoVersion)
	fmt.Fprintf(&sb, "- RabbitMQ: server reports %s (`%s version`: %s), same host\n", m.ServerVersion, m.Ctl, m.RabbitMQ)
	if m.Memory != "" {
		fmt.Fprintf(&sb, "- Memory (`free -h`):\n\n```\n%s\n```\n", strings.TrimRight(m.Memory, "\n"))
	}
	sb.WriteString("\n")
	sb.WriteString(table)
	if slices.ContainsFunc(s.Scenarios, func(x string) bool { return slices.Contains(allScenarios, x) }) {
		sb.WriteString(methodNotes) // notes of the default scenarios only
	}
	if slices.Contains(s.Scenarios, "cascade") {
		sb.WriteString(cascadeGlance(s.Cascade))
		sb.WriteString(cascadeNotes)
	}
	return sb.String()
}

func machineInfo(e *env) machine {
	m := machine{Date: time.Now().UTC().Format(time.RFC3339), NumCPU: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0), GoVersion: runtime.Version()}
	if out, err := command("nproc"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(out)); err == nil {
			m.NumCPU = n
		}
	}
	m.Memory, _ = command("free", "-h")
	m.Ctl = strings.Join(ctlPrefix(), " ")
	if out, err := ctl("version"); err == nil {
		lines := strings.Split(strings.TrimSpace(out), "\n")
		m.RabbitMQ = strings.TrimSpace(lines[len(lines)-1])
	}
	if v, ok := e.admin.Properties["version"].(string); ok {
		m.ServerVersion = v
	}
	return m
}

func command(name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).Output()
	return string(out), err
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// redactArg redacts a command-line argument holding a URI (amqp:// or a
// PostgreSQL DSN): the password never reaches a report.
func redactArg(a string) string {
	if strings.HasPrefix(a, "amqp") {
		return redact(a)
	}
	return redactDSN(a)
}

func redact(uri string) string {
	u, err := amqp.ParseURI(uri)
	if err != nil {
		return "(unparsable URI)"
	}
	u.Password = "***"
	return u.String()
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "bench:", err)
	os.Exit(2)
}
