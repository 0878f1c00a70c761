/*
 * escrow.pml — an exhaustive SPIN model of escrow's hold/settle protocol (DESIGN.md "The flow",
 * "The invariant", "Limits"). docs/model/README.md maps every rule here to DESIGN.md and says
 * how to read a counterexample trail.
 *
 * The world: one org, one ledger (restorable once, which raises its epoch generation), one Redis
 * (which may lose all its data once), two proxies with their own cached epochs, three requests
 * (r0 and r2 on proxy 0, r1 on proxy 1), a Redis client that may re-send r0's reserve late, one worker in proxy 0 that may crash between settling and marking, one reaper, an admin
 * credit, an invalidation, and one limit window that rolls over once. r1 and r2 are bounded (they
 * never cost more than their hold); r1 may be fitted (DESIGN.md "Holds that fit"). Three limits,
 * each with a counter per window: the org's money limit, the org's tokens limit (-DREQUESTS: a
 * requests limit) and a money limit of each end user apart (two end users: r0 and r2 are end
 * user 0's, r1 end user 1's; one counter per end user and window).
 *
 * Every d_step is one atomic step of the real system: the body of one Lua script, or one ledger
 * transaction. Steps that involve choices (which entries a worker read) use atomic. Every step that
 * changes Redis or the ledger ends with CHECK(), so the invariants are asserted in every
 * reachable state; the at-rest properties are asserted by init once everything is quiet.
 *
 * Mutations: compile with exactly one -DM_<RULE> to switch that rule off (the list is in the
 * README and in internal/modelcheck). Each must make SPIN find a counterexample.
 *
 * Every state-changing step prints one "STEP ..." line; `spin -t` replays a trail with them, and
 * internal/modelcheck replays those lines against the real Lua scripts.
 */

#define NR    3   /* requests */
#define MAXE  5   /* ledger entries per epoch: the first credit, the admin credit, 3 charges */
#define CAP   2   /* per-org cap on unfinished, unpinned holds */
#define CAPL  3   /* the org's spend limit per window */
#ifndef B0
#define B0    2   /* the first credit (seq 1) */
#endif
#define CR    1   /* the admin credit */
#ifdef NO_R2
#define NRUN 3
#else
#define NRUN 4
#endif

/* hold amount and real cost per request (a world may choose others with -D) */
#ifndef A0
#define A0 1      /* r0: costs more than its hold (the debt rule's case) */
#define C0 2
#define A1 2      /* r1: costs less than its hold (finish gives the rest back) */
#define C1 1
#define A2 1      /* r2: costs its hold */
#define C2 1
#endif
#define AMT(r)  ((r) == 0 -> A0 : ((r) == 1 -> A1 : A2))
#define COST(r) ((r) == 0 -> C0 : ((r) == 1 -> C1 : C2))

/* DESIGN "Limits", third wave: units and end users. A tokens limit holds a request's token bound
 * TB(r) and is moved to its real count TR(r) by finish and settle, like money; a requests limit
 * (-DREQUESTS) holds 1 and keeps it (TB = TR = 1). r0, unbounded, uses more tokens than its bound
 * (the overshoot rule's case); r1 fewer (finish gives the rest back). */
#ifdef REQUESTS
#define TB(r) 1
#define TR(r) 1
#else
#define TB(r) ((r) == 1 -> 2 : 1)
#define TR(r) ((r) == 0 -> 3 : 1)
#endif
#ifndef CAPT
#define CAPT  4   /* the org's tokens (requests) limit per window */
#endif
#define CAPE  2   /* the money limit of each end user apart, per window */
#define NEU   2   /* end users */
#define EU(r) ((r) == 1 -> 1 : 0)
#define EF(e, w) ((e)*2 + (w))   /* end user e's counter of window w */

/* DESIGN "Holds that fit": a bounded request holds its bound, and the upstream enforces the output
 * cap of that bound, so it can never cost more than its hold — r1 and r2 (C1 ≤ A1, C2 ≤ A2). r0 is
 * the unbounded one (held at a learned max): it may cost more (the debt rule).
 * A bounded request whose reserve is refused INSUFFICIENT or LIMIT with a room ≥ FITMIN is fitted
 * (middleware/fit.go): the same hold id is reserved again with the room — the bound at a lower
 * output cap, which is written into the body — and the fitted hold is an ordinary hold. Only r1
 * may be fitted (-DFULL: every bounded request), to keep the state space small. ramt[r] is the
 * amount of r's latest reserve (AMT(r) until a fit), RCOST(r) what r really costs: the upstream
 * enforces the fitted cap, so a fitted request costs at most its fitted hold. */
#define BOUNDED(r) ((r) != 0)
#ifdef FULL
#define FITS(r) BOUNDED(r)
#else
#define FITS(r) ((r) == 1)
#endif
#define FITMIN 1  /* the bound at the model's minimum output cap */
#ifdef REQUESTS
#define REQUNIT 1 /* a requests limit counts 1 whatever the request's size: never fitted */
#else
#define REQUNIT 0
#endif
#ifndef M_FITCAP
#define RCOST(r) ((BOUNDED(r) && COST(r) > ramt[r]) -> ramt[r] : COST(r))
#else
#define RCOST(r) (COST(r))   /* the fitted cap is not written into the body: the original bound's cost */
#endif
/* a fit lowers the output cap, hence the token bound too (rtok[r]): a fitted request uses at most
 * its fitted token bound; HTOK(r) is what r's hold holds on the tokens counter (its token bound,
 * its real count once finished) */
#define RTOK(r) ((BOUNDED(r) && TR(r) > rtok[r]) -> rtok[r] : TR(r))
#define HTOK(r) (hfin[r] -> RTOK(r) : rtok[r])
/* a charge entry's tokens: its request's real count (the ledger stores the usage) */
#define ETOK(i) RTOK(eh[i] - 1)

/* replies */
#define S_OK      1
#define S_COLD    2
#define S_DUP     3
#define S_GONE    4
#define S_TOOMANY 5
#define S_LIMIT   6
#define S_INSUFF  7
#define S_LOST    8   /* the call timed out before Redis ran it (client sees an error) */
#define S_FROZEN  9   /* PLANES: the org is frozen (lim's freeze flag) */

#define NOWIN 2       /* a hold record that names no counter / an entry attributed to none */

byte clock;           /* the current limit window on the Redis clock: 0, then 1 after the rollover */

/* ---- Redis ---- */
bool acct;            /* esc:{org}:acct exists (with lim and u: they vanish together) */
short bal;
byte wm;
byte aep;             /* acct's epoch generation */
bool hp[NR];          /* hold present (holds hash) */
byte hamt[NR];        /* hold amount */
bool hfin[NR];        /* finished flag */
bool hpin[NR];        /* expiry pushed far out (pinned) */
byte hwin[NR];        /* the counter (window) the hold was added to; NOWIN for none */
bool gone[NR];        /* tombstones */
bool uex[2];          /* counter field exists, per window */
short U[2];
bool uexT[2];         /* the tokens (requests) limit's counters, per window */
short UT[2];
bool uexE[2*NEU];     /* the end-user limit's counters, per end user and window: EF(e, w) */
short UE[2*NEU];

#ifdef PLANES
/* ==== two planes (issue 36, DESIGN "Two planes"): lim is the admin plane's key ====
 * lim is written only by the admin plane's push (with the ledger's limits version, its freeze
 * and the epoch); the data plane's seed reads it and refuses to seed without it at the
 * snapshot's version; no data-plane step deletes it; a Redis data loss may take it alone.
 * The model's limits are one freeze flag (the counters' caps stay the constants above). */
bool lim;             /* esc:a:{org}:lim exists */
byte limv;            /* its version */
bool limfz;           /* its freeze flag */
byte limep;           /* the ledger epoch generation it was pushed under */
byte acctlv;          /* the limits version acct was seeded under (acct's lv) */
byte lver;            /* ledger: the limits version */
bool lfz;             /* ledger: the org is frozen */
bool fzpushed;        /* ghost: the admin's freeze call returned (its push is done) */
byte nlimloss;        /* data losses of lim alone so far (at most two) */
#endif

