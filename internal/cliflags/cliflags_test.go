package cliflags

import (
	"flag"
	"io"
	"strings"
	"testing"
)

func TestParseInterleaved(t *testing.T) {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	j := fs.Bool("json", false, "")
	pos, err := ParseInterleaved(fs, []string{"a", "--json", "b", "--", "--c"})
	if err != nil || !*j || strings.Join(pos, " ") != "a b --c" {
		t.Fatalf("pos %q json %v err %v", pos, *j, err)
	}
}

func TestToolParse(t *testing.T) {
	var verbose, force bool
	tool := Tool{
		Name: "demo", Order: []string{"show"},
		Global:     func(fs *flag.FlagSet) { fs.BoolVar(&verbose, "v", verbose, "") },
		PrintUsage: func(w io.Writer) { io.WriteString(w, "usage\n") },
		Lookup: func(name string) (Command, bool) {
			if name != "show" {
				return Command{}, false
			}
			return Command{Args: "<id>", NArgs: 1, Flags: func(fs *flag.FlagSet) { fs.BoolVar(&force, "force", false, "") }}, true
		},
	}
	var errOut strings.Builder
	name, pos, _, ok := tool.Parse([]string{"-v", "show", "x", "--force"}, &errOut)
	if !ok || name != "show" || strings.Join(pos, ",") != "x" || !verbose || !force {
		t.Fatalf("name %q pos %q ok %v verbose %v force %v; stderr %s", name, pos, ok, verbose, force, errOut.String())
	}
	for _, c := range []struct {
		args []string
		code int
		err  string
	}{
		{nil, ExitUsage, "missing command"},
		{[]string{"nope"}, ExitUsage, `unknown command "nope"`},
		{[]string{"show"}, ExitUsage, "want 1 argument(s) <id>, got 0"},
		{[]string{"show", "a", "b"}, ExitUsage, "got 2"},
		{[]string{"show", "--bogus", "a"}, ExitUsage, "flag provided but not defined"},
		{[]string{"help"}, ExitOK, "usage"},
		{[]string{"show", "-h"}, ExitOK, "Usage: demo show"},
	} {
		errOut.Reset()
		if _, _, code, ok := tool.Parse(c.args, &errOut); ok || code != c.code || !strings.Contains(errOut.String(), c.err) {
			t.Errorf("%q: ok %v code %d, stderr %q; want code %d and %q", c.args, ok, code, errOut.String(), c.code, c.err)
		}
	}
}
