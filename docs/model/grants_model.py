#!/usr/bin/env python3
"""Executable model of credit grants that expire (DESIGN.md "Money in", docs/grants.md), on top of
the hold/settle rules of protocol_model.py (one org, no limits: what expiry adds).

The ledger keeps grants (amount, priority, expiry T or none); a charge consumes the grants live at
its reserve time rt (T > rt, not yet expired by an entry), in order (priority, T, grant id). Some
time after T (a grace) the ledger writes one expire entry per grant of T (delta = -its unspent
rest, the last one marked). The hot balance keeps, per upcoming expiry time T, x[T] (the unspent
rest of T's grants as of its watermark) and rolls it over at T like a limit window: bal -= x[T],
r[T] = x[T] (removed, awaiting the expire entries). Settle brings the ledger's rests as of the
batch's read (a block, applied only when the watermark ends exactly there); a credit of an
expiring grant adds to x[T] itself (its marker). Checked after every step, while acct exists:
  invariant   bal + sum(holds) + sum(r) == B(wm)
  no expired credit spendable   bal <= B(wm) - sum(holds) - sum over grants G with T_G <= now,
              credited and not expired by entries <= wm, of rest_G(wm)
and at rest: bal == ledger balance, r empty, each grant expired exactly once with its rest.
Flags that switch one rule off (the run should then fail):
  NO_ROLL=1     reserve does not roll the expiry over (a hold spends expired credit)
  NO_MARK=1     a credit of an expiring grant does not add to x[T] (only the block does)
  ANY_BLOCK=1   the block is applied even when the watermark did not end at its read
  NO_LAST=1     the expire entry never gives back r[T] (the invariant breaks)
Usage: grants_model.py [runs] [steps]
"""
import os, random, sys

E = os.environ.get
NO_ROLL = E("NO_ROLL") == "1"; NO_MARK = E("NO_MARK") == "1"
ANY_BLOCK = E("ANY_BLOCK") == "1"; NO_LAST = E("NO_LAST") == "1"
GRACE = 6


class Fail(Exception):
    pass


class Ledger:
    def __init__(s):
        s.entries = []        # (seq, delta, kind, hid, info)  info: charge alloc / grant id / (T, last)
        s.grants = {}         # gid -> dict(amt, prio, T, credit_seq, expired_seq, rest)
        s.pending = []        # (hid, cost, rt)

    def seq(s): return len(s.entries)

    def B(s, k): return sum(e[1] for e in s.entries if e[0] <= k)

    def add(s, delta, kind, hid="", info=None):
        e = (s.seq() + 1, delta, kind, hid, info)
        s.entries.append(e)
        return e

    def credit(s, amt, prio, T):
        gid = len(s.grants) + 1
        e = s.add(amt, "credit", "", gid)
        s.grants[gid] = dict(amt=amt, prio=prio, T=T, credit_seq=e[0], expired_seq=None, rest=amt)

    def account(s):
        for hid, cost, rt in s.pending:
            left, alloc = cost, []
            live = [g for g in s.grants.items() if g[1]["expired_seq"] is None and g[1]["rest"] > 0
                    and (g[1]["T"] is None or g[1]["T"] > rt)]
            live.sort(key=lambda g: (g[1]["prio"], g[1]["T"] if g[1]["T"] is not None else 10**9, g[0]))
            for gid, g in live:
                take = min(left, g["rest"])
                if take:
                    g["rest"] -= take; left -= take; alloc.append((gid, take))
            s.add(-cost, "charge", hid, alloc)
        s.pending = []

    def expire(s, now):
        due = sorted({g["T"] for g in s.grants.values() if g["T"] is not None and g["expired_seq"] is None
                      and g["T"] + GRACE <= now})
        for T in due:
            gs = [gid for gid, g in sorted(s.grants.items()) if g["T"] == T and g["expired_seq"] is None]
            for i, gid in enumerate(gs):
                g = s.grants[gid]
                e = s.add(-g["rest"], "expire", "", (T, i == len(gs) - 1, gid))
                g["expired_seq"] = e[0]; g["rest"] = 0

    def rests(s):
        """x per T of the grants not expired by an entry, as of the latest seq."""
        out = {}
        for g in s.grants.values():
            if g["T"] is not None and g["expired_seq"] is None:
                out[g["T"]] = out.get(g["T"], 0) + g["rest"]
        return out

    def rest_at(s, gid, k):
        """rest of grant gid after the entries with seq <= k (0 when not credited or expired)."""
        g = s.grants[gid]
        if g["credit_seq"] > k or (g["expired_seq"] is not None and g["expired_seq"] <= k):
            return 0
        spent = sum(t for e in s.entries if e[0] <= k and e[2] == "charge" for gg, t in e[4] if gg == gid)
        return g["amt"] - spent


