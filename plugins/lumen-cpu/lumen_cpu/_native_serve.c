/* A server for one token's routed experts, asked by a GPU through a mailbox in page-locked host memory
 * (lumen_cuda/hostcall.py; Python side: lumen_cpu/hostjob.py).
 *
 * A captured GPU decode step with `experts: {compute: cpu}` crosses to the host in every MoE layer. A CUDA host node
 * does that through a driver thread, which calls Python, which calls numba's parallel region: ~100 us a crossing
 * beside the experts' own ~300 us (docs/cuda.md). Here the crossing is a few cache lines instead: the GPU writes
 * the token (x, expert ids, weights) and a job number into the mailbox, then bumps `seq`; this server's threads,
 * spinning while a step is in flight, see it, run the layer's experts (lumen_moe_worker, the same tasks and sums
 * as lumen_cpu.native.moe_token, so the same results to the bit), write the weighted sum to `out` and set
 * `done` = `seq`, which the GPU waits for.
 *
 * Jobs: one a MoE layer, registered when the step is captured (lumen_serve_add: the layer's format, shapes and
 * weight addresses; the weights must outlive the server). Threads: `threads` of them, thread 0 the leader (it
 * polls the mailbox, prepares the job, releases the others through `gen`, and sums the slots at the end). They
 * spin only while `hot`: lumen_serve_arm(n) before a step says n jobs are coming; when they are served, or after a
 * second without one, the threads sleep (the leader then polls every 2 ms, so a job asked without arming is still
 * served, late). An unknown job number sets `err` and is answered (done) with `out` untouched, so the GPU never
 * waits forever on a bad request.
 *
 * Mailbox layout (lumen_serve_layout gives the offsets; Python and the CUDA kernels read them from there):
 *   0: u64 seq (GPU), 8: u64 job (GPU), 64: u64 done (here), 72: u64 err (here), 128: f32 x[HMAX],
 *   then i64 ids[KMAX], f32 wts[KMAX], f32 out[HMAX].
 */
#if defined(__unix__) || defined(__APPLE__)
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#include "_native.h"

#define HMAX 16384
#define KMAX 64
#define MAXJOBS 1024
#define OFF_X 128
#define OFF_IDS (OFF_X + 4 * HMAX)
#define OFF_W (OFF_IDS + 8 * KMAX)
#define OFF_OUT (OFF_W + 4 * KMAX)
#define MB_BYTES (OFF_OUT + 4 * HMAX)
#define TRACE 4096 /* the last jobs' timestamps (lumen_serve_trace) */

typedef struct {
    i64 fmt, H, I, E, k, act, cgu, cd, pf;
    const i64 *A;
    const float *gs;
    const i64 *blk;
    void *server; /* lumen_serve_hostfn's argument is a job's address */
    i64 index;
} job_t;

typedef struct {
    uint8_t *mb;
    i64 nthreads;
    pthread_t *tid;
    job_t jobs[MAXJOBS];
    i64 njobs;
    float *xin, *xs, *h, *hs, *ys;
    int8_t *xq, *hq;
    i64 *ctr, *ex, *tok, *flat;
    i64 capH, capI, capK;
    _Alignas(64) i64 gen;
    _Alignas(64) i64 finished;
    _Alignas(64) i64 cur, n;
    _Alignas(64) i64 pending;
    int hot, stop;
    i64 traced, cooled;        /* jobs served (all time), times the threads cooled with jobs still armed */
    i64 trace[TRACE][5];       /* per job: job, seen, leader's part done, all parts done, answered (ns) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
} server_t;

typedef struct {
    server_t *s;
    i64 index;
} worker_arg;

static inline uint64_t *word(server_t *s, i64 off) { return (uint64_t *)(s->mb + off); }

static i64 now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (i64)t.tv_sec * 1000000000 + (i64)t.tv_nsec;
}

static double now_s(void) { return 1e-9 * (double)now_ns(); }

static void run_worker(server_t *s) {
    job_t *j = &s->jobs[s->cur];
    const float *x = j->fmt == 1 ? s->xin : (const float *)(s->mb + OFF_X);
    lumen_moe_worker(j->fmt, s->n, s->ex, s->tok, j->H, j->I, j->A, j->E, j->gs, j->blk, x, s->xq, s->xs, s->h, s->hq,
                     s->hs, s->ys, j->act, j->cgu, j->cd, j->pf, s->ctr);
}

static void cool(server_t *s) { /* armed, but nothing came for a second: the threads may sleep */
    pthread_mutex_lock(&s->mu);
    s->cooled += s->pending > 0;
    s->pending = 0;
    __atomic_store_n(&s->hot, 0, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&s->mu);
}

