package server

import "sync"

// proxyBuffers recycles the reverse proxy's copy buffers: without a pool, httputil.ReverseProxy
// allocates a fresh 32 KiB buffer for every response (the bench's allocation profile: more than
// half of the proxy's allocated bytes, and the GC work that goes with them).
var proxyBuffers = &bufferPool{p: sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}}

type bufferPool struct{ p sync.Pool }

func (b *bufferPool) Get() []byte  { return *b.p.Get().(*[]byte) }
func (b *bufferPool) Put(x []byte) { b.p.Put(&x) }
