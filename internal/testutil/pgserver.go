package testutil

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresServer is a private PostgreSQL cluster started by a test (initdb into a temporary
// directory, then postgres on a free 127.0.0.1 port), so that the test may stop, kill and restart
// the database — outage tests. The machine's shared Postgres (port 5432) is never touched.
//
// It is tuned for speed: fsync and full_page_writes are off, so it does not survive a power loss,
// but synchronous_commit stays on, so a transaction whose COMMIT returned survives Kill (every
// process of the server dies; crash recovery runs at the next Start), as on a real server.
//
// When the test runs as root (as CI does), the server runs as the "postgres" system user, since
// PostgreSQL refuses to run as root; its directory is created outside the test's own temporary
// directory (whose parents root alone may enter) and removed when the test ends.
type PostgresServer struct {
	tb      testing.TB
	bindir  string
	dir     string // owned by the server's user; holds data/, the socket and postgres.log
	port    int
	cred    *syscall.Credential // nil: run as the current user
	initDur time.Duration

	daemon
	startDur time.Duration // under daemon.mu
}

// pgStartTimeout bounds how long a start waits for the server to accept connections (crash
// recovery included).
const pgStartTimeout = 60 * time.Second

// StartPostgresServer runs initdb and starts postgres, returning once it accepts connections as
// user postgres (trust authentication) on database "postgres". The binaries are found with
// pg_config --bindir, else in the newest /usr/lib/postgresql/*/bin; without them the test fails
// (or is skipped when ESCROW_REQUIRE_SERVICES is not 1). The server is killed and its directory
// removed when the test ends.
func StartPostgresServer(tb testing.TB) *PostgresServer {
	tb.Helper()
	bindir, err := postgresBindir()
	if err != nil {
		unavailable(tb, "%v", err)
	}
	s := &PostgresServer{tb: tb, bindir: bindir}
	if os.Geteuid() == 0 {
		cred, err := postgresCredential()
		if err != nil {
			unavailable(tb, "running as root and %v", err)
		}
		s.cred = cred
	}
	dir, err := os.MkdirTemp("", "escrow-pg-")
	if err != nil {
		tb.Fatalf("postgres temp dir: %v", err)
	}
	s.dir = dir
	tb.Cleanup(func() {
		s.Kill()
		_ = os.RemoveAll(dir)
	})
	if s.cred != nil {
		if err := os.Chown(dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			tb.Fatalf("chown postgres dir: %v", err)
		}
	}

	t0 := time.Now()
	if err := s.initData(); err != nil {
		tb.Fatalf("%v", err)
	}
	s.initDur = time.Since(t0)

	if err := onFreePort(0, func(port int) error { s.port = port; return s.start() }); err != nil {
		tb.Fatalf("start private postgres: %v", err)
	}
	return s
}

// URL is a connection string for user postgres, database postgres, without TLS.
func (s *PostgresServer) URL() string {
	return "postgres://postgres@" + net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) + "/postgres?sslmode=disable"
}

// Port is the server's TCP port on 127.0.0.1.
func (s *PostgresServer) Port() int { return s.port }

// Dir is the server's directory: data/ (PGDATA), the Unix socket and postgres.log.
func (s *PostgresServer) Dir() string { return s.dir }

// InitTime is how long preparing the data directory took (a copy of the cached template, or
// initdb plus the copy when the cache was empty).
func (s *PostgresServer) InitTime() time.Duration { return s.initDur }

// StartTime is how long the last start took, from exec to the first accepted connection.
func (s *PostgresServer) StartTime() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.startDur
}

// Start starts the server again after Stop or Kill, on the same port and data directory (after
// a Kill, Postgres runs crash recovery first). It does nothing when the server is running. It
// fails the test on error, so call it from the test goroutine.
func (s *PostgresServer) Start() {
	s.tb.Helper()
	if err := s.start(); err != nil {
		s.tb.Fatalf("restart private postgres on port %d: %v", s.port, err)
	}
}

