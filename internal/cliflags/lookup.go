package cliflags

import "flag"

// Sub is a subcommand as a tool's command table declares it; O is the
// tool's options, which its flags set.
type Sub[O any] struct {
	Summary string                      // one sentence, for its usage
	Args    string                      // its positional arguments, for its usage
	NArgs   int                         // exactly how many positional arguments it takes
	Filter  bool                        // takes the tool's filter flags
	Flags   func(fs *flag.FlagSet, o O) // its own flags; may be nil
}

// Lookup returns a Tool.Lookup over a tool's command table: the command
// called name (sub gives its Sub), whose flag set gets the filter flags
// (filter, for a Sub with Filter) and then its own Flags, set on o.
func Lookup[C, O any](table map[string]C, sub func(C) Sub[O], o O, filter func(fs *flag.FlagSet)) func(name string) (Command, bool) {
	return func(name string) (Command, bool) {
		c, found := table[name]
		if !found {
			return Command{}, false
		}
		s := sub(c)
		return Command{Summary: s.Summary, Args: s.Args, NArgs: s.NArgs, Flags: func(fs *flag.FlagSet) {
			if s.Filter {
				filter(fs)
			}
			if s.Flags != nil {
				s.Flags(fs, o)
			}
		}}, true
	}
}
