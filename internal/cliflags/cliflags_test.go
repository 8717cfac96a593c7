package cliflags

import (
	"flag"
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
