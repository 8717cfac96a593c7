package cliflags

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
)

// Exit statuses shared by the project's commands.
const (
	ExitOK    = 0 // success (also -h)
	ExitUsage = 2 // bad command line: the error and a hint were printed
)

// Command is one subcommand as Tool.Parse needs it.
type Command struct {
	Summary string                 // one sentence, for its usage
	Args    string                 // its positional arguments, for its usage, e.g. "<uuid>"
	NArgs   int                    // exactly how many positional arguments it takes
	Flags   func(fs *flag.FlagSet) // registers its flags besides the global ones; may be nil
}

// Tool is a command with subcommands: "tool [global flags] <command>
// [flags] [args]", global flags accepted before and after the command.
type Tool struct {
	Name       string                            // e.g. "poisonctl"
	Order      []string                          // the command names, for messages
	Lookup     func(name string) (Command, bool) // the command called name
	Global     func(fs *flag.FlagSet)            // registers the global flags
	PrintUsage func(w io.Writer)                 // the tool's usage text (before the global flags)
}

// Parse parses args and returns the command's name and positional
// arguments with ok true; the flags are set through the functions
// registered by Global and the command's Flags. With ok false the caller
// exits with code: ExitOK after -h or "help" (usage printed), ExitUsage
// after a bad command line (the error printed to stderr).
func (t Tool) Parse(args []string, stderr io.Writer) (name string, pos []string, code int, ok bool) {
	global := flag.NewFlagSet(t.Name, flag.ContinueOnError)
	global.SetOutput(stderr)
	global.Usage = func() {
		t.PrintUsage(stderr)
		fmt.Fprintln(stderr, "\nGlobal flags:")
		global.PrintDefaults()
	}
	t.Global(global)
	if err := global.Parse(args); err != nil {
		return "", nil, parseExit(err), false
	}
	rest := global.Args()
	if len(rest) == 0 {
		return "", nil, t.UsageError(stderr, "missing command (one of %s)", strings.Join(t.Order, ", ")), false
	}
	name = rest[0]
	if name == "help" {
		global.Usage()
		return name, nil, ExitOK, false
	}
	cmd, found := t.Lookup(name)
	if !found {
		return name, nil, t.UsageError(stderr, "unknown command %q (want one of %s)", name, strings.Join(t.Order, ", ")), false
	}
	fs := flag.NewFlagSet(t.Name+" "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	t.Global(fs)
	if cmd.Flags != nil {
		cmd.Flags(fs)
	}
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: %s %s [flags] %s\n\n%s.\n\nFlags:\n", t.Name, name, cmd.Args, cmd.Summary)
		fs.PrintDefaults()
	}
	pos, err := ParseInterleaved(fs, rest[1:])
	if err != nil {
		return name, nil, parseExit(err), false // the flag package printed the error and usage
	}
	if len(pos) != cmd.NArgs {
		if cmd.NArgs == 0 {
			return name, nil, t.UsageError(stderr, "%s: unexpected argument %q", name, pos[0]), false
		}
		return name, nil, t.UsageError(stderr, "%s: want %d argument(s) %s, got %d", name, cmd.NArgs, cmd.Args, len(pos)), false
	}
	return name, pos, ExitOK, true
}

// UsageError prints "tool: <message>" and a hint to stderr and returns
// ExitUsage.
func (t Tool) UsageError(stderr io.Writer, format string, args ...any) int {
	fmt.Fprintf(stderr, t.Name+": "+format+"\n", args...)
	fmt.Fprintf(stderr, "Run %q for usage.\n", t.Name+" -h")
	return ExitUsage
}

func parseExit(err error) int {
	if errors.Is(err, flag.ErrHelp) {
		return ExitOK
	}
	return ExitUsage
}