/* ---- ledger (Postgres) ---- */
byte lep;             /* current epoch generation */
byte lsq[2];          /* ledger_seq per generation */
short ed[2*MAXE];     /* entries of generation g at g*MAXE + seq-1: delta */
byte eh[2*MAXE];      /* hold id + 1 (0: none) */
byte ew[2*MAXE];      /* window of the entry's stored reserve time (NOWIN: a credit) */
byte settled;         /* settled_seq (of the current ledger) */
byte ev[NR];          /* usage event: 0 none, 1 pending, 2 accounted */
byte evseq[NR];       /* the entry an accounted event became */
byte evw[NR];         /* the reserve window stored with the event */
bool jr[NR];          /* usage waiting in a proxy's local journal */

/* ---- proxies ---- */
byte pe[2];           /* each proxy's cached ledger epoch */

/* ---- the middleware ---- */
byte ramt[NR];        /* the amount of each request's latest reserve: AMT(r), or its fitted amount */
byte rtok[NR];        /* its token bound: TB(r), or its fitted one */

/* ---- ghost state: what the properties speak about, never read by a rule ---- */
bool oact[NR];        /* the owner is alive and extending its hold, so it never expires */
bool alive[NR];       /* the request is still being served (its owner waits on its reserve call) */
bool sent[NR];        /* the first reserve was sent (a re-send may follow) */
byte sep[NR];         /* the epoch that reserve carried */
byte rwin[NR];        /* reserve-time window of the request's hold */
bool served[NR];      /* the client got a response: it must be billed once */
byte hrec[NR];        /* hold live when its usage was recorded (the debt rule) */
bool hend[NR];        /* the hold was ended (settled, released or reaped) */
bool tlost[NR];       /* its tombstone may have been lost with a data loss */
bool lost[NR];        /* usage lost with a restore or a lost journal: may stay unbilled */
short jla;            /* allowed debt: journaled usage whose hold was lost with Redis */
byte applied;         /* bit s: entry s is in bal in this acct's lifetime */
byte acctmax;         /* highest generation this acct lifetime has had */
byte ndone;           /* requests and re-senders finished */
bool wbusy;           /* the worker is between reading entries and marking them */
bool rbusy;           /* the reaper is between its ledger check and its reap */
bool didflush, didinv, didcredit, didrestore;
bool resting;         /* init is checking the world at rest: nothing else moves */

/* ---- jobs (fourth wave, DESIGN.md "Async work"; -DJOBS): r0 is a background job ---- */
#ifdef JOBS
bool jl[NR];          /* ledger: a live job owns r's hold (recorded, not settled yet) */
byte lease;           /* the job's lease: 0 free (or run out), p+1 held by poller p */
bool didlapse;        /* the job hold's pin lapsed once (its holder crashed, nobody renewed it) */
#define JOBLIVE(r) (jl[r])
#define ISJOB(r) ((r) == 0)
#else
#define JOBLIVE(r) 0
#define ISJOB(r) 0
#endif

/* scratch for CHECK and the d_steps (hidden: not part of the state) */
hidden byte ti, tj, ts;
hidden short tB, tH, tU, tA, tx;
hidden short troom;   /* the room a refused reserve reports (reserve.lua's INSUFFICIENT / LIMIT replies) */
hidden short ttroom;  /* the token room it reports (the tokens limit's CAPT − UT) */
hidden byte tunit;    /* a LIMIT refusal was the tokens (requests) limit's */
hidden byte te;       /* scratch: an end user */

#define IDX(g, s) ((g)*MAXE + (s) - 1)

#ifdef GRANTS
/* ---- grants (DESIGN "Money in", docs/grants.md) ----------------------------------------------
 * GP of the first credit (seq 1) is a promotional grant that expires at T; the rest of it is paid
 * credit that never expires. Chaos moves the Redis clock past T once (gtick). A charge spends the
 * grant only when its request was reserved before T (rgt: the reserve time its event stores) and
 * the grant has no expire entry yet; the worker writes that entry (delta = −its rest) once no hold
 * reserved before T is left in Redis, accounting the pending usage first (and at rest). Redis keeps the rest to come (gx: acct's x:<T>), rolls it over
 * at T in reserve and settle (bal −= gx, gr = gx: r:<T>), gets the ledger's rest with a settle that
 * ends at the ledger's last entry (the block), and gives gr back when the expire entry settles.
 * Invariant: bal + Σ holds + gr = B(wm). M_EXPIRY: reserve does not roll the expiry over. */
#ifndef GP
#define GP 2
#endif
bool gtime;           /* the Redis clock has passed T */
bool rgt[NR];         /* r was reserved at or after T (stored with its usage event) */
short grest;          /* ledger: the grant's unspent rest (0 once expired) */
byte gxs;             /* ledger: its expire entry's seq (0: none yet) */
byte etk[2*MAXE];     /* ledger: what each charge entry took from the grant */
bool gxe[2*MAXE];     /* ledger: the entry is the grant's expire entry */
short gx;             /* Redis: x:<T>, the rest to come */
short gr;             /* Redis: r:<T>, the rest rolled over, waiting for the expire entry */
bool grl;             /* Redis: T rolled over (or closed) in this acct's lifetime */

/* lib/expiry: the expiry has come: its rest leaves bal */
inline GROLL() {
  if :: gtime && !grl -> bal = bal - gx; gr = gr + gx; gx = 0; grl = 1 :: else fi
}
/* tA = what a hold may take without spending expired credit: B(wm) − Σ holds − (after T, while no
 * expire entry ≤ wm) the grant's rest at wm */
inline GROOM() {
  LB(wm); tA = tB; ti = 0;
  do
  :: ti < NR -> if :: hp[ti] -> tA = tA - hamt[ti] :: else fi; ti++
  :: else -> break
  od;
  if
  :: gtime && (gxs == 0 || gxs > wm) ->
     tx = GP; tj = 1;
     do
     :: tj <= wm -> tx = tx - etk[IDX(lep, tj)]; tj++
     :: else -> break
     od;
     tA = tA - tx
  :: else
  fi
}
/* ledger: the grant's expire entry */
inline LEXPIRE() {
  lsq[lep]++; ed[IDX(lep, lsq[lep])] = -grest; eh[IDX(lep, lsq[lep])] = 0; ew[IDX(lep, lsq[lep])] = NOWIN;
  gxe[IDX(lep, lsq[lep])] = 1; gxs = lsq[lep]; grest = 0
}
#define GHELD gr
#else
#define GHELD 0
#endif

/* ledger: B(k) of generation lep into tB */
inline LB(k) {
  tB = 0; tj = 1;
  do
  :: tj <= (k) -> tB = tB + ed[IDX(lep, tj)]; tj++
  :: else -> break
  od
}