class Hot:
    def __init__(s): s.acct = None; s.holds = {}

    def roll(s, now):
        a = s.acct
        for T in sorted(a["x"]):
            if T <= now:
                v = a["x"].pop(T)
                a["bal"] -= v
                a["r"][T] = a["r"].get(T, 0) + v

    def reserve(s, hid, amt, now):
        if s.acct is None: return "COLD"
        if not NO_ROLL: s.roll(now)
        if s.acct["bal"] < amt: return "INSUFFICIENT"
        s.acct["bal"] -= amt; s.holds[hid] = (amt, now)
        return "OK"

    def release(s, hid):
        h = s.holds.pop(hid, None)
        if h and s.acct is not None: s.acct["bal"] += h[0]

    def seed(s, L, now):
        W = L.seq()
        s.acct = dict(bal=L.B(W) - sum(h[0] for h in s.holds.values()), wm=W, x=dict(L.rests()), r={})
        s.roll(now)

    def settle(s, entries, block, as_of, now):
        a = s.acct
        if a is None: return
        s.roll(now)
        for seq, delta, kind, hid, info in entries:
            if seq <= a["wm"]:
                if hid and hid in s.holds: a["bal"] += s.holds.pop(hid)[0]
                continue
            if seq != a["wm"] + 1: break
            if hid and hid in s.holds: a["bal"] += s.holds.pop(hid)[0]
            a["bal"] += delta
            if kind == "credit" and info is not None and not NO_MARK:
                T = s.L.grants[info]["T"]
                if T is not None: a["x"][T] = a["x"].get(T, 0) + delta
            if kind == "expire":
                T, last, _ = info
                if last:
                    if not NO_LAST: a["bal"] += a["r"].pop(T, 0)
                    a["r"].pop(T, None); a["x"].pop(T, None)
            a["wm"] = seq
        if a["wm"] == as_of or ANY_BLOCK:
            for T in set(a["x"]) | set(a["r"]) | set(block):
                v = block.get(T, 0)
                if T in a["r"]:
                    a["bal"] += a["r"][T] - v; a["r"][T] = v
                else:
                    a["x"][T] = v
            for T in [T for T, v in a["x"].items() if T not in block]:
                a["x"].pop(T)
        s.roll(now)