static void serve(server_t *s, uint64_t seq) {
    i64 *tr = s->trace[s->traced % TRACE];
    tr[1] = now_ns();
    uint64_t idx = __atomic_load_n(word(s, 8), __ATOMIC_ACQUIRE);
    if (idx >= (uint64_t)s->njobs) {
        __atomic_store_n(word(s, 72), 1 + idx, __ATOMIC_RELAXED);
        __atomic_store_n(word(s, 64), seq, __ATOMIC_RELEASE);
        return;
    }
    job_t *j = &s->jobs[idx];
    const i64 *ids = (const i64 *)(s->mb + OFF_IDS);
    const float *x = (const float *)(s->mb + OFF_X), *w = (const float *)(s->mb + OFF_W);
    i64 n = 0;
    for (i64 i = 0; i < j->k; i++)
        if (ids[i] >= 0 && ids[i] < j->E) s->ex[n] = ids[i], s->tok[n] = 0, s->flat[n++] = i;
    if (j->fmt == 1)
        lumen_nvfp4_permute(x, j->H, s->xin);
    else if (j->fmt == 2)
        lumen_quant16(x, j->H, s->xq, s->xs);
    memset(s->ctr, 0, sizeof(i64) * (size_t)(2 + n));
    s->cur = (i64)idx;
    s->n = n;
    __atomic_store_n(&s->finished, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->gen, (i64)seq, __ATOMIC_RELEASE);
    /* wake the threads that sleep (not hot): under the mutex, so that a thread between its check of gen and its
     * wait (both under the mutex) cannot miss it; an uncontended lock and a broadcast without waiters cost ~50 ns */
    pthread_mutex_lock(&s->mu);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    run_worker(s);
    tr[2] = now_ns();
    while (__atomic_load_n(&s->finished, __ATOMIC_ACQUIRE) < s->nthreads - 1) spin();
    tr[3] = now_ns();
    float *out = (float *)(s->mb + OFF_OUT);
    for (i64 c = 0; c < j->H; c++) out[c] = 0.f;
    for (i64 i = 0; i < n; i++) { /* slot order, as native.moe_token's _combine */
        const float *y = s->ys + i * j->H;
        float wi = w[s->flat[i]];
        for (i64 c = 0; c < j->H; c++) out[c] += y[c] * wi;
    }
    tr[0] = (i64)idx, tr[4] = now_ns();
    s->traced++;
    /* answer, then count the job served: once close (drain) sees no job pending, every answer is written, and an
     * asker still spinning reads it from the mailbox, which outlives this server */
    __atomic_store_n(word(s, 64), seq, __ATOMIC_RELEASE);
    pthread_mutex_lock(&s->mu);
    if (--s->pending <= 0) {
        s->pending = 0;
        __atomic_store_n(&s->hot, 0, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&s->mu);
}

static void *leader(server_t *s) {
    /* the last answer, not seq: a job asked before this thread first ran is still served */
    uint64_t last = __atomic_load_n(word(s, 64), __ATOMIC_ACQUIRE);
    double quiet = now_s();
    for (;;) {
        uint64_t seq = __atomic_load_n(word(s, 0), __ATOMIC_ACQUIRE);
        if (seq != last) {
            last = seq;
            serve(s, seq);
            quiet = now_s();
            continue;
        }
        if (__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) return NULL;
        if (__atomic_load_n(&s->hot, __ATOMIC_ACQUIRE)) {
            for (int i = 0; i < 64; i++) spin();
            if (now_s() - quiet > 1.0) cool(s); /* armed, but nothing came for a second */
            continue;
        }
        pthread_mutex_lock(&s->mu);
        if (!s->hot && !s->stop) {
            struct timespec t;
            clock_gettime(CLOCK_REALTIME, &t);
            t.tv_nsec += 2000000;
            if (t.tv_nsec >= 1000000000) t.tv_sec += 1, t.tv_nsec -= 1000000000;
            pthread_cond_timedwait(&s->cv, &s->mu, &t);
        }
        pthread_mutex_unlock(&s->mu);
        quiet = now_s();
    }
}

static void *thread_main(void *p) {
    worker_arg *a = p;
    server_t *s = a->s;
    if (a->index == 0) return leader(s);
    i64 mine = 0; /* gen's first value (a job's gen is its seq >= 1): a job published before this thread ran is run */
    for (;;) {
        i64 g = __atomic_load_n(&s->gen, __ATOMIC_ACQUIRE);
        if (g != mine) {
            mine = g;
            run_worker(s);
            __atomic_fetch_add(&s->finished, 1, __ATOMIC_RELEASE);
            continue;
        }
        if (__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) return NULL;
        if (__atomic_load_n(&s->hot, __ATOMIC_ACQUIRE)) {
            spin();
            continue;
        }
        pthread_mutex_lock(&s->mu);
        while (!s->hot && !s->stop && __atomic_load_n(&s->gen, __ATOMIC_ACQUIRE) == mine)
            pthread_cond_wait(&s->cv, &s->mu);
        pthread_mutex_unlock(&s->mu);
    }
}

void lumen_serve_free(void *p);

/* A server of `threads` threads on the mailbox at `mailbox` (MB_BYTES, zeroed by the caller); NULL on failure. */
void *lumen_serve_new(i64 mailbox, i64 threads) {
    server_t *s = calloc(1, sizeof(server_t));
    if (!s) return NULL;
    s->mb = (uint8_t *)mailbox;
    s->nthreads = threads < 1 ? 1 : threads;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    s->tid = calloc((size_t)s->nthreads, sizeof(pthread_t));
    worker_arg *args = calloc((size_t)s->nthreads, sizeof(worker_arg));
    if (!s->tid || !args) return NULL;
    for (i64 i = 0; i < s->nthreads; i++) {
        args[i].s = s, args[i].index = i;
        if (pthread_create(&s->tid[i], NULL, thread_main, &args[i])) {
            s->nthreads = i; /* join the ones started */
            lumen_serve_free(s);
            return NULL;
        }
    }
    return s; /* args live as long as the threads (freed with the process; a few bytes a server) */
}

static i64 pending_of(server_t *s) {
    pthread_mutex_lock(&s->mu);
    i64 left = s->pending;
    pthread_mutex_unlock(&s->mu);
    return left;
}

/* wait (up to `limit` seconds) until the jobs armed are served: 1, or 0 if some are still due */
static int drain(server_t *s, double limit) {
    double t0 = now_s();
    while (pending_of(s) > 0) {
        if (now_s() - t0 > limit) return 0;
        struct timespec t = {0, 100000};
        nanosleep(&t, NULL);
    }
    return 1;
}

/* Scratch for jobs up to (H, I, k). Reallocating waits for the armed jobs to be served (a warm-up's crossings may
 * still be in flight while the next layer registers): the threads read the scratch pointers while they work. */
static int grow(server_t *s, i64 H, i64 I, i64 k) {
    if (H <= s->capH && I <= s->capI && k <= s->capK) return 1;
    if (!drain(s, 10.0)) return 0;
    H = H > s->capH ? H : s->capH, I = I > s->capI ? I : s->capI, k = k > s->capK ? k : s->capK;
    free(s->xin), free(s->xs), free(s->h), free(s->hs), free(s->ys), free(s->xq), free(s->hq);
    free(s->ctr), free(s->ex), free(s->tok), free(s->flat);
    s->xin = malloc(4 * (size_t)H), s->xs = malloc(4 * (size_t)H), s->xq = malloc((size_t)H);
    s->h = malloc(4 * (size_t)(k * I)), s->hs = malloc(4 * (size_t)(k * I)), s->hq = malloc((size_t)(k * I));
    s->ys = malloc(4 * (size_t)(k * H));
    s->ctr = malloc(8 * (size_t)(k + 2)), s->ex = malloc(8 * (size_t)k), s->tok = malloc(8 * (size_t)k);
    s->flat = malloc(8 * (size_t)k);
    int ok = s->xin && s->xs && s->xq && s->h && s->hs && s->hq && s->ys && s->ctr && s->ex && s->tok && s->flat;
    s->capH = ok ? H : 0, s->capI = ok ? I : 0, s->capK = ok ? k : 0; /* a failure is retried by the next add */
    return ok;
}

/* Register a job: its index, or -1 (too many jobs, H or k past the mailbox, no memory, or larger scratch needed
 * while armed jobs stayed unserved for 10 s). fmt, A, gs, blk, act, cgu, cd, pf: as lumen_moe_worker
 * (lumen_cpu.native.moe_token). */
i64 lumen_serve_add(void *p, i64 fmt, i64 H, i64 I, i64 E, i64 k, i64 act, i64 cgu, i64 cd, i64 pf, i64 A, i64 gs,
                    i64 blk) {
    server_t *s = p;
    if (s->njobs >= MAXJOBS || H > HMAX || k > KMAX || !grow(s, H, I, k)) return -1;
    job_t *j = &s->jobs[s->njobs];
    j->fmt = fmt, j->H = H, j->I = I, j->E = E, j->k = k, j->act = act, j->cgu = cgu, j->cd = cd, j->pf = pf;
    j->A = (const i64 *)A, j->gs = (const float *)gs, j->blk = (const i64 *)blk;
    j->server = s, j->index = s->njobs;
    return s->njobs++;
}

/* n jobs are coming (a step is about to be launched): spin until they are served */
void lumen_serve_arm(void *p, i64 n) {
    server_t *s = p;
    pthread_mutex_lock(&s->mu);
    s->pending += n;
    __atomic_store_n(&s->hot, s->pending > 0, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Ask job `job` from the host (what the GPU does; tests and CUDA host nodes): inputs already in the mailbox. */
void lumen_serve_ask(void *p, i64 job) {
    server_t *s = p;
    /* the mailbox's words, not the server's: an armed job's answer may be the last thing the server does before
     * close frees it, while this thread still waits for the answer */
    uint64_t *seq_w = word(s, 0), *job_w = word(s, 8), *done_w = word(s, 64);
    uint64_t seq = __atomic_load_n(done_w, __ATOMIC_ACQUIRE) + 1;
    __atomic_store_n(job_w, (uint64_t)job, __ATOMIC_RELAXED);
    __atomic_store_n(seq_w, seq, __ATOMIC_RELEASE);
    while (__atomic_load_n(done_w, __ATOMIC_ACQUIRE) != seq) spin();
}

/* A CUDA host node's function (cuLaunchHostFunc): `job` is lumen_serve_job's address of a registered job */
void lumen_serve_hostfn(void *job) {
    job_t *j = job;
    lumen_serve_ask(j->server, j->index);
}

i64 lumen_serve_job(void *p, i64 index) { return (i64) & ((server_t *)p)->jobs[index]; }

/* Stop the threads and free the server. Jobs armed but not yet served (replays still queued on the GPU when their
 * engine is dropped: their waits would otherwise spin to their timeout) are served first, for up to 10 s. */
void lumen_serve_free(void *p) {
    server_t *s = p;
    drain(s, 10.0);
    pthread_mutex_lock(&s->mu);
    __atomic_store_n(&s->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    for (i64 i = 0; i < s->nthreads; i++) pthread_join(s->tid[i], NULL);
    free(s->xin), free(s->xs), free(s->h), free(s->hs), free(s->ys), free(s->xq), free(s->hq);
    free(s->ctr), free(s->ex), free(s->tok), free(s->flat), free(s->tid);
    free(s);
}

/* The last min(n, jobs served, TRACE) jobs' rows (job, seen, leader's part done, all parts done, answered; ns of
 * CLOCK_MONOTONIC), oldest first, into out (n x 5); stats = [jobs served, times cooled with jobs armed]. Read while
 * no job is in flight (between steps): a row being written may be torn otherwise. Returns the rows written. */
i64 lumen_serve_trace(void *p, i64 *out, i64 n, i64 *stats) {
    server_t *s = p;
    i64 total = s->traced, rows = n < total ? n : total;
    rows = rows < TRACE ? rows : TRACE;
    for (i64 r = 0; r < rows; r++) memcpy(out + 5 * r, s->trace[(total - rows + r) % TRACE], 5 * sizeof(i64));
    stats[0] = total, stats[1] = s->cooled;
    return rows;
}

/* offsets: [x, ids, wts, out, bytes, HMAX, KMAX] */
void lumen_serve_layout(i64 *out) {
    out[0] = OFF_X, out[1] = OFF_IDS, out[2] = OFF_W, out[3] = OFF_OUT, out[4] = MB_BYTES, out[5] = HMAX;
    out[6] = KMAX;
}
#endif
