package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
)

type compareSide struct {
	Retry256, Bare256, Retry1 []float64 // msg/s per round
	CPU256, CPU1              []float64 // retry chain client CPU, us/msg
}

type compareResult struct {
	Baseline string      `json:"baseline"`
	Rounds   int         `json:"rounds"`
	Head     compareSide `json:"head"`
	Base     compareSide `json:"baseline_runs"`
}

// scenarioCompare runs the overhead scenario once per round with this binary
// and with -baseline (another build of this bench, e.g. of main before a
// change), as child processes, the order flipping every round, and compares
// the retry chain's drain rates: the healthy path side by side in one run.
func (b *bench) scenarioCompare() error {
	if b.baseline == "" {
		return errors.New("compare: -baseline BINARY is required (scripts/bench-compare.sh builds it)")
	}
	self, err := os.Executable()
	if err != nil {
		return err
	}
	res := &compareResult{Baseline: b.baseline, Rounds: b.compareRounds}
	b.summary.Compare = res
	n := b.size("overhead", 20000)
	dir, err := os.MkdirTemp("", "bench-compare")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	for r := range b.compareRounds {
		order := []string{self, b.baseline}
		if r%2 == 1 {
			order = []string{b.baseline, self}
		}
		for _, bin := range order {
			out := filepath.Join(dir, fmt.Sprintf("r%d-%d.json", r, len(res.Head.Retry256)+len(res.Base.Retry256)))
			cmd := exec.Command(bin, "-uri", b.uri, "-scenarios", "overhead", "-runs", "1", "-runs-p1", "1",
				"-n", fmt.Sprintf("overhead=%d", n), "-json", out)
			cmd.Stderr = nil
			if err := cmd.Run(); err != nil {
				return fmt.Errorf("compare: %s: %w", filepath.Base(bin), err)
			}
			raw, err := os.ReadFile(out)
			if err != nil {
				return err
			}
			var s summary
			if err := json.Unmarshal(raw, &s); err != nil || s.Overhead == nil || len(s.Overhead.Results) < 2 {
				return fmt.Errorf("compare: %s wrote no overhead result (%v)", filepath.Base(bin), err)
			}
			side := &res.Head
			name := "head"
			if bin == b.baseline {
				side, name = &res.Base, "baseline"
			}
			for _, op := range s.Overhead.Results {
				switch op.Prefetch {
				case 256:
					side.Retry256 = append(side.Retry256, op.RetryRuns...)
					side.Bare256 = append(side.Bare256, op.BareRuns...)
					side.CPU256 = append(side.CPU256, op.RetryCPU...)
				case 1:
					side.Retry1 = append(side.Retry1, op.RetryRuns...)
					side.CPU1 = append(side.CPU1, op.RetryCPU...)
				}
			}
			logf("compare round %d %s: retry %.0f msg/s (bare %.0f) at prefetch 256, retry %.0f at prefetch 1",
				r+1, name, side.Retry256[len(side.Retry256)-1], side.Bare256[len(side.Bare256)-1], side.Retry1[len(side.Retry1)-1])
		}
	}
	h, bs := res.Head, res.Base
	ratio := func(a, b []float64) float64 { return median(a) / median(b) }
	b.row("8 compare", fmt.Sprintf("retry chain, prefetch 256: this build vs baseline (medians of %d; runs %s vs %s)", b.compareRounds, fmtRates(h.Retry256), fmtRates(bs.Retry256)),
		fmt.Sprintf("%.0f vs %.0f msg/s", median(h.Retry256), median(bs.Retry256)), "", "")
	b.row("8 compare", "ratio this/baseline, prefetch 256 (retry chain / same-round bare ratio normalises load)",
		fmt.Sprintf("%.3f (normalised %.3f)", ratio(h.Retry256, bs.Retry256), (median(h.Retry256)/median(h.Bare256))/(median(bs.Retry256)/median(bs.Bare256))), ">= 0.95", passMiss(ratio(h.Retry256, bs.Retry256) >= 0.95))
	b.row("8 compare", fmt.Sprintf("retry chain, prefetch 1: this build vs baseline (runs %s vs %s)", fmtRates(h.Retry1), fmtRates(bs.Retry1)),
		fmt.Sprintf("%.0f vs %.0f msg/s (ratio %.3f)", median(h.Retry1), median(bs.Retry1), ratio(h.Retry1, bs.Retry1)), ">= 0.95", passMiss(ratio(h.Retry1, bs.Retry1) >= 0.95))
	b.row("8 compare", "client CPU per msg, retry chain, prefetch 256: this / baseline (info)",
		fmt.Sprintf("%.1f / %.1f us", median(h.CPU256), median(bs.CPU256)), "", "")
	if len(h.CPU1) > 0 && len(bs.CPU1) > 0 {
		b.row("8 compare", "client CPU per msg, retry chain, prefetch 1: this / baseline (info)",
			fmt.Sprintf("%.1f / %.1f us", median(h.CPU1), median(bs.CPU1)), "", "")
	}
	return nil
}