/* the invariants of every state (DESIGN "The invariant", "Limits"/counter invariant) */
inline CHECK() {
  if
  :: acct && aep == lep ->
     LB(wm);
     tH = 0; ti = 0;
     do
     :: ti < NR -> if :: hp[ti] -> tH = tH + hamt[ti] :: else fi; ti++
     :: else -> break
     od;
     assert(bal + tH + GHELD == tB);       /* bal + Σ holds (+ rolled-over expiry) = B(wm) */
     tU = 0; tj = 1;
     do
     :: tj <= wm -> if :: ew[IDX(lep, tj)] == clock && ed[IDX(lep, tj)] < 0 -> tU = tU - ed[IDX(lep, tj)] :: else fi; tj++
     :: else -> break
     od;
     ti = 0;
     do
     :: ti < NR -> if :: hp[ti] && hwin[ti] == clock -> tU = tU + hamt[ti] :: else fi; ti++
     :: else -> break
     od;
     assert((uex[clock] -> U[clock] : 0) == tU);   /* the counter invariant, current window */
     /* the same, per unit: the tokens (requests) counter counts each charge's real tokens (1)
      * and each live hold's token hold (1) */
     tU = 0; tj = 1;
     do
     :: tj <= wm -> if :: ew[IDX(lep, tj)] == clock && eh[IDX(lep, tj)] > 0 -> tU = tU + ETOK(IDX(lep, tj)) :: else fi; tj++
     :: else -> break
     od;
     ti = 0;
     do
     :: ti < NR -> if :: hp[ti] && hwin[ti] == clock -> tU = tU + HTOK(ti) :: else fi; ti++
     :: else -> break
     od;
     assert((uexT[clock] -> UT[clock] : 0) == tU);   /* the counter invariant, tokens (requests) */
     /* and per end user: each end user's counter holds its own charges and holds, none of the other's */
     te = 0;
     do
     :: te < NEU ->
        tU = 0; tj = 1;
        do
        :: tj <= wm -> if :: ew[IDX(lep, tj)] == clock && eh[IDX(lep, tj)] > 0 && EU(eh[IDX(lep, tj)] - 1) == te -> tU = tU - ed[IDX(lep, tj)] :: else fi; tj++
        :: else -> break
        od;
        ti = 0;
        do
        :: ti < NR -> if :: hp[ti] && hwin[ti] == clock && EU(ti) == te -> tU = tU + hamt[ti] :: else fi; ti++
        :: else -> break
        od;
        assert((uexE[EF(te, clock)] -> UE[EF(te, clock)] : 0) == tU);   /* the counter invariant, each end user's */
        te++
     :: else -> break
     od
  :: else
  fi;
  /* ---- issue 34: per-end-user state only for holds that passed ---- */
  te = 0;
  do
  :: te < 2*NEU -> assert(!(uexE[te] && UE[te] == 0)); te++   /* no end user's counter kept at zero */
  :: else -> break
  od;
  te = 0;
  /* ---- end issue 34 ---- */
  ti = 0;
  do
  :: ti < NR -> assert(!(hp[ti] && hend[ti] && !tlost[ti])); ti++   /* no hold revived after its end */
  :: else -> break
  od;
#ifdef PLANES
  /* Redis's limits are the ledger's at their version: never newer, and at the ledger's current
   * version and epoch exactly the ledger's freeze */
  assert(!lim || limv <= lver);
  assert(!(lim && limep == lep && limv == lver) || limfz == lfz);
#endif
  assert(!acct || aep >= acctmax)          /* an acct never goes back to an older generation */
}

/* a dropped acct (with lim and u) and a dropped hold leave no stale values behind: states that
 * differ only in dead values are one state */
inline DROPACCT() {
  acct = 0; bal = 0; wm = 0; aep = 0; applied = 0; acctmax = 0;
#ifdef PLANES
  acctlv = 0;                 /* lim is not acct's: it stays (no data-plane step deletes it) */
#endif
#ifdef GRANTS
  gx = 0; gr = 0; grl = 0;
#endif
  uex[0] = 0; uex[1] = 0; U[0] = 0; U[1] = 0;
  uexT[0] = 0; uexT[1] = 0; UT[0] = 0; UT[1] = 0;
  te = 0;
  do
  :: te < 2*NEU -> uexE[te] = 0; UE[te] = 0; te++
  :: else -> break
  od;
  te = 0
}
inline HOLDCLR(r) {
  hp[r] = 0; hamt[r] = 0; hfin[r] = 0; hpin[r] = 0; hwin[r] = NOWIN
}

/* counters: a change to a missing field creates it only in the current window */
inline UADD(w, d) {
  if
  :: (w) < NOWIN && uex[w] -> U[w] = U[w] + (d)
  :: (w) < NOWIN && !uex[w] && (w) == clock -> uex[w] = 1; U[w] = (d)
  :: else
  fi
}
inline UADDT(w, d) {
  if
  :: (w) < NOWIN && uexT[w] -> UT[w] = UT[w] + (d)
  :: (w) < NOWIN && !uexT[w] && (w) == clock -> uexT[w] = 1; UT[w] = (d)
  :: else
  fi
}
/* end user e's counter of window w */
inline UADDE(e, w, d) {
  if
  :: (w) < NOWIN && uexE[EF(e, w)] -> UE[EF(e, w)] = UE[EF(e, w)] + (d)
  :: (w) < NOWIN && !uexE[EF(e, w)] && (w) == clock -> uexE[EF(e, w)] = 1; UE[EF(e, w)] = (d)
  :: else
  fi
}
/* a hold leaves every counter its record names: its amount, its token hold, its end user's
 * (tx, te: the token hold and the end user, computed first: an inline's argument cannot hold a
 * conditional expression) */
inline UOUT(r) {
  tx = HTOK(r); te = EU(r);
  UADD(hwin[r], -hamt[r]); UADDT(hwin[r], -tx); UADDE(te, hwin[r], -hamt[r]);
  /* issue 34: an end user's counter that a hold's end leaves at 0 goes (lib/limits hold_out):
   * a request that cost nothing leaves no field; a missing counter reads as 0 */
#ifndef M_EUZERO
  if :: hwin[r] < NOWIN && uexE[EF(te, hwin[r])] && UE[EF(te, hwin[r])] == 0 -> uexE[EF(te, hwin[r])] = 0 :: else fi
#else
  skip                                           /* the field stays at 0 */
#endif
}

/* ledger: the org's pending usage becomes entries, in one transaction */
inline ACCOUNT_ALL() {
  ti = 0;
  do
  :: ti < NR ->
     if
     :: ev[ti] == 1 ->
        lsq[lep]++; ed[IDX(lep, lsq[lep])] = -RCOST(ti); eh[IDX(lep, lsq[lep])] = ti + 1;
        ew[IDX(lep, lsq[lep])] = evw[ti]; ev[ti] = 2; evseq[ti] = lsq[lep];
#ifdef GRANTS
        etk[IDX(lep, lsq[lep])] = 0;
        if
        :: !rgt[ti] && gxs == 0 && grest > 0 ->   /* reserved before T: the grant is spent first */
           etk[IDX(lep, lsq[lep])] = (RCOST(ti) < grest -> RCOST(ti) : grest);
           grest = grest - etk[IDX(lep, lsq[lep])]
        :: else
        fi;
#endif
        skip
     :: else
     fi;
     ti++
  :: else -> break
  od
}

/* ledger: usage recorded for r but not settled yet (UnsettledUsage) */
#define UNSETTLED(r) (ev[r] == 1 || (ev[r] == 2 && evseq[r] > settled))

/* Lua reserve.lua: the order of checks is amount, COLD, DUPLICATE, GONE, TOO_MANY, LIMIT, INSUFFICIENT.
 * The amount is ramt[r], the token bound rtok[r]; LIMIT checks the org's money limit, its tokens
 * (requests) limit, then r's end user's money limit (each end user apart: its own counter). A LIMIT
 * or INSUFFICIENT refusal reports the room (troom): the largest amount the balance and every money
 * limit would take now (INSUFFICIENT: bal; LIMIT: min(bal, CAPL − U, CAPE − r's end user's U)), and
 * the token room (ttroom: CAPT − UT) */
