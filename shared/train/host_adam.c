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
 *
 * tandem_adamw_compact is the same update over a compact state (state_format.py: bf16 masters,
 * int8 block-quantized moments), element for element state_format.adamw_reference's arithmetic.
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

/* Run worker(arg) on `threads` threads (at most one a CHUNK of n), the calling thread one of them,
 * so a pass finishes even if no thread starts. */
static void run_pass(void *(*worker)(void *), void *arg, int64_t n, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    int64_t chunks = (n + CHUNK - 1) / CHUNK;
    if (threads > chunks) threads = chunks > 0 ? (int)chunks : 1;
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS];
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, worker, arg) == 0;
    worker(arg);
    for (int t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
}

/* hyper: scale, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, eps, lr / bias_correction1,
 * sqrt(bias_correction2). */
void tandem_adamw(float *p, float *m, float *v, const void *g, void *w, int64_t n, const float *hyper,
                 int flags, int threads) {
    job_t job;
    range_t *r = &job.base;
    r->p = p; r->m = m; r->v = v; r->g = g; r->w = w;
    r->lo = r->hi = 0;
    r->scale = hyper[0]; r->decay = hyper[1]; r->beta1c = hyper[2]; r->beta2 = hyper[3];
    r->beta2c = hyper[4]; r->eps = hyper[5]; r->step_size = hyper[6]; r->bc2_sqrt = hyper[7];
    r->flags = flags;
    job.n = n;
    job.next = 0;
    run_pass(adamw_worker, &job, n, threads);
}

/* The compact state's pass. Where the fp32 pass handles one element at a time, this one goes a
 * quantization block (BLOCK elements) at a time: an int8 block's new absmax is known only once all
 * its new moments are, so the block's m, v and p land in arrays on the stack first and each output
 * is written by a loop of its own over them. The choice of loop is made once a block, so each loop
 * is branch-free and vectorizes, and the 288 combinations of flags need no 288 copies of the update.
 * The order of every fp32 operation is adamw_reference's (torch's, one op at a time), as is the
 * rounding: rintf in the default mode is torch.round's ties-to-even, and a division stays a division. */
enum {
    C_GRAD_BF16 = 1, C_MASTER_BF16 = 2, C_KAHAN = 4, C_MOMENTS_INT8 = 8, C_WORK = 16, C_WORK_BF16 = 32,
    C_WRITE_MASTER = 64, C_WRITE_MOMENTS = 128, C_WRITE_WORK = 256
};
enum { BLOCK = 256 };
_Static_assert(CHUNK % BLOCK == 0, "a piece dealt to a thread must hold whole quantization blocks");

