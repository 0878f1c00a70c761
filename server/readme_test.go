package server

import (
	"bufio"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

var updateReadme = flag.Bool("update-readme", false, "rewrite the outputs (#> lines) of README.md's sessions from a run")

// A README session is a ```sh block right after a line "<!-- session: name -->". Its commands
// run, in order, in one bash against a fresh embedded proxy (curl's localhost:8080 is sent to
// it; ESCROW_ADMIN_TOKEN is set), each after the proxy has settled everything before it, as a
// person typing would see it. The lines "#> …" after a command are its output: this test
// writes them with -update-readme and otherwise fails when they are not what the commands
// print now, so the README's numbers are true.
var sessionStart = regexp.MustCompile(`^<!-- session: ([a-z0-9-]+) -->$`)

type sessionCmd struct {
	lines  []string // the command, with its continuation lines and any comments before it
	output []string // "#> " lines as written in the README
}

type session struct {
	name        string
	first, last int // the lines of the block's body in the README (first .. last-1)
	cmds        []sessionCmd
}

func parseSessions(t *testing.T, lines []string) []session {
	t.Helper()
	var out []session
	for i := 0; i < len(lines); i++ {
		m := sessionStart.FindStringSubmatch(lines[i])
		if m == nil {
			continue
		}
		if i+1 >= len(lines) || lines[i+1] != "```sh" {
			t.Fatalf("README line %d: session %s is not followed by a ```sh block", i+1, m[1])
		}
		s := session{name: m[1], first: i + 2}
		var cur *sessionCmd
		var pending []string
		j := s.first
		for ; j < len(lines) && lines[j] != "```"; j++ {
			l := lines[j]
			switch {
			case strings.HasPrefix(l, "#>"):
				if cur == nil {
					t.Fatalf("README line %d: output before any command", j+1)
				}
				cur.output = append(cur.output, l)
			case strings.HasPrefix(strings.TrimSpace(l), "#") || strings.TrimSpace(l) == "":
				pending = append(pending, l)
			default:
				s.cmds = append(s.cmds, sessionCmd{lines: append(pending, l)})
				pending = nil
				cur = &s.cmds[len(s.cmds)-1]
				for strings.HasSuffix(l, `\`) && j+1 < len(lines) {
					j++
					l = lines[j]
					cur.lines = append(cur.lines, l)
				}
			}
		}
		if j == len(lines) {
			t.Fatalf("README: session %s has no closing ```", s.name)
		}
		if len(pending) > 0 {
			s.cmds = append(s.cmds, sessionCmd{lines: pending}) // trailing comments
		}
		s.last = j
		out = append(out, s)
		i = j
	}
	return out
}

// volatile parts of an output, replaced so that a run prints the same text every time.
var volatile = []struct {
	re   *regexp.Regexp
	with string
}{
	{regexp.MustCompile(`sk-esc-[A-Za-z0-9_-]+`), "sk-esc-…"},
	{regexp.MustCompile(`\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b`), "…"},
	{regexp.MustCompile(`\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)`), "…"},
	{regexp.MustCompile(`\bkey_[0-9a-f]{6,}\b`), "key_…"},
	{regexp.MustCompile(`\bwh_[0-9a-f]{6,}\b`), "wh_…"},
	{regexp.MustCompile(`\bwhsec_[A-Za-z0-9]{6,}\b`), "whsec_…"},
	{regexp.MustCompile(`"next":"[^"]+"`), `"next":"…"`},
}

func normalise(s string) string {
	for _, v := range volatile {
		s = v.re.ReplaceAllString(s, v.with)
	}
	return s
}

// tableHeader is the first line of a table the CLI prints (text/tabwriter, two spaces between
// columns): upper-case column names.
var tableHeader = regexp.MustCompile(`^[A-Z][A-Z_]*( {2,}[A-Z][A-Z_]*)*$`)

// normaliseOutput normalises a command's output; a table's cells are cut at its header's column
// starts, normalised one by one and laid out again, so that a volatile value replaced by a
// shorter one leaves the columns aligned (and empty cells stay empty).
func normaliseOutput(out string) string {
	lines := strings.Split(out, "\n")
	for i, l := range lines {
		lines[i] = strings.TrimRight(l, "\r") // HTTP header lines (curl -D -) end in CRLF
	}
	var res []string
	for i := 0; i < len(lines); i++ {
		if !tableHeader.MatchString(lines[i]) {
			res = append(res, normalise(lines[i]))
			continue
		}
		var starts []int
		h := lines[i]
		for k := 0; k < len(h); k++ {
			if h[k] != ' ' && (k == 0 || (k >= 2 && h[k-1] == ' ' && h[k-2] == ' ')) {
				starts = append(starts, k)
			}
		}
		var rows [][]string
		j := i
		for ; j < len(lines) && strings.TrimSpace(lines[j]) != "" && (j == i || !tableHeader.MatchString(lines[j])); j++ {
			row := make([]string, len(starts))
			for c, st := range starts {
				end := len(lines[j])
				if c+1 < len(starts) {
					end = min(starts[c+1], end)
				}
				if st < end {
					row[c] = normalise(strings.TrimSpace(lines[j][st:end]))
				}
			}
			rows = append(rows, row)
		}
		widths := make([]int, len(starts))
		for _, r := range rows {
			for c, cell := range r {
				widths[c] = max(widths[c], utf8.RuneCountInString(cell))
			}
		}
		for _, r := range rows {
			var b strings.Builder
			for c, cell := range r {
				b.WriteString(cell)
				if c+1 < len(r) {
					b.WriteString(strings.Repeat(" ", widths[c]-utf8.RuneCountInString(cell)+2))
				}
			}
			res = append(res, strings.TrimRight(b.String(), " "))
		}
		i = j - 1
	}
	return strings.Join(res, "\n")
}

// shell is one bash that keeps the session's variables between commands.
type shell struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
	n   int
}

// buildEscrow builds cmd/escrow for the sessions that use the CLI and returns its directory.
func buildEscrow(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("go", "build", "-o", filepath.Join(dir, "escrow"), "../cmd/escrow")
	// CGO_ENABLED=0, as make's non-race steps (go vet, the simulation, the model check) and the
	// image build: one build configuration, compiled once on an empty build cache.
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("go build ./cmd/escrow: %v: %s", err, out)
	}
	return dir
}

func startShell(t *testing.T, proxy, bin string) *shell {
	t.Helper()
	u, err := url.Parse(proxy)
	if err != nil {
		t.Fatal(err)
	}
	for _, tool := range []string{"bash", "curl", "jq"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("the README sessions need %s: %v (scripts/services.sh installs it)", tool, err)
		}
	}
	cmd := exec.Command("bash", "--norc", "--noprofile")
	// The CLI reads ESCROW_URL (the README's default is the demo's address).
	cmd.Env = append(os.Environ(), "ESCROW_ADMIN_TOKEN="+testAdmin, "ESCROW_URL="+proxy, "PATH="+bin+string(os.PathListSeparator)+os.Getenv("PATH"))
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); _ = cmd.Wait(); pw.Close() })
	sh := &shell{cmd: cmd, in: in, out: bufio.NewReader(pr)}
	// Every curl of the session goes to the test's proxy, and never hangs the test.
	sh.run(t, fmt.Sprintf("curl() { command curl --connect-to localhost:8080:%s --max-time 20 \"$@\"; }", u.Host))
	return sh
}

