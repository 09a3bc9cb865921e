/* AdamW over one flat range of host memory in a single pass, on a pool of threads.
 *
 * Built and loaded at run time by host_kernel.py (gcc -O3 -march=native -ffp-contract=off);
 * called through ctypes, which releases the GIL, so the engine's thread keeps issuing GPU work
 * while this runs. One pass reads master, moments and gradient once and writes what the mode asks:
 *
 *   WRITE_STATE  the new master and moments (the update proper)
 *   WRITE_WORK   the new working copy (bf16 or fp32) of the master
 *
 * The math is torch.optim.AdamW's (decoupled decay, lerp for the first moment, bias correction
 * folded into step_size and bc2_sqrt), with the clip coefficient multiplied into the gradient
 * first, as clip_grad_norm_ does. Every element goes through the same expression in every mode,
 * and contraction into FMAs is off, so a WRITE_WORK-only pass produces the bits a later
 * WRITE_STATE pass stores as the master (host_kernel.py's preview/commit split relies on it).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

enum { GRAD_BF16 = 1, WORK_BF16 = 2, WRITE_STATE = 4, WRITE_WORK = 8 };
enum { MAX_THREADS = 256, ALIGN = 64 };

typedef struct {
    float *p, *m, *v;
    const void *g;
    void *w;
    int64_t lo, hi;
    float scale, decay, beta1c, beta2, beta2c, eps, step_size, bc2_sqrt;
    int flags;
} range_t;

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even, NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t quiet = (u >> 16) | 0x40u;
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u) ? quiet : rounded);
}

#define ADAMW_LOOP(GRAD_IS_BF16, WORK_IS_BF16, STATE, WORK)                                   \
    for (int64_t i = r->lo; i < r->hi; i++) {                                                \
        float g = (GRAD_IS_BF16 ? bf16_to_f32(((const uint16_t *)r->g)[i])                   \
                                : ((const float *)r->g)[i]) * r->scale;                      \
        float m = r->m[i] + r->beta1c * (g - r->m[i]);                                       \
        float v = r->v[i] * r->beta2 + r->beta2c * g * g;                                    \
        float p = r->p[i] * r->decay;                                                         \
        float denom = sqrtf(v) / r->bc2_sqrt + r->eps;                                       \
        p = p - r->step_size * (m / denom);                                                  \
        if (STATE) { r->p[i] = p; r->m[i] = m; r->v[i] = v; }                                \
        if (WORK) {                                                                          \
            if (WORK_IS_BF16) ((uint16_t *)r->w)[i] = f32_to_bf16(p);                        \
            else ((float *)r->w)[i] = p;                                                     \
        }                                                                                    \
    }

/* Each combination gets its own loop so that the compiler vectorizes each without branches. */
#define ADAMW_CASE(GB, WB)                                                                   \
    if ((r->flags & (WRITE_STATE | WRITE_WORK)) == (WRITE_STATE | WRITE_WORK)) {             \
        ADAMW_LOOP(GB, WB, 1, 1)                                                             \
    } else if (r->flags & WRITE_STATE) {                                                     \
        ADAMW_LOOP(GB, WB, 1, 0)                                                             \
    } else {                                                                                 \
        ADAMW_LOOP(GB, WB, 0, 1)                                                             \
    }

static void *adamw_range(void *arg) {
    const range_t *r = (const range_t *)arg;
    int gb = r->flags & GRAD_BF16, wb = r->flags & WORK_BF16;
    if (gb && wb) { ADAMW_CASE(1, 1) }
    else if (gb) { ADAMW_CASE(1, 0) }
    else if (wb) { ADAMW_CASE(0, 1) }
    else { ADAMW_CASE(0, 0) }
    return NULL;
}

/* The pass is dealt out in CHUNK-element pieces from a shared counter, not split into one fixed
 * range per thread: in a training step the engine's own thread and the CUDA driver's share the
 * cores with this pool, and with fixed ranges the one thread that loses its core sets the pass's
 * time. Elements are independent, so the split does not change a bit of the result. */