typedef struct {
    void *master, *comp, *m, *v, *w;
    float *m_absmax, *v_absmax;
    const void *g;
    int64_t n, index_base, next;
    float scale, decay, beta1c, beta2, beta2c, eps, step_size, bc2_sqrt;
    uint32_t seed;
    int flags;
} compact_t;

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t hash32(uint32_t x) {  /* state_format.hash32 (lowbias32) */
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static inline float dequant_signed(int8_t q, float absmax) {
    float t = fabsf((float)q) / 127.0f;
    float val = (t * t) * absmax;
    return q < 0 ? -val : val;
}

static inline float dequant_unsigned(uint8_t q, float absmax) {
    float t = (float)q / 255.0f;
    float t2 = t * t;
    return (t2 * t2) * absmax;
}

/* The largest magnitude as the largest of the bit patterns with the sign cleared: for non-negative
 * floats the two orders agree, the integer max vectorizes where a float max with NaN semantics does
 * not, and a NaN (above every infinity) wins as it does in torch's amax. */
static inline float block_absmax(const float *x, int len) {
    uint32_t top = 0;
    for (int i = 0; i < len; i++) {
        uint32_t b = f32_bits(x[i]) & 0x7fffffffu;
        top = b > top ? b : top;
    }
    return bits_f32(top);
}

static void quantize_signed(const float *x, int len, int8_t *restrict q, float *absmax) {
    float top = block_absmax(x, len);
    float safe = top > 0.0f ? top : 1.0f;
    for (int i = 0; i < len; i++) {
        float c = rintf(sqrtf(fabsf(x[i]) / safe) * 127.0f);
        q[i] = (int8_t)(int)(x[i] < 0.0f ? -c : c);
    }
    *absmax = top;
}

static void quantize_unsigned(const float *x, int len, uint8_t *restrict q, float *absmax) {
    float top = block_absmax(x, len);
    float safe = top > 0.0f ? top : 1.0f;
    for (int i = 0; i < len; i++) q[i] = (uint8_t)(int)rintf(sqrtf(sqrtf(x[i] / safe)) * 255.0f);
    *absmax = top;
}

#define COMPACT_UPDATE(GRAD_IS_BF16, MASTER_IS_BF16, INT8)                                        \
    for (int i = 0; i < len; i++) {                                                          \
        float g = (GRAD_IS_BF16 ? bf16_to_f32(((const uint16_t *)c->g)[lo + i])                \
                                : ((const float *)c->g)[lo + i]) * scale;                      \
        float m0 = INT8 ? dequant_signed(((const int8_t *)c->m)[lo + i], m_scale)              \
                        : ((const float *)c->m)[lo + i];                                       \
        float v0 = INT8 ? dequant_unsigned(((const uint8_t *)c->v)[lo + i], v_scale)           \
                        : ((const float *)c->v)[lo + i];                                       \
        float p0 = MASTER_IS_BF16 ? bf16_to_f32(((const uint16_t *)c->master)[lo + i])         \
                                  : ((const float *)c->master)[lo + i];                        \
        float m = m0 + beta1c * (g - m0);                                                      \
        float v = v0 * beta2 + (beta2c * g) * g;                                               \
        float p = p0 * decay;                                                                  \
        float denom = sqrtf(v) / bc2_sqrt + eps;                                               \
        mb[i] = m; vb[i] = v; pb[i] = p - step_size * (m / denom);                             \
    }

/* One block: elements lo .. lo + len of the call, its block lo / BLOCK. */
static void compact_block(const compact_t *c, int64_t lo, int len) {
    float mb[BLOCK] __attribute__((aligned(ALIGN)));
    float vb[BLOCK] __attribute__((aligned(ALIGN)));
    float pb[BLOCK] __attribute__((aligned(ALIGN)));
    const int flags = c->flags;
    const int64_t block = lo / BLOCK;
    const float scale = c->scale, decay = c->decay, beta1c = c->beta1c, beta2 = c->beta2, beta2c = c->beta2c;
    const float eps = c->eps, step_size = c->step_size, bc2_sqrt = c->bc2_sqrt;
    const int int8 = flags & C_MOMENTS_INT8, master_bf16 = flags & C_MASTER_BF16;
    const float m_scale = int8 ? c->m_absmax[block] : 0.0f, v_scale = int8 ? c->v_absmax[block] : 0.0f;

    switch (flags & (C_GRAD_BF16 | C_MASTER_BF16 | C_MOMENTS_INT8)) {
    case 0: COMPACT_UPDATE(0, 0, 0) break;
    case C_GRAD_BF16: COMPACT_UPDATE(1, 0, 0) break;
    case C_MASTER_BF16: COMPACT_UPDATE(0, 1, 0) break;
    case C_GRAD_BF16 | C_MASTER_BF16: COMPACT_UPDATE(1, 1, 0) break;
    case C_MOMENTS_INT8: COMPACT_UPDATE(0, 0, 1) break;
    case C_GRAD_BF16 | C_MOMENTS_INT8: COMPACT_UPDATE(1, 0, 1) break;
    case C_MASTER_BF16 | C_MOMENTS_INT8: COMPACT_UPDATE(0, 1, 1) break;
    default: COMPACT_UPDATE(1, 1, 1) break;
    }

    if (flags & C_WRITE_MOMENTS) {
        if (int8) {
            quantize_signed(mb, len, (int8_t *)c->m + lo, &c->m_absmax[block]);
            quantize_unsigned(vb, len, (uint8_t *)c->v + lo, &c->v_absmax[block]);
        } else {
            memcpy((float *)c->m + lo, mb, (size_t)len * 4);
            memcpy((float *)c->v + lo, vb, (size_t)len * 4);
        }
    }

    uint16_t *master16 = (uint16_t *)c->master + lo;
    if ((flags & C_WRITE_MASTER) && !master_bf16) {
        memcpy((float *)c->master + lo, pb, (size_t)len * 4);
    } else if ((flags & C_WRITE_MASTER) && (flags & C_KAHAN)) {
        /* The master still holds p_old: it is overwritten only here, after it was read. */
        uint16_t *comp = (uint16_t *)c->comp + lo;
        for (int i = 0; i < len; i++) {
            float p0 = bf16_to_f32(master16[i]);
            float y = bf16_to_f32(comp[i]) + (pb[i] - p0);
            uint16_t t = f32_to_bf16(p0 + y);
            comp[i] = f32_to_bf16(y - (bf16_to_f32(t) - p0));
            master16[i] = t;
        }
    } else if (flags & C_WRITE_MASTER) {
        /* The noise is indexed by the element's place in its unit (index_base), not in this call,
         * so it does not depend on how ranges or threads split the unit; 32-bit wrap-around is
         * rounding_noise's arithmetic taken mod 2^32. Non-finite values round to nearest, as in
         * bf16_stochastic (cutting a NaN's low bits off may leave an infinity, the noise's carry may
         * wrap it to -0): f32_to_bf16's result for them, an infinity's low bits being zero, spelled
         * out because gcc does not vectorize the loop with the call in it. */
        uint32_t base = (uint32_t)(c->index_base + lo), seed = c->seed;
        for (int i = 0; i < len; i++) {
            uint32_t u = f32_bits(pb[i]), mag = u & 0x7fffffffu;
            uint32_t noise = hash32((base + (uint32_t)i) * 0x9E3779B1u + seed) & 0xffffu;
            uint32_t stochastic = (u + noise) >> 16;
            uint32_t special = (u >> 16) | (mag > 0x7f800000u ? 0x40u : 0u);
            master16[i] = (uint16_t)(mag < 0x7f800000u ? stochastic : special);
        }
    }

    if ((flags & (C_WORK | C_WRITE_WORK)) != (C_WORK | C_WRITE_WORK)) return;
    /* A bf16 master written in this pass is what the device computes with, so the working copy is
     * that master, not a second rounding of p. */
    int from_master = master_bf16 && (flags & C_WRITE_MASTER);
    if (flags & C_WORK_BF16) {
        uint16_t *w = (uint16_t *)c->w + lo;
        if (from_master) memcpy(w, master16, (size_t)len * 2);
        else for (int i = 0; i < len; i++) w[i] = f32_to_bf16(pb[i]);
    } else {
        float *w = (float *)c->w + lo;
        if (from_master) for (int i = 0; i < len; i++) w[i] = bf16_to_f32(master16[i]);
        else memcpy(w, pb, (size_t)len * 4);
    }
}

static void *compact_worker(void *arg) {
    compact_t *c = (compact_t *)arg;
    for (;;) {
        int64_t lo = __atomic_fetch_add(&c->next, (int64_t)CHUNK, __ATOMIC_RELAXED);
        if (lo >= c->n) break;
        int64_t hi = lo + CHUNK < c->n ? lo + CHUNK : c->n;
        for (int64_t b = lo; b < hi; b += BLOCK) compact_block(c, b, (int)(hi - b < BLOCK ? hi - b : BLOCK));
    }
    return NULL;
}

/* One decay range of a unit, in place, as state_format.adamw_reference: master fp32 or bf16 (comp,
 * with C_KAHAN: its bf16 compensation), m/v fp32 or int8/uint8 codes with one absmax a block
 * (blocks start at element 0; the absmax pointers point at the range's first block), g bf16 or
 * fp32, w the separate working copy (C_WORK) or NULL. hyper as tandem_adamw's; seed and index_base
 * (element 0's index in its unit) make the stochastic rounding's noise. */
void tandem_adamw_compact(void *master, void *comp, void *m, void *v, float *m_absmax, float *v_absmax,
                          const void *g, void *w, int64_t n, int64_t index_base, const float *hyper, uint32_t seed,
                          int flags, int threads) {
    compact_t c = {
        .master = master, .comp = comp, .m = m, .v = v, .w = w, .m_absmax = m_absmax, .v_absmax = v_absmax,
        .g = g, .n = n, .index_base = index_base, .next = 0,
        .scale = hyper[0], .decay = hyper[1], .beta1c = hyper[2], .beta2 = hyper[3], .beta2c = hyper[4],
        .eps = hyper[5], .step_size = hyper[6], .bc2_sqrt = hyper[7], .seed = seed, .flags = flags,
    };
    run_pass(compact_worker, &c, n, threads);
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
