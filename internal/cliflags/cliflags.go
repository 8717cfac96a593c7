// Package cliflags holds flag helpers shared by the project's commands
// (poisonctl, auditctl, rabbitretry-topology).
package cliflags

import "flag"

// ParseInterleaved parses fs allowing flags after positional arguments
// ("show <uuid> --json" as well as "--json show <uuid>"); "--" ends flag
// parsing. It returns the positional arguments in order, or the error of
// fs.Parse.
func ParseInterleaved(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		consumed := len(args) - fs.NArg()
		if consumed > 0 && args[consumed-1] == "--" {
			return append(pos, fs.Args()...), nil
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}