inline RESERVE(r, e, st) {
  st = 0; troom = 0;
  if :: !acct || aep != (e) -> st = S_COLD :: else fi;
#ifdef PLANES
  if :: st == 0 && (!lim || limv < acctlv) -> st = S_COLD :: else fi;   /* lim missing or behind acct */
#endif
#ifndef M_DUP
  if :: st == 0 && hp[r] -> st = S_DUP :: else fi;
#endif
#ifndef M_TOMB
  if :: st == 0 && gone[r] -> st = S_GONE :: else fi;
#endif
#ifdef PLANES
  if :: st == 0 && limfz -> st = S_FROZEN :: else fi;
#endif
#ifdef GRANTS
  if
  :: st == 0 ->
#ifndef M_EXPIRY
     GROLL();
#endif
     GROOM()
  :: else
  fi;
#endif
  if
  :: st == 0 ->
     tx = 0; ti = 0;
     do
     :: ti < NR -> if :: hp[ti] && !hfin[ti] && !hpin[ti] -> tx++ :: else fi; ti++
     :: else -> break
     od;
     if :: tx >= CAP -> st = S_TOOMANY :: else fi
  :: else
  fi;
  tunit = 0;
  if
  :: st == 0 && (uex[clock] -> U[clock] : 0) + ramt[r] > CAPL -> st = S_LIMIT
  :: st == 0 && (uex[clock] -> U[clock] : 0) + ramt[r] <= CAPL && (uexT[clock] -> UT[clock] : 0) + rtok[r] > CAPT -> st = S_LIMIT; tunit = 1
  :: st == 0 && (uex[clock] -> U[clock] : 0) + ramt[r] <= CAPL && (uexT[clock] -> UT[clock] : 0) + rtok[r] <= CAPT &&
     (uexE[EF(EU(r), clock)] -> UE[EF(EU(r), clock)] : 0) + ramt[r] > CAPE -> st = S_LIMIT
  :: else
  fi;
  if
  :: st == S_LIMIT ->
     troom = CAPL - (uex[clock] -> U[clock] : 0);
     tx = CAPE - (uexE[EF(EU(r), clock)] -> UE[EF(EU(r), clock)] : 0); if :: tx < troom -> troom = tx :: else fi;
     if :: bal < troom -> troom = bal :: else fi;
     ttroom = CAPT - (uexT[clock] -> UT[clock] : 0)
  :: else
  fi;
  if :: st == 0 && bal < ramt[r] -> st = S_INSUFF; troom = bal; ttroom = CAPT - (uexT[clock] -> UT[clock] : 0) :: else fi;
  if
  :: st == 0 ->
#ifdef GRANTS
     assert(ramt[r] <= tA);                    /* no hold spends credit that has expired */
     rgt[r] = gtime;
#endif
     st = S_OK; bal = bal - ramt[r];
#ifdef PLANES
     assert(!(fzpushed && lfz));               /* a pushed freeze refuses every new hold */
#endif
     hp[r] = 1; hamt[r] = ramt[r]; hfin[r] = 0; hpin[r] = 0; hwin[r] = clock;
     UADD(clock, ramt[r]); UADDT(clock, rtok[r]);
#ifndef M_EUFIELD
     te = EU(r);
#else
     te = 0;                                   /* one counter for every end user */
#endif
     UADDE(te, clock, ramt[r])
  :: else
  fi
}

/* drop a hold inside settle: it comes back to bal and leaves its counter; the id is tombstoned */
inline SDROP(r) {
  if
  :: hp[r] -> bal = bal + hamt[r]; UOUT(r); HOLDCLR(r)
  :: else
  fi;
  gone[r] = 1; hend[r] = 1
}

/* Lua settle.lua with entries f..t of generation g -> scold, sn (settled prefix), sgap */
inline SETTLE(g, f, t) {
  scold = 0; sn = 0; sgap = 0;
  if
  :: !acct -> scold = 1
  :: acct && aep != (g) ->
     scold = 1;
#ifndef M_EPOCH
     if :: (g) > aep -> DROPACCT() :: else fi
#else
     DROPACCT()
#endif
  :: else ->
#ifdef GRANTS
     GROLL();
#endif
     ts = (f);
     do
     :: ts > (t) -> break
     :: ts <= wm ->
        if :: eh[IDX(g, ts)] > 0 -> SDROP(eh[IDX(g, ts)] - 1) :: else fi;
        sn++; ts++
#ifndef M_SEQ
     :: ts == wm + 1 ->
#else
     :: ts > wm ->
#endif
        if :: eh[IDX(g, ts)] > 0 -> SDROP(eh[IDX(g, ts)] - 1) :: else fi;
        bal = bal + ed[IDX(g, ts)];
        if
        :: ed[IDX(g, ts)] < 0 ->
#ifndef M_WIN
           UADD(ew[IDX(g, ts)], -ed[IDX(g, ts)])
#else
           UADD(clock, -ed[IDX(g, ts)])          /* charged to the settle-time window */
#endif
        :: else
        fi;
        if
        :: eh[IDX(g, ts)] > 0 ->                 /* a charge: its tokens (1 request), its end user's cost */
#ifndef M_UNIT
           tx = ETOK(IDX(g, ts));
#else
           tx = -ed[IDX(g, ts)];                 /* every counter counted as money */
#endif
           te = EU(eh[IDX(g, ts)] - 1);
           UADDT(ew[IDX(g, ts)], tx);
           UADDE(te, ew[IDX(g, ts)], -ed[IDX(g, ts)])
        :: else
        fi;
        assert((applied & (1 << ts)) == 0);     /* no entry applied twice */
        applied = applied | (1 << ts);
#ifdef GRANTS
        if :: gxe[IDX(g, ts)] -> bal = bal + gr; gr = 0; gx = 0; grl = 1 :: else fi;   /* the expiry closed */
#endif
        wm = ts; sn++; ts++
     :: else -> sgap = 1; break
     od;
#ifdef GRANTS
     /* the block: the ledger's rest read with the entries, when the watermark ends at its last */
     if
     :: !sgap && wm == lsq[g] && (g) == lep ->
        if
        :: grl && gxs == 0 -> bal = bal + gr - grest; gr = grest
        :: !grl -> gx = grest
        :: else
        fi
     :: else
     fi;
     GROLL();
#endif
     skip
  fi
}

/* Lua release.lua (reap.lua is the same body after its expiry re-check) */
inline RELEASE(r) {
  if
  :: hp[r] ->
     if :: acct -> bal = bal + hamt[r]; UOUT(r) :: else fi;
     HOLDCLR(r)
  :: else ->
#ifdef M_GATE
     if :: acct -> bal = bal + ramt[r] :: else fi   /* gives back whether or not it deleted the hold */
#else
     skip
#endif
  fi;
  gone[r] = 1; hend[r] = 1
}

/* finish moves the tokens counter from the token bound to the real count (a requests counter
 * keeps its 1: TB = TR) */
inline UFINT(r) {
#ifndef M_TOKFIN
  tx = RTOK(r) - rtok[r]; UADDT(hwin[r], tx)
#else
  skip                                           /* the tokens counter keeps the token bound */
#endif
}

/* Lua finish: only an existing, unfinished hold; bal += hold - cost, the hold becomes cost
 * (tA: the cost, computed before UADD, whose argument cannot hold a conditional expression) */
inline FINISH(r) {
#ifndef M_FIN
  if
  :: hp[r] && !hfin[r] ->
     tA = RCOST(r);
     if :: acct -> bal = bal + hamt[r] - tA; te = EU(r); UADD(hwin[r], tA - hamt[r]); UADDE(te, hwin[r], tA - hamt[r]); UFINT(r) :: else fi;
     hamt[r] = tA; hfin[r] = 1
  :: else
  fi
#else
  if
  :: hp[r] && !hfin[r] ->
     tA = RCOST(r);
     if :: acct -> bal = bal + hamt[r] - tA; te = EU(r); UADD(hwin[r], tA - hamt[r]); UADDE(te, hwin[r], tA - hamt[r]); UFINT(r) :: else fi;
     hamt[r] = tA; hfin[r] = 1
  :: !hp[r] ->                                   /* no existence check: writes the record anyway */
     if :: acct -> bal = bal - RCOST(r) :: else fi;
     hp[r] = 1; hamt[r] = RCOST(r); hfin[r] = 1; hpin[r] = 0; hwin[r] = NOWIN
  :: else
  fi
#endif
}