enum { CHUNK = 1 << 16 };

typedef struct {
    range_t base;  /* everything but lo/hi */
    int64_t n, next;
} job_t;

static void *adamw_worker(void *arg) {
    job_t *job = (job_t *)arg;
    range_t r = job->base;
    for (;;) {
        int64_t lo = __atomic_fetch_add(&job->next, (int64_t)CHUNK, __ATOMIC_RELAXED);
        if (lo >= job->n) break;
        r.lo = lo;
        r.hi = lo + CHUNK < job->n ? lo + CHUNK : job->n;
        adamw_range(&r);
    }
    return NULL;
}

/* hyper: scale, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, lr / bias_correction1,
 * sqrt(bias_correction2). The calling thread works too, so a pass finishes even if no thread starts. */
void tandem_adamw(float *p, float *m, float *v, const void *g, void *w, int64_t n, const float *hyper,
                 int flags, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int64_t chunks = (n + CHUNK - 1) / CHUNK;
    if (threads > chunks) threads = chunks > 0 ? (int)chunks : 1;
    job_t job;
    range_t *r = &job.base;
    r->p = p; r->m = m; r->v = v; r->g = g; r->w = w;
    r->lo = r->hi = 0;
    r->scale = hyper[0]; r->decay = hyper[1]; r->beta1c = hyper[2]; r->beta2 = hyper[3];
    r->beta2c = hyper[4]; r->eps = hyper[5]; r->step_size = hyper[6]; r->bc2_sqrt = hyper[7];
    r->flags = flags;
    job.n = n;
    job.next = 0;
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, adamw_worker, &job) == 0;
    adamw_worker(&job);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
}

/* Host memory bandwidth on the same pool of threads: op 0 reads n floats (an XOR of their bits, so
 * nothing folds away), op 1 writes n floats (values that depend on the index, so the loop never
 * becomes a memset with streaming stores), op 2 copies (XOR with a run-time zero, never a memcpy).
 * These are the access patterns of the AdamW loop: ordinary loads and stores. Returns the XOR. */
typedef struct {
    uint32_t *dst;
    const uint32_t *src;
    int64_t lo, hi;
    int op;
    uint32_t seed, result;
} bench_t;

static void *bench_range(void *arg) {
    bench_t *b = (bench_t *)arg;
    uint32_t acc = 0;
    if (b->op == 0) {
        for (int64_t i = b->lo; i < b->hi; i++) acc ^= b->src[i];
    } else if (b->op == 1) {
        for (int64_t i = b->lo; i < b->hi; i++) b->dst[i] = (uint32_t)i ^ b->seed;
    } else {
        for (int64_t i = b->lo; i < b->hi; i++) b->dst[i] = b->src[i] ^ b->seed;
    }
    b->result = acc;
    return NULL;
}

uint32_t tandem_membench(int op, void *dst, const void *src, int64_t n, int threads, uint32_t seed) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int64_t per = (n + threads - 1) / threads;
    per = (per + ALIGN - 1) / ALIGN * ALIGN;
    bench_t ranges[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    int count = 0;
    for (int64_t lo = 0; lo < n; lo += per, count++) {
        bench_t *b = &ranges[count];
        b->dst = (uint32_t *)dst; b->src = (const uint32_t *)src;
        b->lo = lo; b->hi = lo + per < n ? lo + per : n;
        b->op = op; b->seed = seed; b->result = 0;
    }
    for (int t = 1; t < count; t++)
        started[t] = pthread_create(&ids[t], NULL, bench_range, &ranges[t]) == 0;
    if (count) bench_range(&ranges[0]);
    uint32_t acc = count ? ranges[0].result : 0;
    for (int t = 1; t < count; t++) {
        if (started[t]) pthread_join(ids[t], NULL);
        else bench_range(&ranges[t]);
        acc ^= ranges[t].result;
    }
    return acc;
}
