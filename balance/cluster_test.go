package balance_test

import (
	"testing"

	"github.com/llmescrow/escrow/balance/balancetest"
	"github.com/llmescrow/escrow/internal/testutil"
)

// TestConformanceCluster runs the whole suite on a private 3-master Redis Cluster: miniredis
// never raises CROSSSLOT, so this is the proof that every script call stays in one slot.
func TestConformanceCluster(t *testing.T) {
	t.Parallel()
	c := testutil.StartRedisCluster(t)
	balancetest.Run(t, balancetest.Env{Client: c.Client(), Prefix: testutil.RandomName("t"), Real: true})
}