// run sends one command and returns what it printed (stdout and stderr).
func (sh *shell) run(t *testing.T, command string) string {
	t.Helper()
	sh.n++
	end := fmt.Sprintf("__escrow_session_end_%d__", sh.n)
	// The end marker goes on a line of its own even when the command printed no final newline.
	if _, err := fmt.Fprintf(sh.in, "%s\nprintf '\\n%s\\n'\n", command, end); err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	done := make(chan error, 1)
	go func() {
		for {
			l, err := sh.out.ReadString('\n')
			if err != nil {
				done <- err
				return
			}
			if strings.TrimSuffix(l, "\n") == end {
				done <- nil
				return
			}
			b.WriteString(l)
		}
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("session shell: %v after %q", err, b.String())
		}
	case <-time.After(60 * time.Second):
		t.Fatalf("session command did not finish in 60 s: %s", command)
	}
	return strings.TrimSuffix(b.String(), "\n")
}

// allSettled waits until every org's holds are settled and its ledger is in the hot balance,
// so that a command sees what it would see typed by hand.
func (p *testProxy) allSettled(t *testing.T) {
	t.Helper()
	var orgs struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	p.admin(http.MethodGet, "/orgs?limit=1000", nil, http.StatusOK, &orgs)
	for _, o := range orgs.Data {
		p.settled(o.ID)
	}
}

// TestREADMESessions runs the sessions of README.md and of every docs/*.md page that holds one
// (the reference sections moved there keep theirs), one subtest per file.
func TestREADMESessions(t *testing.T) {
	t.Parallel()
	docs, err := filepath.Glob("../docs/*.md")
	if err != nil {
		t.Fatal(err)
	}
	bin := buildEscrow(t)
	for _, path := range append([]string{"../README.md"}, docs...) {
		raw, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(raw), "\n")
		sessions := parseSessions(t, lines)
		if len(sessions) == 0 {
			if path == "../README.md" {
				t.Fatal("README.md has no <!-- session: … --> block")
			}
			continue
		}
		name := strings.TrimPrefix(path, "../")
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			runSessions(t, name, path, lines, sessions, bin)
		})
	}
}

// runSessions runs one file's sessions, each against a fresh proxy, and compares (or, with
// -update-readme, rewrites) their #> lines.
func runSessions(t *testing.T, name, path string, lines []string, sessions []session, bin string) {
	var rewritten []string
	at := 0
	stale := false
	for _, s := range sessions {
		p := startTestProxy(t, false)
		sh := startShell(t, p.base, bin)
		rewritten = append(rewritten, lines[at:s.first]...)
		for _, c := range s.cmds {
			rewritten = append(rewritten, c.lines...)
			if strings.HasPrefix(strings.TrimSpace(c.lines[len(c.lines)-1]), "#") || strings.TrimSpace(c.lines[len(c.lines)-1]) == "" {
				continue // trailing comments
			}
			p.allSettled(t)
			out := normaliseOutput(strings.TrimRight(sh.run(t, strings.Join(c.lines, "\n")), "\n"))
			var got []string
			if out != "" {
				for _, l := range strings.Split(out, "\n") {
					got = append(got, strings.TrimRight("#> "+l, " "))
				}
			}
			if strings.Join(got, "\n") != strings.Join(c.output, "\n") {
				stale = true
				t.Logf("%s session %s: %s\n  it says:\n%s\n  the run prints:\n%s", name, s.name, strings.Join(c.lines, "\n"),
					strings.Join(c.output, "\n"), strings.Join(got, "\n"))
			}
			rewritten = append(rewritten, got...)
		}
		at = s.last
	}
	rewritten = append(rewritten, lines[at:]...)
	if !stale {
		return
	}
	if *updateReadme {
		if err := os.WriteFile(path, []byte(strings.Join(rewritten, "\n")), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("%s rewritten", name)
		return
	}
	t.Fatalf("%s's sessions are not what their commands print; run: go test ./server -run TestREADMESessions -update-readme", name)
}
