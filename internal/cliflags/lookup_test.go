package cliflags

import (
	"flag"
	"io"
	"testing"
)

// Lookup finds a command of the table and registers the filter flags
// (for a Filter command only) and its own flags on the tool's options.
func TestLookup(t *testing.T) {
	type opts struct {
		since string
		to    string
	}
	type cmd struct{ s Sub[*opts] }
	table := map[string]*cmd{
		"list": {Sub[*opts]{Summary: "list", Filter: true}},
		"move": {Sub[*opts]{Summary: "move", Args: "<id>", NArgs: 1, Flags: func(fs *flag.FlagSet, o *opts) { fs.StringVar(&o.to, "to", "", "") }}},
	}
	o := &opts{}
	lookup := Lookup(table, func(c *cmd) Sub[*opts] { return c.s }, o, func(fs *flag.FlagSet) { fs.StringVar(&o.since, "since", "", "") })
	if _, ok := lookup("purge"); ok {
		t.Fatal("purge found")
	}
	for _, tc := range []struct {
		name, flag string
		nargs      int
		filter     bool
	}{{"list", "since", 0, true}, {"move", "to", 1, false}} {
		c, ok := lookup(tc.name)
		if !ok || c.Summary != tc.name || c.NArgs != tc.nargs {
			t.Fatalf("%s: %+v, %v", tc.name, c, ok)
		}
		fs := flag.NewFlagSet(tc.name, flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		c.Flags(fs)
		if err := fs.Parse([]string{"-" + tc.flag, "x"}); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if (fs.Lookup("since") != nil) != tc.filter {
			t.Fatalf("%s: filter flags registered %v, want %v", tc.name, fs.Lookup("since") != nil, tc.filter)
		}
	}
	if o.since != "x" || o.to != "x" {
		t.Fatalf("options %+v, want both x", *o)
	}
}
