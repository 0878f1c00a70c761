package testutil

import (
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"
)

// daemon is the process of a private server a test runs (PostgresServer, RedisServer): whether
// it is alive, how it is launched, and the wait until it serves.
type daemon struct {
	mu     sync.Mutex
	cmd    *exec.Cmd
	exited chan struct{} // closed when cmd has been waited for
}

// Running reports whether the server process is alive.
func (d *daemon) Running() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.runningLocked()
}

func (d *daemon) runningLocked() bool {
	if d.cmd == nil {
		return false
	}
	select {
	case <-d.exited:
		return false
	default:
		return true
	}
}

// launchLocked starts cmd (d.mu held) and waits until ready says the server serves. When it does
// not, kill ends the process and the error quotes what the server wrote to logPath since.
func (d *daemon) launchLocked(cmd *exec.Cmd, logPath string, ready func(exited <-chan struct{}) error,
	kill func(cmd *exec.Cmd, exited <-chan struct{})) error {
	logStart := fileSize(logPath)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("exec %s: %w", cmd.Path, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	d.cmd, d.exited = cmd, exited
	if err := ready(exited); err != nil {
		kill(cmd, exited)
		return fmt.Errorf("%w; %s: %s", err, filepath.Base(logPath), tailFrom(logPath, logStart, 2000))
	}
	return nil
}

// pollReady calls try every 10ms until it succeeds, the process exits or timeout passes; name
// and doing say what failed ("postgres", "accept connections").
func pollReady(name, doing string, exited <-chan struct{}, timeout time.Duration, try func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := try()
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return fmt.Errorf("%s exited during start", name)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s did not %s within %v: %w", name, doing, timeout, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// onFreePort calls start with a free loopback port (port+busOffset free too, when > 0) until a
// start succeeds. A port found free may be taken by another process before the server binds it,
// so a start that loses that race ("in use") tries another port, five times at most.
func onFreePort(busOffset int, start func(port int) error) error {
	var lastErr error
	for attempt := 0; attempt < 5; attempt++ {
		port, err := freeLoopbackPort(busOffset)
		if err != nil {
			return err
		}
		if lastErr = start(port); lastErr == nil {
			return nil
		}
		if !strings.Contains(lastErr.Error(), "in use") {
			break
		}
	}
	return lastErr
}