// Stop shuts the server down with a fast shutdown (SIGINT: open sessions are ended, then a
// checkpoint) and waits for it to exit; after 30 s it is killed. It does nothing when the
// server is not running.
func (s *PostgresServer) Stop() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.runningLocked() {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGINT)
	t := time.NewTimer(30 * time.Second)
	defer t.Stop()
	select {
	case <-s.exited:
	case <-t.C:
		killPostgres(s.cmd, s.exited)
	}
}

// Kill ends the postmaster and every backend with SIGKILL, like a crash, and waits for the
// postmaster to exit. It does nothing when the server is not running.
func (s *PostgresServer) Kill() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.runningLocked() {
		killPostgres(s.cmd, s.exited)
	}
}

// Restart is Stop followed by Start.
func (s *PostgresServer) Restart() {
	s.tb.Helper()
	s.Stop()
	s.Start()
}

func (s *PostgresServer) dataDir() string { return filepath.Join(s.dir, "data") }

// command builds a command for one of the server binaries, run as the server's user with a
// clean PG* environment.
func (s *PostgresServer) command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(filepath.Join(s.bindir, name), args...)
	cmd.Dir = s.dir
	env := []string{"LC_ALL=C", "LANG=C", "HOME=" + s.dir, "TZ=UTC"}
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "PATH=") || strings.HasPrefix(kv, "TMPDIR=") {
			env = append(env, kv)
		}
	}
	cmd.Env = env
	attr := childProcAttr()
	attr.Credential = s.cred
	cmd.SysProcAttr = attr
	return cmd
}

func (s *PostgresServer) start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.runningLocked() {
		return nil
	}
	if s.port == 5432 || s.port <= 0 {
		return fmt.Errorf("refusing to run a private postgres on port %d", s.port)
	}
	logPath := filepath.Join(s.dir, "postgres.log")
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("postgres log: %w", err)
	}
	defer logFile.Close()
	cmd := s.command("postgres", "-D", s.dataDir(), "-p", strconv.Itoa(s.port),
		"-h", "127.0.0.1", "-k", s.dir,
		"-c", "fsync=off", "-c", "full_page_writes=off",
		"-c", "shared_buffers=32MB", "-c", "max_connections=60",
		"-c", "logging_collector=off", "-c", "log_min_messages=warning")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	t0 := time.Now()
	ready := func(exited <-chan struct{}) error { return waitPostgresReady(s.URL(), exited, pgStartTimeout) }
	if err := s.launchLocked(cmd, logPath, ready, killPostgres); err != nil {
		return err
	}
	s.startDur = time.Since(t0)
	return nil
}

// waitPostgresReady polls a connection until one succeeds, the process exits or timeout.
func waitPostgresReady(url string, exited <-chan struct{}, timeout time.Duration) error {
	return pollReady("postgres", "accept connections", exited, timeout, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, url)
		if err == nil {
			err = conn.Ping(ctx)
			_ = conn.Close(ctx)
		}
		return err
	})
}

// postgresBindir finds the directory holding initdb and postgres.
func postgresBindir() (string, error) {
	var candidates []string
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		candidates = append(candidates, strings.TrimSpace(string(out)))
	}
	globbed, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(globbed, func(i, j int) bool { // newest major version first
		return pgMajor(globbed[i]) > pgMajor(globbed[j])
	})
	candidates = append(candidates, globbed...)
	for _, d := range candidates {
		if isExecutable(filepath.Join(d, "initdb")) && isExecutable(filepath.Join(d, "postgres")) {
			return d, nil
		}
	}
	return "", fmt.Errorf("PostgreSQL server binaries (initdb, postgres) not found via pg_config --bindir or in /usr/lib/postgresql/*/bin (apt-get install postgresql); looked in %v", candidates)
}

func pgMajor(bindir string) int {
	n, _ := strconv.Atoi(filepath.Base(filepath.Dir(bindir)))
	return n
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0
}

