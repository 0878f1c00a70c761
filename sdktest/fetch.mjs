// The fetches the SDK scripts give their clients (written once for both).
import readline from 'node:readline';

// counting counts a client's HTTP attempts (1: the SDK did not retry) and the bytes of each
// request body.
export const counting = () => {
  const c = { attempts: 0, bodyBytes: [] };
  c.fetch = (url, init) => {
    c.attempts++;
    c.bodyBytes.push(typeof init?.body === 'string' ? Buffer.byteLength(init.body) : null);
    return fetch(url, init);
  };
  return c;
};

// heldFetcher is the fetch of a client whose first request is refused balance_held: it
// records the first answer, and before each retry prints {"event":"retry"} and waits for a line
// on standard input (the Go test lets the retry go once the request in flight has finished), so
// the retry's outcome does not depend on timing. The SDK's own pause before the retry (its
// Retry-After) is measured for the log, never asserted.
export function heldFetcher() {
  let lines = null;
  const h = { attempts: 0, first: null, firstAt: 0, waitedMs: null };
  const fetchFn = async (url, init) => {
    h.attempts++;
    if (h.attempts > 1) {
      h.waitedMs ??= Date.now() - h.firstAt; // the SDK's pause before its first retry
      console.log(JSON.stringify({ event: 'retry', attempt: h.attempts }));
      lines ??= readline.createInterface({ input: process.stdin })[Symbol.asyncIterator]();
      const { done } = await lines.next();
      if (done) throw new Error('standard input closed before the test let the retry go');
    }
    const res = await fetch(url, init);
    if (h.attempts === 1) {
      h.firstAt = Date.now();
      const body = await res.clone().json().catch(() => null);
      h.first = {
        status: res.status,
        bodyBytes: typeof init?.body === 'string' ? Buffer.byteLength(init.body) : null,
        retryAfter: res.headers.get('retry-after'),
        shouldRetry: res.headers.get('x-should-retry'),
        type: body?.error?.type ?? null,
        code: body?.error?.code ?? null,
        message: body?.error?.message ?? null,
      };
    }
    return res;
  };
  // done ends the wait on standard input and returns what was seen, with the final response.
  const done = (response, usage) => {
    lines?.return?.();
    process.stdin.destroy();
    return {
      status: response.status,
      attempts: h.attempts,
      first: h.first,
      waitedMs: h.waitedMs,
      outputCap: response.headers.get('x-escrow-output-cap'),
      usage,
    };
  };
  return { fetch: fetchFn, done };
}
