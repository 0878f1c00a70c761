package main

import (
	"strings"
	"testing"
)

// TestCLIRedisACL: `escrow redis-acl` prints the two planes' ACL SETUSER lines for a prefix
// (created and exercised on Redis by balance's TestConformancePlanes and server's
// TestPlanesRedisUsers), with fresh passwords, and refuses a user name that is not one word.
func TestCLIRedisACL(t *testing.T) {
	c := &cli{t: t, env: map[string]string{}}
	out := c.ok("redis-acl", "-prefix", "px", "-data-user", "d1", "-admin-user", "a1")
	var data, admin string
	for _, l := range strings.Split(out, "\n") {
		switch {
		case strings.HasPrefix(l, "ACL SETUSER d1 "):
			data = l
		case strings.HasPrefix(l, "ACL SETUSER a1 "):
			admin = l
		}
	}
	for _, want := range []string{" reset ", " -@all ", " +evalsha ", " ~px:{* ", " ~px:model:* ", " %R~px:a:*"} {
		if !strings.Contains(data+" ", want) {
			t.Errorf("data user lacks %q: %s", want, data)
		}
	}
	if strings.Contains(data, " ~px:* ") || strings.Contains(data, " ~px:a:") {
		t.Errorf("the data user may write admin keys: %s", data)
	}
	if !strings.HasSuffix(admin, " ~px:*") {
		t.Errorf("admin user: %s", admin)
	}
	again := c.ok("redis-acl", "-prefix", "px", "-data-user", "d1", "-admin-user", "a1")
	if again == out {
		t.Error("the same passwords twice")
	}
	if _, err := c.run("redis-acl", "-data-user", "x on >pw ~*"); err == nil {
		t.Fatal("a user name with rules in it was accepted")
	}
}