/* Lua seed.lua: acct of this epoch or a higher generation -> no-op; else bal = base - Σ holds */
#ifndef M_EPOCH
#define SEEDNOOP(g) (acct && aep >= (g))
#else
#define SEEDNOOP(g) (acct && aep == (g))
#endif
/* PLANES: lim is there at the snapshot's version (kv) and epoch: the seed may write */
#define LIMOK(g) (lim && limep == (g) && limv == kv)
inline SEED(g, base, W, s0, s1) {
#ifdef PLANES
#ifdef M_SEEDLIM
  /* the mutation: the seed writes lim from its snapshot (the protocol before the two planes,
   * whose floor a data loss takes with it) */
  if :: !SEEDNOOP(g) && (!lim || limep < (g) || (limep == (g) && limv < kv)) -> lim = 1; limv = kv; limfz = kfz; limep = (g) :: else fi;
#endif
#endif
  if
  :: SEEDNOOP(g) -> skip
#ifdef PLANES
  :: !SEEDNOOP(g) && !LIMOK(g) -> skip      /* NO_LIMITS (-2) or a stale snapshot (-1): nothing written */
  :: !SEEDNOOP(g) && LIMOK(g) ->
     acctlv = kv;
#else
  :: else ->
#endif
     if :: acct -> acctmax = (aep > acctmax -> aep : acctmax) :: else -> acctmax = (g) fi;
     acct = 1; aep = (g); wm = (W); bal = (base);
#ifdef GRANTS
     gx = kgx; gr = 0; grl = 0;                /* the snapshot's rest to come */
#endif
     applied = (1 << ((W) + 1)) - 1;
#ifndef M_SEEDHOLD
     ti = 0;
     do
     :: ti < NR -> if :: hp[ti] -> bal = bal - hamt[ti] :: else fi; ti++
     :: else -> break
     od;
#endif
     uex[1 - clock] = 0; U[1 - clock] = 0; uex[clock] = 1; U[clock] = (clock == 0 -> (s0) : (s1));
     ti = 0;
     do
     :: ti < NR -> if :: hp[ti] && hwin[ti] == clock -> U[clock] = U[clock] + hamt[ti] :: else fi; ti++
     :: else -> break
     od;
     /* the other counters alike: the snapshot's sums for the current window (the ledger's
      * entries of generation g up to W never change, so they are read here) + the live holds */
     uexT[1 - clock] = 0; UT[1 - clock] = 0; uexT[clock] = 1; UT[clock] = 0;
     te = 0;
     do
     :: te < NEU -> uexE[EF(te, 1 - clock)] = 0; UE[EF(te, 1 - clock)] = 0; uexE[EF(te, clock)] = 1; UE[EF(te, clock)] = 0; te++
     :: else -> break
     od;
     tj = 1;
     do
     :: tj <= (W) ->
        if
        :: eh[IDX(g, tj)] > 0 && ew[IDX(g, tj)] == clock ->
           tx = ETOK(IDX(g, tj)); te = EU(eh[IDX(g, tj)] - 1);
           UT[clock] = UT[clock] + tx; UE[EF(te, clock)] = UE[EF(te, clock)] - ed[IDX(g, tj)]
        :: else
        fi;
        tj++
     :: else -> break
     od;
     ti = 0;
     do
     :: ti < NR ->
        if
        :: hp[ti] && hwin[ti] == clock -> tx = HTOK(ti); te = EU(ti); UT[clock] = UT[clock] + tx; UE[EF(te, clock)] = UE[EF(te, clock)] + hamt[ti]
        :: else
        fi;
        ti++
     :: else -> break
     od;
     /* issue 34: seed.lua writes an end user's counter only for an end user with spend in the
      * window or a live hold in it */
     te = 0;
     do
     :: te < NEU -> if :: UE[EF(te, clock)] == 0 -> uexE[EF(te, clock)] = 0 :: else fi; te++
     :: else -> break
     od;
#ifdef GRANTS
     GROLL();                                  /* an expiry that has come rolls over at once */
#endif
     te = 0
  fi
}

/* ledger snapshot transaction: accounts the org's pending usage first, then reads balance, seq,
 * epoch and the spend per window of the entries up to seq; the caller's cached epoch is refreshed */
inline SNAPSHOT(p) {
#ifndef M_PEND
  ACCOUNT_ALL();
#endif
  kg = lep; kW = lsq[lep]; LB(kW); kb = tB; k0 = 0; k1 = 0; tj = 1;
#ifdef PLANES
  kv = lver; kfz = lfz;
#endif
#ifdef GRANTS
  kgx = grest;
#endif
  do
  :: tj <= kW ->
     if
     :: ed[IDX(lep, tj)] < 0 && ew[IDX(lep, tj)] == 0 -> k0 = k0 - ed[IDX(lep, tj)]
     :: ed[IDX(lep, tj)] < 0 && ew[IDX(lep, tj)] == 1 -> k1 = k1 - ed[IDX(lep, tj)]
     :: else
     fi;
     tj++
  :: else -> break
  od;
  if :: lep > pe[p] -> pe[p] = lep :: else fi
}

/* catch-up: read wm (HMGET), read the entries past it (ledger), re-send them through settle */
inline CATCHUP_BODY(p, who) {
  /* HMGET wm, then EntriesAfter(wm): one step (a re-send is idempotent whatever ran between) */
  d_step {
    kc = (acct -> 1 : 0); kW = wm; kg = lep; kt = lsq[lep];
    if :: lep > pe[p] -> pe[p] = lep :: else fi;
    printf("STEP %d catchup-read wm=%d cold=%d g=%d to=%d\n", who, kW, 1 - kc, kg, kt)
  };
  if
  :: kc && kt > kW -> d_step { SETTLE(kg, kW + 1, kt); printf("STEP %d catchup-settle g=%d from=%d to=%d -> cold=%d n=%d gap=%d\n", who, kg, kW + 1, kt, scold, sn, sgap); CHECK() }
  :: else
  fi
}

/* the catch-up right after a seed (Store.Warm) */
inline CATCHUP(p, who) {
#ifndef M_CATCHUP
  CATCHUP_BODY(p, who)
#else
  skip
#endif
}

/* Store.Warm: snapshot (ledger), seed (script), catch-up */
inline WARM(p, who) {
  d_step { SNAPSHOT(p); printf("STEP %d snapshot g=%d base=%d W=%d s0=%d s1=%d\n", who, kg, kb, kW, k0, k1); CHECK() };
  d_step { SEED(kg, kb, kW, k0, k1); printf("STEP %d seed g=%d base=%d W=%d s0=%d s1=%d\n", who, kg, kb, kW, k0, k1); CHECK() };
  CATCHUP(p, who)
}

/* ledger: record a usage event, idempotent by the request id */
inline LRECORD(r) {
  if :: ev[r] == 0 && !lost[r] -> ev[r] = 1; evw[r] = rwin[r] :: else fi
}

/* Which request may meet which fault. Every request may be refused, succeed, fail upstream or
 * lose its owner; the rarer faults are spread over the requests to keep the state space small
 * (-DFULL gives every request every fault). */
#ifdef FULL
#define LOSTCALL(r)    1
#define RERELEASE(r)   1
#define JOURNAL(r)     1
#define LATEFINISH(r)  1
#define DIEFINISH(r)   1
#define RECSTALL(r)    1
#else
#define LOSTCALL(r)    ((r) == 0)   /* the reserve call times out before Redis ran it */
#define RERELEASE(r)   ((r) == 0)   /* the background release is sent twice */
#define JOURNAL(r)     ((r) == 1)   /* the ledger is down when the usage is recorded */
#define LATEFINISH(r)  ((r) == 1)   /* finish is re-sent and arrives late */
#define DIEFINISH(r)   ((r) == 2)   /* the owner dies between record and finish */
#define RECSTALL(r)    ((r) == 1)   /* the record times out after the content was served */
#endif

inline KRESET() {
  d_step {
    kg = 0; kW = 0; kc = 0; kt = 0; scold = 0; sn = 0; sgap = 0; kb = 0; k0 = 0; k1 = 0;
#ifdef PLANES
    kv = 0; kfz = 0
#endif
  }
}