def run(seed, steps):
    rnd = random.Random(seed)
    L, H = Ledger(), Hot()
    H.L = L
    now, nid = 0, [0]
    inflight = {}      # hid -> amount (holds whose requests are running)

    def check(where):
        a = H.acct
        if a is None: return
        wm = a["wm"]
        held = sum(h[0] for h in H.holds.values())
        if a["bal"] + held + sum(a["r"].values()) != L.B(wm):
            raise Fail(f"{where}: invariant bal {a['bal']} + holds {held} + r {sum(a['r'].values())} != B(wm) {L.B(wm)}")
        # what a script sees: the expiries due are rolled over by the next call
        bal = a["bal"] - sum(v for T, v in a["x"].items() if T <= now)
        if bal > spendable(now):
            raise Fail(f"{where}: expired credit spendable: bal {bal} > {spendable(now)} (t={now})")

    def spendable(t):
        """the ledger's balance at wm less the holds and the unspent rest of every grant expired by t"""
        wm = H.acct["wm"]
        held = sum(h[0] for h in H.holds.values())
        expired = sum(L.rest_at(gid, wm) for gid, g in L.grants.items() if g["T"] is not None and g["T"] <= t)
        return L.B(wm) - held - expired

    L.credit(rnd.randint(50, 200), 1, None) if rnd.random() < 0.5 else None
    for step in range(steps):
        now += rnd.choice((0, 1, 1, 2))
        op = rnd.random()
        if op < 0.30:
            nid[0] += 1; hid = f"h{nid[0]}"
            if H.acct is None: H.seed(L, now)
            amt = rnd.randint(1, 30)
            room = spendable(now)
            if H.reserve(hid, amt, now) == "OK":
                inflight[hid] = amt
                if amt > room:
                    raise Fail(f"seed {seed} step {step}: hold {amt} spends expired credit (room {room}, t={now})")
        elif op < 0.45 and inflight:
            hid = rnd.choice(sorted(inflight)); amt = inflight.pop(hid)
            if rnd.random() < 0.2:
                H.release(hid)
            else:
                rt = H.holds[hid][1] if hid in H.holds else now
                L.pending.append((hid, rnd.randint(0, amt), rt))
        elif op < 0.55:
            L.account()
        elif op < 0.72:
            # the worker reads the entries past wm and the rests in one read, and settles a prefix
            if H.acct is not None:
                ents = [e for e in L.entries if e[0] > H.acct["wm"]]
                block, as_of = dict(L.rests()), L.seq()
                cut = len(ents) if rnd.random() < 0.7 else rnd.randint(0, len(ents))
                if rnd.random() < 0.2: L.account(); L.expire(now)   # the ledger moves on meanwhile
                H.settle(ents[:cut], block, as_of, now)
        elif op < 0.80:
            L.credit(rnd.randint(10, 120), rnd.choice((0, 1)), now + rnd.randint(1, 25) if rnd.random() < 0.8 else None)
        elif op < 0.88:
            L.expire(now)
        elif op < 0.91:
            H.acct = None     # invalidate / Redis data loss of acct (holds stay)
        elif op < 0.93:
            H.acct = None; H.holds = {}; inflight.clear()   # Redis data loss (requests fail)
        check(f"seed {seed} step {step}")
    # quiesce
    for hid in sorted(inflight):
        L.pending.append((hid, rnd.randint(0, inflight[hid]), H.holds[hid][1] if hid in H.holds else now))
    inflight.clear()
    now += 100
    L.account(); L.expire(now)
    if H.acct is None: H.seed(L, now)
    for _ in range(3):
        ents = list(L.entries)   # re-sending any entry is safe: an entry below wm gives back its hold
        H.settle(ents, dict(L.rests()), L.seq(), now)
        check(f"seed {seed} quiesce")
    if H.holds:
        raise Fail(f"seed {seed}: holds left {H.holds}")
    if H.acct["bal"] != L.B(L.seq()) or H.acct["r"] or H.acct["wm"] != L.seq():
        raise Fail(f"seed {seed}: at rest bal {H.acct['bal']} != ledger {L.B(L.seq())} (r {H.acct['r']})")
    for gid, g in L.grants.items():
        n = sum(1 for e in L.entries if e[2] == "expire" and e[4][2] == gid)
        if (g["T"] is None) != (n == 0) or n > 1:
            raise Fail(f"seed {seed}: grant {gid} expired {n} times")
        if n:
            e = next(e for e in L.entries if e[2] == "expire" and e[4][2] == gid)
            if -e[1] != L.rest_at(gid, e[0] - 1):
                raise Fail(f"seed {seed}: grant {gid} expired {-e[1]}, rest was {L.rest_at(gid, e[0] - 1)}")
    return True


if __name__ == "__main__":
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    for sd in range(runs):
        try:
            run(sd, steps)
        except Fail as f:
            print("FAIL", f); sys.exit(1)
    print(f"ok: {runs} runs x {steps} steps")