// postgresCredential is the "postgres" system user, for running the server when we are root.
func postgresCredential() (*syscall.Credential, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL refuses to run as root and there is no postgres user: %w", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("postgres user ids: %w", err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}, nil
}

// initData fills data/ with a copy of a freshly initdb'ed cluster. initdb costs about a second
// (more on a busy machine), so its result is kept as a template in the system temporary
// directory (one per PostgreSQL major version and server user, about 40 MB, built once per
// machine and replaced atomically) and copied with cp -a.
func (s *PostgresServer) initData() error {
	uid := os.Geteuid()
	if s.cred != nil {
		uid = int(s.cred.Uid)
	}
	tmpl := filepath.Join(os.TempDir(), fmt.Sprintf("escrow-pgdata-template-%s-%d-v2", filepath.Base(filepath.Dir(s.bindir)), uid))
	pgTemplateMu.Lock() // one initdb per process, not one per parallel test
	if !isFile(filepath.Join(tmpl, "ok")) {
		if err := s.buildTemplate(tmpl); err != nil {
			pgTemplateMu.Unlock()
			return err
		}
	}
	pgTemplateMu.Unlock()
	out, err := exec.Command("cp", "-a", filepath.Join(tmpl, "data"), s.dataDir()).CombinedOutput()
	if err != nil {
		return fmt.Errorf("copy postgres template %s: %w: %s", tmpl, err, out)
	}
	return nil
}

// pgTemplateMu serializes template builds within the process.
var pgTemplateMu sync.Mutex

// buildTemplate runs initdb in a fresh directory and renames it to tmpl; when another process
// won the race, its template is used and ours removed.
func (s *PostgresServer) buildTemplate(tmpl string) error {
	build, err := os.MkdirTemp(os.TempDir(), "escrow-pgdata-build-")
	if err != nil {
		return fmt.Errorf("postgres template dir: %w", err)
	}
	defer os.RemoveAll(build) // after a successful rename there is nothing left to remove
	if s.cred != nil {
		if err := os.Chown(build, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fmt.Errorf("chown postgres template dir: %w", err)
		}
	}
	cmd := s.command("initdb", "-D", filepath.Join(build, "data"), "-U", "postgres", "-A", "trust",
		"-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions", "--wal-segsize=1")
	cmd.Dir = build
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("initdb: %w\n%s", err, out)
	}
	if err := os.WriteFile(filepath.Join(build, "ok"), nil, 0o644); err != nil {
		return fmt.Errorf("postgres template: %w", err)
	}
	// The rename is atomic, so an installed template is always complete; when another process
	// installed one first, the rename fails and that one is used.
	if err := os.Rename(build, tmpl); err != nil && !isFile(filepath.Join(tmpl, "ok")) {
		return fmt.Errorf("install postgres template: %w", err)
	}
	return nil
}

func isFile(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular()
}

// killPostgres kills the postmaster and all its children with SIGKILL and waits for the
// postmaster to exit. Backends make themselves session leaders, so killing the postmaster's
// process group is not enough: the postmaster is stopped first (it cannot fork any more), then
// each child's group and the child itself are killed, then the postmaster.
func killPostgres(cmd *exec.Cmd, exited <-chan struct{}) {
	if cmd.Process == nil {
		return
	}
	pid := cmd.Process.Pid
	_ = syscall.Kill(pid, syscall.SIGSTOP)
	for _, child := range childPIDs(pid) {
		_ = syscall.Kill(-child, syscall.SIGKILL)
		_ = syscall.Kill(child, syscall.SIGKILL)
	}
	killGroup(cmd)
	<-exited
}

// childPIDs lists the processes whose parent is pid, from /proc.
func childPIDs(pid int) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var kids []int
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...; comm may contain spaces and parentheses.
		i := strings.LastIndexByte(string(b), ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) > 1 {
			if ppid, err := strconv.Atoi(f[1]); err == nil && ppid == pid {
				kids = append(kids, n)
			}
		}
	}
	return kids
}