proctype Req(byte r; byte p) {
  byte st, tries, fit, fitt;
  byte kg, kW, kc, kt, scold, sn, sgap;
#ifdef PLANES
  byte kv; bool kfz;
#endif
  short kb, k0, k1;
#ifdef GRANTS
  short kgx;
#endif
again: skip;
  if
  :: d_step {
       RESERVE(r, pe[p], st); if :: r == 0 -> sep[r] = pe[p]; sent[r] = 1 :: else fi;
       if :: st == S_OK -> oact[r] = 1; rwin[r] = clock :: st == S_DUP -> oact[r] = 1 :: else fi;
       if
       :: FITS(r) && (st == S_INSUFF || (st == S_LIMIT && !(tunit && REQUNIT))) && troom >= FITMIN && ttroom >= 1 ->
          fit = (troom < ramt[r] -> troom : ramt[r]); fitt = (ttroom < rtok[r] -> ttroom : rtok[r])
       :: else
       fi;
       printf("STEP %d reserve r=%d ep=%d amt=%d tok=%d -> %d\n", r, r, pe[p], ramt[r], rtok[r], st);
       CHECK()
     }
  :: LOSTCALL(r) ->
     d_step { sep[r] = pe[p]; sent[r] = 1; st = S_LOST; printf("STEP %d reserve-lost r=%d ep=%d\n", r, r, pe[p]) }
  fi;
  if
  :: st == S_COLD && tries < 1 -> tries++; WARM(p, r); KRESET(); goto again
#ifdef JOBS
  :: (st == S_OK || st == S_DUP) && ISJOB(r) -> goto job
#endif
  :: (st == S_OK || st == S_DUP) && !ISJOB(r) ->        /* DUP: the hold is ours, proceed */
     if
     :: goto success
     :: goto fail                                       /* upstream failed, or the reply was lost */
     :: d_step { oact[r] = 0; alive[r] = 0; printf("STEP %d owner-dies r=%d\n", r, r) }; goto done
     fi
  :: st == S_LOST -> goto fail
  :: fit > 0 ->                                         /* fit: the same id again, with the room */
     d_step { ramt[r] = fit; rtok[r] = fitt; fit = 0; fitt = 0; tries = 0; printf("STEP %d fit r=%d amt=%d tok=%d\n", r, r, ramt[r], rtok[r]) }; goto again
  :: fit > 0 -> goto done                               /* x-escrow-fit: off (or NoFit): the refusal */
  :: else -> goto done                                  /* refused: nothing held */
  fi;
success: skip;
  if
  :: d_step {
       served[r] = 1; hrec[r] = (hp[r] -> hamt[r] : 0); LRECORD(r);
       printf("STEP %d record r=%d cost=%d amt=%d bounded=%d\n", r, r, RCOST(r), ramt[r], BOUNDED(r));
       assert(!BOUNDED(r) || RCOST(r) <= ramt[r]);    /* a bounded request's hold ≥ its cost */
       CHECK()
     }
  :: JOURNAL(r) ->
     d_step {
       served[r] = 1; hrec[r] = (hp[r] -> hamt[r] : 0); jr[r] = 1;
       printf("STEP %d journal r=%d cost=%d amt=%d bounded=%d\n", r, r, RCOST(r), ramt[r], BOUNDED(r));
       assert(!BOUNDED(r) || RCOST(r) <= ramt[r])     /* a bounded request's hold ≥ its cost */
     };
     d_step {
#ifndef M_PIN
       if :: hp[r] -> hpin[r] = 1 :: else fi;
#endif
       printf("STEP %d pin r=%d\n", r, r); CHECK()
     }
  :: RECSTALL(r) ->
     /* served ⇒ billed: the content reached the client, then the record timed out (the ledger
      * stalls; no journal). Anything may happen before the retry lands (settles, a data loss, a
      * restore): the owner lives on (its lease keeps the hold from expiring, so no reaper takes
      * it) and records the same event again until the ledger has it. */
     d_step { served[r] = 1; printf("STEP %d record-timeout r=%d cost=%d amt=%d bounded=%d\n", r, r, RCOST(r), ramt[r], BOUNDED(r)) };
#ifndef M_SERVED
     d_step {
       hrec[r] = (hp[r] -> hamt[r] : 0); LRECORD(r);
       printf("STEP %d record r=%d cost=%d amt=%d bounded=%d\n", r, r, RCOST(r), ramt[r], BOUNDED(r));
       assert(!BOUNDED(r) || RCOST(r) <= ramt[r]);
       CHECK()
     }
#else
     d_step { printf("STEP %d void r=%d\n", r, r) };
     goto fail                                          /* the old rule: voided, hold released */
#endif
  fi;
  if
  :: d_step { FINISH(r); oact[r] = 0; alive[r] = 0; printf("STEP %d finish r=%d cost=%d\n", r, r, RCOST(r)); CHECK() };
     if
     :: LATEFINISH(r) -> d_step { FINISH(r); printf("STEP %d finish r=%d cost=%d\n", r, r, RCOST(r)); CHECK() }  /* re-sent, late */
     :: skip
     fi
  :: DIEFINISH(r) -> d_step { oact[r] = 0; alive[r] = 0; printf("STEP %d owner-dies r=%d\n", r, r) }
  fi;
  if
  :: jr[r] ->
     if
     :: d_step { LRECORD(r); jr[r] = 0; printf("STEP %d replay r=%d\n", r, r); CHECK() }
     :: d_step { jr[r] = 0; if :: ev[r] == 0 -> lost[r] = 1 :: else fi; printf("STEP %d journal-lost r=%d\n", r, r) }
     fi;
     d_step { if :: hp[r] -> hpin[r] = 0 :: else fi; printf("STEP %d unpin r=%d\n", r, r); CHECK() }
  :: else
  fi;
  goto done;
#ifdef JOBS
job: skip;
  /* a background job: the upstream accepted it (or failed: released like a request); its job is
   * recorded in the ledger before the client gets its id (served: it must be billed), the
   * connection ends (nobody extends the hold for it any more), then Begin pins the hold for the
   * job. From here on the hold is the job's: the pollers below keep and settle it. */
  if
  :: goto fail
  :: d_step { jl[r] = 1; served[r] = 1; oact[r] = 0; alive[r] = 0; printf("STEP %d job r=%d\n", r, r); CHECK() };
     d_step { if :: hp[r] -> hpin[r] = 1 :: else fi; printf("STEP %d job-pin r=%d\n", r, r); CHECK() }
  fi;
  goto done;
#endif
fail: skip;
  d_step { RELEASE(r); oact[r] = 0; alive[r] = 0; printf("STEP %d release r=%d\n", r, r); CHECK() };
  if
  :: RERELEASE(r) -> d_step { RELEASE(r); printf("STEP %d release r=%d\n", r, r); CHECK() }     /* re-sent release */
  :: skip
  fi;
done: skip;
  d_step { ndone++; st = 0; tries = 0; fit = 0; fitt = 0; alive[r] = 0; oact[r] = 0 }
}

/* the Redis client re-sends r's reserve, with the same arguments, at any later time (or never) */
proctype Resend(byte r) {
  byte st;
  sent[r];
  if
  :: d_step { RESERVE(r, sep[r], st); if :: st == S_OK -> oact[r] = alive[r]; rwin[r] = clock :: else fi; printf("STEP %d resend r=%d ep=%d amt=%d tok=%d -> %d\n", 5, r, sep[r], ramt[r], rtok[r], st); CHECK() }
  :: skip
  fi;
  d_step { ndone++; st = 0 }
}

