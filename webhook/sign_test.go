package webhook_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/llmescrow/escrow/webhook"
)

func TestSignVerify(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_700_000_000, 0)
	body := []byte(`{"id":"e1","type":"credit.received"}`)
	h := webhook.Sign("whsec_a", now, body)
	// A known answer: printf '%s' '1700000000.{…}' | openssl dgst -sha256 -hmac whsec_a
	if want := "t=1700000000,v1=87d11ab7f6b626f0bbe016f76aa00e004027da5879f3a97ad3c17744620a2dcf"; h != want {
		t.Fatalf("Sign = %q, want %q", h, want)
	}
	if err := webhook.Verify(h, "whsec_a", body, 5*time.Minute, now.Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	for name, err := range map[string]error{
		"wrong secret":  webhook.Verify(h, "whsec_b", body, 0, now),
		"changed body":  webhook.Verify(h, "whsec_a", append(body, ' '), 0, now),
		"stale":         webhook.Verify(h, "whsec_a", body, 5*time.Minute, now.Add(6*time.Minute)),
		"no v1":         webhook.Verify("t=1700000000", "whsec_a", body, 0, now),
		"malformed":     webhook.Verify("garbage", "whsec_a", body, 0, now),
		"other t":       webhook.Verify(strings.Replace(h, "t=1700000000", "t=1700000001", 1), "whsec_a", body, 0, now),
		"empty":         webhook.Verify("", "whsec_a", body, 0, now),
		"no timestamp:": webhook.Verify(h[strings.Index(h, ",")+1:], "whsec_a", body, 0, now),
	} {
		if !errors.Is(err, webhook.ErrBadSignature) {
			t.Errorf("%s: err = %v, want ErrBadSignature", name, err)
		}
	}
	// Two v1 values (a rotation): either may match.
	if err := webhook.Verify(h+",v1=00", "whsec_a", body, 0, now); err != nil {
		t.Fatal(err)
	}
}
