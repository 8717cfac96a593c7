package docs_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
)

// pages returns README.md and docs/*.md, relative to the module root.
func pages(t *testing.T) []string {
	t.Helper()
	ps, err := filepath.Glob("*.md")
	if err != nil {
		t.Fatal(err)
	}
	return append([]string{"../README.md"}, ps...)
}

var goBlock = regexp.MustCompile("(?s)```go\n(.*?)```")

// snippets returns the Go code blocks of page.
func snippets(t *testing.T, page string) []string {
	t.Helper()
	b, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range goBlock.FindAllStringSubmatch(string(b), -1) {
		out = append(out, m[1])
	}
	return out
}

// TestCompleteSnippetsCompile builds every snippet that is a whole program.
func TestCompleteSnippetsCompile(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("no go command")
	}
	n := 0
	for _, page := range pages(t) {
		for i, s := range snippets(t, page) {
			if !strings.HasPrefix(s, "package main") {
				continue
			}
			n++
			dir, err := os.MkdirTemp("..", ".doccheck-")
			if err != nil {
				t.Fatal(err)
			}
			defer os.RemoveAll(dir)
			if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(s), 0o644); err != nil {
				t.Fatal(err)
			}
			cmd := exec.Command("go", "vet", "./"+filepath.Base(dir)) // from the module root
			cmd.Dir = ".."
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Errorf("%s snippet %d does not compile:\n%s", page, i+1, out)
			}
		}
	}
	if n == 0 {
		t.Error("no complete program among the snippets (the README's quick start is one)")
	}
}

// exported returns the exported names declared in the package directory
// dir (top-level names and methods), without tests.
func exported(t *testing.T, dir string) map[string]bool {
	t.Helper()
	fset := token.NewFileSet()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil {
					names[d.Name.Name] = true
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						names[s.Name.Name] = true
					case *ast.ValueSpec:
						for _, n := range s.Names {
							names[n.Name] = true
						}
					}
				}
			}
		}
	}
	return names
}

// TestSnippetIdentifiersExist: every pkg.Name a snippet uses, for this
// module's packages, names something the package declares.
func TestSnippetIdentifiersExist(t *testing.T) {
	dirs := map[string]string{
		"amqpretry": "../amqpretry", "cascade": "../amqpretry/cascade", "middleware": "../middleware",
		"router": "../router", "metrics": "../metrics", "poison": "../poison", "admin": "../poison/admin",
		"audit": "../audit", "pgstore": "../audit/pgstore", "httpapi": "../audit/httpapi",
	}
	decl := map[string]map[string]bool{}
	for pkg, dir := range dirs {
		decl[pkg] = exported(t, dir)
	}
	ref := regexp.MustCompile(`\b(amqpretry|cascade|middleware|router|metrics|poison|admin|audit|pgstore|httpapi)\.([A-Z]\w*)`)
	checked := 0
	for _, page := range pages(t) {
		for i, s := range snippets(t, page) {
			for _, m := range ref.FindAllStringSubmatch(s, -1) {
				checked++
				if !decl[m[1]][m[2]] {
					t.Errorf("%s snippet %d: %s.%s does not exist", page, i+1, m[1], m[2])
				}
			}
		}
	}
	if checked == 0 {
		t.Error("no identifier checked")
	}
}

// TestLinksExist: every relative link of every page points to a file.
func TestLinksExist(t *testing.T) {
	link := regexp.MustCompile(`\]\(([^)#\s]+)(#[^)]*)?\)`)
	for _, page := range pages(t) {
		b, err := os.ReadFile(page)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range link.FindAllStringSubmatch(string(b), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			p := filepath.Join(filepath.Dir(page), target)
			if _, err := os.Stat(p); err != nil {
				t.Errorf("%s links to %s, which does not exist", page, target)
			}
		}
	}
}

// TestReadmeLayoutMatchesGoList: the README's layout table has one row per
// package of `go list ./...`, and no other.
func TestReadmeLayoutMatchesGoList(t *testing.T) {
	cmd := exec.Command("go", "list", "./...")
	cmd.Dir = ".."
	out, err := cmd.Output()
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for _, l := range strings.Fields(string(out)) {
		rel := strings.TrimPrefix(strings.TrimPrefix(l, "github.com/rabbitretry/rabbitretry"), "/")
		if rel == "" || strings.HasPrefix(filepath.Base(rel), ".doccheck-") {
			continue
		}
		want = append(want, rel)
	}
	b, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, layout, ok := strings.Cut(string(b), "\n## Layout\n")
	if !ok {
		t.Fatal("README has no ## Layout section")
	}
	if i := strings.Index(layout, "\n## "); i >= 0 {
		layout = layout[:i]
	}
	row := regexp.MustCompile("(?m)^\\| `([^`]+)/` \\|")
	var got []string
	for _, m := range row.FindAllStringSubmatch(layout, -1) {
		got = append(got, m[1])
	}
	slices.Sort(want)
	slices.Sort(got)
	if !slices.Equal(got, want) {
		t.Errorf("README layout lists %v\n go list ./... has %v", got, want)
	}
}