/* the accounting worker of proxy 0 */
proctype Worker() {
  byte g, f, t, att;
  byte kg, kW, kc, kt, scold, sn, sgap;
#ifdef PLANES
  byte kv; bool kfz;
#endif
  short kb, k0, k1;
#ifdef GRANTS
  short kgx;
#endif
end_w:
  do
  :: d_step {
       !resting && (ev[0] == 1 || ev[1] == 1 || ev[2] == 1) -> ACCOUNT_ALL(); printf("STEP %d account\n", 3); CHECK()
     }
  :: atomic {
       !resting && settled < lsq[lep] && !wbusy -> wbusy = 1; g = lep; f = settled + 1; t = lsq[lep];
       if :: lep > pe[0] -> pe[0] = lep :: else fi;
#ifndef NO_OOO
       if
       :: skip
       :: t > f -> f++                  /* another worker's view: it starts past an unsettled entry */
       fi;
#endif
       printf("STEP %d unsettled g=%d from=%d to=%d\n", 3, g, f, t)
     };
     att = 0;
retry: skip;
     d_step { SETTLE(g, f, t); printf("STEP %d settle g=%d from=%d to=%d -> cold=%d n=%d gap=%d\n", 3, g, f, t, scold, sn, sgap); CHECK() };
     if
     :: scold && att < 2 -> att++; WARM(0, 3); goto retry
     :: sgap && att < 2 -> att++;
        CATCHUP_BODY(0, 3);                        /* the gap heal (not switched off by M_CATCHUP) */
        goto retry
     :: else
     fi;
     if
     :: sn > 0 ->
        if
        :: d_step {
             tx = f + sn - 1; if :: tx > lsq[lep] -> tx = lsq[lep] :: else fi;
             if :: tx > settled -> settled = tx :: else fi;
             printf("STEP %d mark seq=%d\n", 3, f + sn - 1); CHECK()
           }
#ifndef NO_WCRASH
        :: d_step { printf("STEP %d worker-crash\n", 3) }        /* dies before marking */
#endif
        fi
     :: else
     fi;
     d_step {
       wbusy = 0; g = 0; f = 0; t = 0; att = 0; kg = 0; kW = 0; kc = 0; kt = 0; scold = 0; sn = 0; sgap = 0; kb = 0; k0 = 0; k1 = 0;
#ifdef PLANES
       kv = 0; kfz = 0
#endif
     }
  od
}

/* the reaper: only expired holds (owner gone, not pinned); asks the ledger, then reap.lua */
proctype Reaper() {
  byte c; bool ok;
end_r:
  do
  :: atomic {
       !resting && !rbusy && ((hp[0] && !hpin[0] && !oact[0]) || (hp[1] && !hpin[1] && !oact[1]) || (hp[2] && !hpin[2] && !oact[2])) ->
       rbusy = 1;
       if
       :: hp[0] && !hpin[0] && !oact[0] -> c = 0
       :: hp[1] && !hpin[1] && !oact[1] -> c = 1
       :: hp[2] && !hpin[2] && !oact[2] -> c = 2
       fi;
#ifndef M_REAPCHK
       ok = !UNSETTLED(c);
#else
       ok = 1;
#endif
#ifndef M_JOBCHK
       ok = ok && !JOBLIVE(c);                  /* the ledger reports a live job's hold busy */
#endif
       printf("STEP %d reap-check r=%d -> %d\n", 4, c, ok)
     };
     if
     :: ok -> d_step {
          if
          :: hp[c] && !hpin[c] ->
             assert(!UNSETTLED(c) && !jr[c]);      /* never the hold of unsettled recorded usage */
             assert(!JOBLIVE(c));                  /* never the hold of a live job */
             RELEASE(c)
          :: else
          fi;
          printf("STEP %d reap r=%d\n", 4, c); CHECK()
        }
     :: else
     fi;
     d_step { rbusy = 0; c = 0; ok = 0 }
  od
}

inline RESTORE(drop) {
  tj = 1;
  do
  :: tj + (drop) <= lsq[0] -> ed[IDX(1, tj)] = ed[IDX(0, tj)]; eh[IDX(1, tj)] = eh[IDX(0, tj)]; ew[IDX(1, tj)] = ew[IDX(0, tj)]; tj++
  :: else -> break
  od;
  lsq[1] = lsq[0] - (drop);
  if
  :: (drop) -> ti = eh[IDX(0, lsq[0])] - 1; ev[ti] = 0; lost[ti] = 1
  :: else
  fi;
  if :: settled > lsq[1] -> settled = lsq[1] :: else fi;
  lep = 1;
  printf("STEP %d restore dropped=%d\n", 6, drop); CHECK()
}

#ifdef JOBS
/* ---- jobs: a poller in each of two processes (DESIGN.md "Async work") ----
 * A poller claims the live job when its lease is free or ran out (ClaimJobs), renews the job
 * hold's pin (the lease holder keeps the hold), polls the upstream, and either gives the lease
 * back (still running) or settles the job: its usage event and the job's end in one ledger
 * transaction, once (SettleJob). A poller that crashes is the same as one that gives the lease
 * back without renewing (its lease runs out); the pin may then lapse (once) before another
 * claims the job, and the reaper may look at the hold: only the ledger's live-job check keeps
 * it (M_JOBCHK switches it off). */
proctype Poller(byte p) {
end_p:
  do
  :: atomic { !resting && jl[0] && lease == 0 -> lease = p + 1; printf("STEP %d job-claim r=0 p=%d\n", 8 + p, p) };
     if
     :: d_step { if :: hp[0] -> hpin[0] = 1 :: else fi; printf("STEP %d job-pin r=0\n", 8 + p); CHECK() }
     :: skip                                      /* the pin call failed, or the holder crashed first */
     fi;
     if
     :: d_step {
          if
          :: jl[0] -> hrec[0] = (hp[0] -> hamt[0] : 0); LRECORD(0); jl[0] = 0
          :: else
          fi;
          lease = 0;
          printf("STEP %d job-settle r=0 cost=%d amt=%d\n", 8 + p, RCOST(0), ramt[0]); CHECK()
        }
     :: d_step { lease = 0; printf("STEP %d job-poll r=0\n", 8 + p) }   /* running (or crashed): lease back / run out */
     fi
  :: d_step { !resting && jl[0] && hpin[0] && lease == 0 && !didlapse -> didlapse = 1; hpin[0] = 0; printf("STEP %d job-lapse r=0\n", 8 + p) }
  od
}
#endif

/* faults and admin actions, each at most once, at any time */
proctype Chaos() {
end_c:
  do
  :: false
#ifndef NO_FLUSH
  :: d_step {
       !resting && !didflush -> didflush = 1;
       ti = 0;
       do
       :: ti < NR -> if :: jr[ti] -> jla = jla + RCOST(ti) :: else fi;
          HOLDCLR(ti); gone[ti] = 0; tlost[ti] = 1; ti++
       :: else -> break
       od;
       DROPACCT();
#ifdef PLANES
       lim = 0; limv = 0; limfz = 0; limep = 0;
#endif
       printf("STEP %d flush\n", 6); CHECK()
     }
#endif
#ifndef NO_INVALIDATE
  :: d_step { !resting && !didinv -> didinv = 1; DROPACCT(); printf("STEP %d invalidate\n", 6); CHECK() }
#endif
#ifndef NO_CREDIT
  :: d_step {
       !resting && !didcredit -> didcredit = 1;
       lsq[lep]++; ed[IDX(lep, lsq[lep])] = CR; eh[IDX(lep, lsq[lep])] = 0; ew[IDX(lep, lsq[lep])] = NOWIN;
       printf("STEP %d credit\n", 6); CHECK()
     }
#endif
#ifndef NO_RESTORE
  /* the ledger restored from a backup taken before its last entry (when that is a charge: its
   * usage is lost), or taken just now; either way the epoch generation goes up */
  :: d_step { !resting && !didrestore && lep == 0 && eh[IDX(0, lsq[0])] > 0 -> didrestore = 1; RESTORE(1) }
  :: d_step { !resting && !didrestore && lep == 0 -> didrestore = 1; RESTORE(0) }
#endif
#ifndef NO_TICK
  :: d_step { !resting && clock == 0 -> clock = 1; printf("STEP %d tick\n", 6); CHECK() }
#endif
#ifdef PLANES
  /* a Redis data loss of lim alone (twice at most: a stale seeder may meet one after a push) */
  :: d_step { !resting && nlimloss < 2 && lim -> nlimloss++; lim = 0; limv = 0; limfz = 0; limep = 0; printf("STEP %d limloss\n", 6); CHECK() }
#endif
#ifdef GRANTS
  :: d_step { !resting && !gtime -> gtime = 1; printf("STEP %d grant-time\n", 6); CHECK() }
  /* the worker writes the expire entry once no hold reserved before T is left in Redis (so every
   * usage of one is in the ledger, or lost with its hold), accounting the pending usage first */
  :: d_step { !resting && gtime && gxs == 0 && !(hp[0] && !rgt[0]) && !(hp[1] && !rgt[1]) && !(hp[2] && !rgt[2]) ->
       ACCOUNT_ALL(); LEXPIRE(); printf("STEP %d grant-expire-entry\n", 6); CHECK() }
#endif
  od
}

#ifdef PLANES
/* lim's one writer: the admin plane's push of the ledger's limits (push_limits.lua): a no-op when
 * lim is of this epoch at this version or newer, or of a higher generation; else lim is written
 * and acct (with u) dropped, so the next seed counts under the new limits */
inline PUSH() {
  if
  :: lim && limep == lep && limv >= lver -> skip
  :: lim && limep > lep -> skip
  :: else -> DROPACCT(); lim = 1; limv = lver; limfz = lfz; limep = lep
  fi
}

/* the admin plane: a freeze (ledger, then the push; the call returns after it), and the
 * reconciler, which pushes limits that are missing or older than the ledger's */
proctype Admin() {
end_a:
  do
  :: d_step { !resting && !lfz -> lver++; lfz = 1; printf("STEP %d freeze v=%d\n", 8, lver); CHECK() };
     d_step { PUSH(); fzpushed = 1; printf("STEP %d push v=%d\n", 8, lver); CHECK() }
  :: d_step { !resting && (!lim || limv < lver || limep < lep) -> PUSH(); printf("STEP %d push v=%d\n", 8, lver); CHECK() }
  od
}
#endif

init {
  byte kg, kW, kc, kt, scold, sn, sgap;
#ifdef PLANES
  byte kv; bool kfz;
#endif
  short kb, k0, k1;
#ifdef GRANTS
  short kgx;
#endif
  short allowed, spend, allow0, allow1, sp0, sp1;
  byte cnt;
  d_step {
#ifndef GRANTS
    printf("STEP %d world b0=%d cr=%d a0=%d c0=%d a1=%d c1=%d a2=%d c2=%d cap=%d\n", 7, B0, CR, A0, C0, A1, C1, A2, C2, CAP);
#else
    printf("STEP %d world b0=%d cr=%d a0=%d c0=%d a1=%d c1=%d a2=%d c2=%d cap=%d gp=%d\n", 7, B0, CR, A0, C0, A1, C1, A2, C2, CAP, GP);
#endif
    lsq[0] = 1; ed[0] = B0; eh[0] = 0; ew[0] = NOWIN; settled = 1;
#ifdef GRANTS
    grest = GP; gx = GP;                       /* the promotional part, seeded with its rest */
    assert(GP <= B0);
#endif
    acct = 1; bal = B0; wm = 1; aep = 0; acctmax = 0; applied = 3;
#ifdef PLANES
    lim = 1; limv = 0; limfz = 0; limep = 0; acctlv = 0; lver = 0; lfz = 0;
#endif
    alive[0] = 1; alive[1] = 1; alive[2] = 1;
    uex[0] = 1; U[0] = 0; hwin[0] = NOWIN; hwin[1] = NOWIN; hwin[2] = NOWIN;
    uexT[0] = 1;   /* no end user's counter yet: a seed writes one only with spend (issue 34) */
    ramt[0] = A0; ramt[1] = A1; ramt[2] = A2;
    rtok[0] = TB(0); rtok[1] = TB(1); rtok[2] = TB(2);
    assert(C1 <= A1 && C2 <= A2)          /* a world's bounded requests cost at most their bound */
  };
  atomic {
    run Req(0, 0); run Req(1, 1);
#ifndef NO_R2
    run Req(2, 0);
#endif

    run Resend(0);
#ifdef JOBS
    run Poller(0); run Poller(1);
#endif
    run Worker(); run Reaper(); run Chaos()
#ifdef PLANES
    ; run Admin()
#endif
  };
  /* at rest: every request and re-send done, the journals replayed, every event accounted and
   * every entry marked settled, neither worker nor reaper in the middle of something */
  d_step {
    ndone == NRUN && !jr[0] && !jr[1] && !jr[2] && ev[0] != 1 && ev[1] != 1 && ev[2] != 1 && !JOBLIVE(0) &&
    settled == lsq[lep] && !wbusy && !rbusy -> resting = 1; printf("STEP %d quiesce\n", 7)
  };
#ifdef PLANES
  /* the admin plane's reconciler has pushed any limits missing from Redis */
  d_step { PUSH(); printf("STEP %d push v=%d\n", 8, lver); CHECK() };
#endif
  /* the next request (or the reconciler) drops a stale acct and reseeds a cold org */
  d_step { if :: acct && aep != lep -> DROPACCT() :: else fi; kc = (acct -> 1 : 0) };
  if
  :: !kc -> WARM(0, 7)
  :: else
  fi;
  /* the reaper takes every expired hold the ledger has no unsettled usage for */
  d_step {
    ti = 0;
    do
    :: ti < NR ->
       if
#ifndef M_REAPCHK
       :: hp[ti] && !hpin[ti] && !UNSETTLED(ti) -> RELEASE(ti)
#else
       :: hp[ti] && !hpin[ti] -> RELEASE(ti)
#endif
       :: else
       fi;
       ti++
    :: else -> break
    od;
    printf("STEP %d reap-all\n", 7);
    CHECK()
  };
#ifdef GRANTS
  /* the ledger's clock passes T + grace: the expire entry, settled */
  d_step {
    if
    :: gtime && gxs == 0 -> LEXPIRE(); SETTLE(lep, lsq[lep], lsq[lep]); assert(!scold && !sgap)
    :: else
    fi;
    printf("STEP %d grant-rest\n", 7);
    CHECK()
  };
#endif
  d_step {
    /* Redis equals the ledger */
    assert(!hp[0] && !hp[1] && !hp[2]);
    assert(acct && aep == lep && wm == lsq[lep]);
    LB(lsq[lep]);
    assert(bal == tB);
    /* every served request billed exactly once (unless its usage was lost), nothing twice */
    allowed = jla; sp0 = 0; sp1 = 0; allow0 = 0; allow1 = 0;
    ti = 0;
    do
    :: ti < NR ->
       cnt = 0; tj = 1;
       do
       :: tj <= lsq[lep] -> if :: eh[IDX(lep, tj)] == ti + 1 -> cnt++ :: else fi; tj++
       :: else -> break
       od;
       assert(cnt <= 1);
       assert(!served[ti] || lost[ti] || cnt == 1);
       if
       :: cnt == 1 ->
          spend = (RCOST(ti) > hrec[ti] -> RCOST(ti) - hrec[ti] : 0);
          allowed = allowed + spend;
          if
          :: rwin[ti] == 0 -> sp0 = sp0 + RCOST(ti); allow0 = allow0 + spend
          :: else -> sp1 = sp1 + RCOST(ti); allow1 = allow1 + spend
          fi
       :: else
       fi;
       ti++
    :: else -> break
    od;
    allow0 = allow0 + jla; allow1 = allow1 + jla;
    /* debt only within the debt rule; each window's spend within its cap + the overshoot rule */
    assert(tB >= -allowed);
    assert(sp0 <= CAPL + allow0);
    assert(sp1 <= CAPL + allow1);
    printf("STEP %d at-rest ok\n", 7)
  }
}
