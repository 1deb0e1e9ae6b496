/* Float64 dot products of float32 / bfloat16 rows with one vector, in one streaming pass.
 *
 * This is the Gram-row pass of aadl_func's window (aadl_func/_src/window.py) without the
 * float64 copy that torch needs to widen the data first: every element is widened in a
 * register and multiplied there. A product of two float32 (or bf16) numbers is exact in
 * float64 (24 + 24 significant bits <= 53), so the only rounding is float64 summation, the
 * same as converting the window to float64 and calling BLAS.
 *
 * The vector is split into blocks of `block` elements, shared among OpenMP threads (the
 * runtime torch already loaded, so the pass uses torch's thread pool); each block's dot
 * products are summed in a fixed order (eight lanes, then the tail) and the blocks are
 * added in order, so the result does not depend on the number of threads. Plain C11 with
 * GCC/Clang vector extensions, no target-specific flags: two float64 lanes per operation,
 * which keeps up with memory.
 *
 * For the steady call (aadl_func/_src/exec/steady.py) the file also has the fused append of a
 * whole params tree, the stores of its commit point and the finiteness test of its mix.
 *
 * setup.py compiles this file when the package is installed; the Python side
 * (aadl_func/_src/native.py) loads it with ctypes and checks every argument. Nothing here
 * allocates or keeps state.
 */
/* No fused multiply-adds: the scalar steps here reproduce Python's (and torch's) separately
 * rounded operations (GCC's ISO C modes never contract; clang's default would). */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define AADL_MAX_BLOCK 4096
/* How far ahead (elements) to prefetch a row: a block's rows are separate streams that
 * the hardware prefetcher picks up late on its own. */
#define AADL_PREFETCH 512

typedef float f32x2 __attribute__((vector_size(8)));
typedef uint16_t u16x2 __attribute__((vector_size(4)));
typedef uint32_t u32x2 __attribute__((vector_size(8)));
typedef double f64x2 __attribute__((vector_size(16)));

static inline f64x2 widen_f32(const float *p) {
    f32x2 x;
    memcpy(&x, p, sizeof x); /* unaligned load */
    return __builtin_convertvector(x, f64x2);
}

static inline f64x2 widen_bf16(const uint16_t *p) {
    /* bfloat16 is the upper half of a float32. */
    u16x2 x;
    memcpy(&x, p, sizeof x);
    u32x2 bits = __builtin_convertvector(x, u32x2) << 16;
    f32x2 f;
    memcpy(&f, &bits, sizeof f);
    return __builtin_convertvector(f, f64x2);
}

static inline f64x2 load_f64(const double *p) {
    f64x2 x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline double bf16_to_double(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return (double)f;
}

/* Rows are read AADL_GROUP at a time: several streams in flight keep the memory system busy
 * (one row at a time reaches about two thirds of a BLAS pass) and each float64 vector load
 * serves every row of the group. */
#define AADL_GROUP 4

/* out[g] = sum_i widen(rows[g][start + i]) * v[i], i < len, g < G (G a constant after
 * inlining). Four accumulators per row hide the add latency; they are combined in a fixed
 * order. */
#define AADL_DOT_GROUP(NAME, T, WIDEN, SCALAR)                                               \
    static inline __attribute__((always_inline)) void NAME(                                 \
        const T *const *rows, int G, int64_t start, const double *v, int64_t len, double *out) { \
        f64x2 s[AADL_GROUP][4];                                                              \
        for (int g = 0; g < G; g++)                                                          \
            for (int k = 0; k < 4; k++) s[g][k] = (f64x2){0.0, 0.0};                         \
        int64_t i = 0;                                                                       \
        for (; i + 8 <= len; i += 8) {                                                       \
            f64x2 v0 = load_f64(v + i), v1 = load_f64(v + i + 2);                            \
            f64x2 v2 = load_f64(v + i + 4), v3 = load_f64(v + i + 6);                        \
            for (int g = 0; g < G; g++) {                                                    \
                const T *a = rows[g] + start + i;                                            \
                __builtin_prefetch(a + AADL_PREFETCH);                                       \
                s[g][0] += WIDEN(a) * v0;                                                    \
                s[g][1] += WIDEN(a + 2) * v1;                                                \
                s[g][2] += WIDEN(a + 4) * v2;                                                \
                s[g][3] += WIDEN(a + 6) * v3;                                                \
            }                                                                                \
        }                                                                                    \
        for (int g = 0; g < G; g++) {                                                        \
            const T *a = rows[g] + start;                                                    \
            f64x2 t = (s[g][0] + s[g][1]) + (s[g][2] + s[g][3]);                             \
            double total = t[0] + t[1];                                                      \
            for (int64_t j = i; j < len; j++) total += SCALAR(a[j]) * v[j];                  \
            out[g] = total;                                                                  \
        }                                                                                    \
    }

#define AADL_AS_DOUBLE(x) ((double)(x))
AADL_DOT_GROUP(dot_group_f32, float, widen_f32, AADL_AS_DOUBLE)
AADL_DOT_GROUP(dot_group_bf16, uint16_t, widen_bf16, bf16_to_double)

#if defined(__x86_64__) && defined(__GNUC__)
/* dot_group_f32 four float64 lanes per operation, on CPUs with AVX2 (chosen at run time:
 * the build itself takes no target flags). Lane k of s[g][0] accumulates element i + k
 * and lane k of s[g][1] element i + 4 + k: the elements that two-lane s[g][k / 2] and
 * s[g][2 + k / 2] accumulate there, by the same products and sums (no FMA: AVX2 alone has
 * none to contract to), and the lanes are combined as there. So the same bits, in about
 * half the operations, which at a large window is what the pass is bound by. */
#define AADL_AVX2 1
typedef float f32x4 __attribute__((vector_size(16)));
typedef double f64x4 __attribute__((vector_size(32)));

__attribute__((target("avx2"), always_inline)) static inline void dot_group_f32_avx2(
    const float *const *rows, int G, int64_t start, const double *v, int64_t len, double *out) {
    f64x4 s[AADL_GROUP][2];
    for (int g = 0; g < G; g++) s[g][0] = s[g][1] = (f64x4){0.0, 0.0, 0.0, 0.0};
    int64_t i = 0;
    for (; i + 8 <= len; i += 8) {
        f64x4 v0, v1;
        memcpy(&v0, v + i, sizeof v0);
        memcpy(&v1, v + i + 4, sizeof v1);
        for (int g = 0; g < G; g++) {
            const float *a = rows[g] + start + i;
            __builtin_prefetch(a + AADL_PREFETCH);
            f32x4 x0, x1;
            memcpy(&x0, a, sizeof x0);
            memcpy(&x1, a + 4, sizeof x1);
            s[g][0] += __builtin_convertvector(x0, f64x4) * v0;
            s[g][1] += __builtin_convertvector(x1, f64x4) * v1;
        }
    }
    for (int g = 0; g < G; g++) {
        const float *a = rows[g] + start;
        f64x2 lo0 = {s[g][0][0], s[g][0][1]}, hi0 = {s[g][0][2], s[g][0][3]};
        f64x2 lo1 = {s[g][1][0], s[g][1][1]}, hi1 = {s[g][1][2], s[g][1][3]};
        f64x2 t = (lo0 + hi0) + (lo1 + hi1);
        double total = t[0] + t[1];
        for (int64_t j = i; j < len; j++) total += (double)a[j] * v[j];
        out[g] = total;
    }
}

#endif

/* sums[r] = the dot products of rows r < q with the float64 block v over [start, start + len)
 * (ATTRIBUTES: the function's, e.g. its target). */
#define AADL_BLOCK_DOTS(NAME, T, GROUP, ATTRIBUTES)                                          \
    ATTRIBUTES static void NAME(const T *const *rows, int64_t q, int64_t start,             \
                                const double *v, int64_t len, double *sums) {                \
        for (int64_t r = 0; r < q; r += AADL_GROUP) {                                        \
            /* constant group sizes, so that each call is unrolled for its size */           \
            switch (q - r < AADL_GROUP ? (int)(q - r) : AADL_GROUP) {                        \
                case 4: GROUP(rows + r, 4, start, v, len, sums + r); break;                  \
                case 3: GROUP(rows + r, 3, start, v, len, sums + r); break;                  \
                case 2: GROUP(rows + r, 2, start, v, len, sums + r); break;                  \
                default: GROUP(rows + r, 1, start, v, len, sums + r); break;                 \
            }                                                                                \
        }                                                                                    \
    }

AADL_BLOCK_DOTS(block_dots_f32_sse2, float, dot_group_f32, )
#ifdef AADL_AVX2
AADL_BLOCK_DOTS(block_dots_f32_avx2, float, dot_group_f32_avx2, __attribute__((target("avx2"))))
#endif

/* Set by aadl_portable_dots: the portable code runs even where AVX2 could. */
static volatile int64_t portable_only = 0;

/* 1 if the float32 dots run the AVX2 code (the CPU has it, and aadl_portable_dots(0) holds),
 * else 0. */
int64_t aadl_dots_avx2(void) {
#ifdef AADL_AVX2
    return !portable_only && __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

/* The portable code only (on != 0) or AVX2 where the CPU has it (on == 0, the default): for
 * the tests that compare their bits. Returns aadl_dots_avx2() after the change. */
int64_t aadl_portable_dots(int64_t on) {
    portable_only = on != 0;
    return aadl_dots_avx2();
}

static void block_dots_f32(const float *const *rows, int64_t q, int64_t start, const double *v,
                           int64_t len, double *sums) {
#ifdef AADL_AVX2
    if (aadl_dots_avx2()) {
        block_dots_f32_avx2(rows, q, start, v, len, sums);
        return;
    }
#endif
    block_dots_f32_sse2(rows, q, start, v, len, sums);
}
AADL_BLOCK_DOTS(block_dots_bf16, uint16_t, dot_group_bf16, )

/* out[r] = sum_b partial[b * q + r], blocks in order. */
static void sum_blocks(const double *partial, int64_t num_blocks, int64_t q, double *out) {
    for (int64_t r = 0; r < q; r++) out[r] = 0.0;
    for (int64_t b = 0; b < num_blocks; b++)
        for (int64_t r = 0; r < q; r++) out[r] += partial[b * q + r];
}

/* out[r] = sum_i widen(rows[r][i]) * widen(vector[i]) for r < q, i < n.
 *
 * Blocks of `block` elements are shared among `threads` OpenMP threads; partial (num_blocks
 * x q doubles, caller-provided) holds each block's sums, which are then added in block
 * order. Returns 0, or -1 if block is out of range. */
#define AADL_DOTS(NAME, T, BLOCK_DOTS, SCALAR)                                               \
    int64_t NAME(const T *const *rows, int64_t q, const T *vector, int64_t n, int64_t block, \
                 int64_t threads, double *partial, double *out) {                            \
        if (block < 1 || block > AADL_MAX_BLOCK) return -1;                                  \
        int64_t num_blocks = (n + block - 1) / block;                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                    \
        for (int64_t b = 0; b < num_blocks; b++) {                                           \
            double v[AADL_MAX_BLOCK];                                                        \
            int64_t start = b * block;                                                       \
            int64_t len = n - start < block ? n - start : block;                             \
            for (int64_t i = 0; i < len; i++) v[i] = SCALAR(vector[start + i]);              \
            BLOCK_DOTS(rows, q, start, v, len, partial + b * q);                             \
        }                                                                                    \
        sum_blocks(partial, num_blocks, q, out);                                             \
        return 0;                                                                            \
    }

AADL_DOTS(aadl_dots_f32, float, block_dots_f32, AADL_AS_DOUBLE)
AADL_DOTS(aadl_dots_bf16, uint16_t, block_dots_bf16, bf16_to_double)

/* The largest |value| of a float32's bits, as the bits of |value|: a non-negative float's
 * bits order as its value, and those of inf and NaN above every finite one. */
static inline uint32_t abs_bits(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits & 0x7fffffffu;
}

static inline double bits_value(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return (double)value;
}

/* The element loop of one block of append_leaf (below), i in [start, start + len): y, the
 * slot's new difference f (also widened into v[i - start]), the anchor, and the running
 * maxima of |y| and |f| as abs bits. The step is step[i] * scale (exactly step[i] for a
 * scale of 1). Compiled twice from one body: the portable code and, for
 * CPUs with AVX2, eight lanes per operation; elementwise IEEE operations and exact maxima, so
 * the same bytes. */
#define AADL_APPEND_BLOCK(NAME, ATTRIBUTES)                                                   \
    ATTRIBUTES static void NAME(float *newest, const float *step, float scale, float *anchor, \
                                float *residual, int64_t start, int64_t len, double *v,       \
                                uint32_t *y_max_io, uint32_t *f_max_io) {                     \
        uint32_t y_max = *y_max_io, f_max = *f_max_io;                                        \
        for (int64_t i = start; i < start + len; i++) {                                       \
            float y = newest[i];                                                              \
            if (step != NULL) {                                                               \
                y = y + step[i] * scale;                                                      \
                newest[i] = y;                                                                \
            }                                                                                 \
            float f = y - anchor[i];                                                          \
            residual[i] = f;                                                                  \
            anchor[i] = y;                                                                    \
            v[i - start] = (double)f;                                                         \
            uint32_t y_bits = abs_bits(y), f_bits = abs_bits(f);                              \
            y_max = y_bits > y_max ? y_bits : y_max;                                          \
            f_max = f_bits > f_max ? f_bits : f_max;                                          \
        }                                                                                     \
        *y_max_io = y_max;                                                                    \
        *f_max_io = f_max;                                                                    \
    }

AADL_APPEND_BLOCK(append_block_portable, )
#ifdef AADL_AVX2
AADL_APPEND_BLOCK(append_block_avx2, __attribute__((target("avx2"))))
#endif

/* The append of one float32 leaf, fused with its Gram row (and, with `step`, the plain step
 * before it):
 *
 *   y          = newest + step * scale  (float32 product and sum, rounded as torch's
 *                               step.mul_(scale) then newest.add_(step) round them; with a
 *                               scale of 1 the product is step itself), written into
 *                               newest; without step, y = newest
 *   rows[slot] = y - anchor     (float32 subtraction, rounded as torch.sub rounds it)
 *   anchor     = y
 *   out[r]     = sum_i f64(rows[r][i]) * f64(rows[slot][i])
 *
 * one pass instead of an addition, a subtraction, a copy and the Gram-row pass. With
 * `maxima` != NULL, maxima[0] and maxima[1] get max_i |y_i| and max_i |rows[slot][i]| as
 * float32 abs bits (maxima of inf and NaN are those bits). The caller guarantees that newest,
 * step, anchor and rows[slot] do not overlap but where they are one tensor. Arguments as
 * aadl_dots_f32. */
static int64_t append_leaf(float *const *rows, int64_t q, int64_t slot, float *newest,
                           const float *step, float scale, float *anchor, int64_t n,
                           int64_t block, int64_t threads, double *partial, double *out,
                           uint32_t *maxima) {
    if (block < 1 || block > AADL_MAX_BLOCK || slot < 0 || slot >= q) return -1;
    int64_t num_blocks = (n + block - 1) / block;
    float *residual = rows[slot];
    uint32_t y_max = 0, f_max = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(max : y_max, f_max)
    for (int64_t b = 0; b < num_blocks; b++) {
        double v[AADL_MAX_BLOCK];
        int64_t start = b * block;
        int64_t len = n - start < block ? n - start : block;
#ifdef AADL_AVX2
        if (aadl_dots_avx2())
            append_block_avx2(newest, step, scale, anchor, residual, start, len, v, &y_max,
                              &f_max);
        else
#endif
            append_block_portable(newest, step, scale, anchor, residual, start, len, v, &y_max,
                                  &f_max);
        block_dots_f32((const float *const *)rows, q, start, v, len, partial + b * q);
    }
    sum_blocks(partial, num_blocks, q, out);
    if (maxima != NULL) {
        maxima[0] = y_max;
        maxima[1] = f_max;
    }
    return 0;
}

/* append_leaf without the plain step and the maxima (newest is only read). */
int64_t aadl_append_f32(float *const *rows, int64_t q, int64_t slot, const float *newest,
                        float *anchor, int64_t n, int64_t block, int64_t threads,
                        double *partial, double *out) {
    return append_leaf(rows, q, slot, (float *)newest, NULL, 1.0f, anchor, n, block, threads,
                       partial, out, NULL);
}

/* The threads for one leaf's pass: those of native.py's _threads() (at most max_threads,
 * one per block, one per parallel_min row elements, at least one). */
static int64_t leaf_threads(int64_t q, int64_t n, int64_t block, int64_t max_threads,
                            int64_t parallel_min) {
    int64_t num_blocks = (n + block - 1) / block, t = q * n / parallel_min;
    if (t > num_blocks) t = num_blocks;
    if (t > max_threads) t = max_threads;
    return t < 1 ? 1 : t;
}

/* The Gram row of a whole params tree, one leaf after another, for the steady call
 * (aadl_func/_src/exec/steady.py), which otherwise makes one call per leaf and sums their
 * rows in Python; the same sums in the same order:
 *
 *   append (newest != NULL): append_leaf of each leaf l (with its plain step step[l] times
 *                            scale when step != NULL), out = row_0 + row_1 + ...
 *   dots   (newest == NULL): aadl_dots_f32 of rows[l][slot] with rows[l],
 *                            out = ((0 + row_0) + row_1) + ...
 *
 * rows[l]: leaf l's q slots; n[l] its size; partial[l] its (blocks x q) scratch; scratch
 * one more q doubles. An append sets maxima[slot] to max |rows[l][slot][i]| and maxima[q]
 * to max |y_l[i]| over every leaf and value (as doubles; inf or NaN where one is not finite),
 * which aadl_mix_f32 reads, and, once every leaf's plain step is in newest, *stepped to 1
 * (the steady call's recovery reads it: the call writes nothing else). Returns 0, or -1
 * for a bad slot or block, having written nothing. */
int64_t aadl_leaves_f32(int64_t leaves, float *const *const *rows, int64_t q, int64_t slot,
                        float *const *newest, const float *const *step, float scale,
                        float *const *anchor,
                        const int64_t *n, int64_t block, int64_t max_threads,
                        int64_t parallel_min, double *const *partial, double *scratch,
                        double *out, double *maxima, int64_t *stepped) {
    if (slot < 0 || slot >= q || block < 1 || block > AADL_MAX_BLOCK) return -1;
    if (newest == NULL)
        for (int64_t r = 0; r < q; r++) out[r] = 0.0;
    uint32_t y_max = 0, f_max = 0;
    for (int64_t l = 0; l < leaves; l++) {
        int64_t threads = leaf_threads(q, n[l], block, max_threads, parallel_min);
        int64_t code;
        if (newest != NULL) {
            uint32_t leaf_max[2];
            code = append_leaf(rows[l], q, slot, newest[l], step == NULL ? NULL : step[l],
                               scale, anchor[l], n[l], block, threads, partial[l],
                               l == 0 ? out : scratch, leaf_max);
            y_max = leaf_max[0] > y_max ? leaf_max[0] : y_max;
            f_max = leaf_max[1] > f_max ? leaf_max[1] : f_max;
        } else {
            code = aadl_dots_f32((const float *const *)rows[l], q, rows[l][slot], n[l], block,
                                 threads, partial[l], scratch);
        }
        if (code != 0) return code;
        if (newest == NULL || l > 0)
            for (int64_t r = 0; r < q; r++) out[r] += scratch[r];
    }
    if (newest != NULL) {
        maxima[slot] = bits_value(f_max);
        maxima[q] = bits_value(y_max);
        if (step != NULL) *stepped = 1;
    }
    return 0;
}

/* The writes of the steady call's commit point (aadl_func/_src/exec/steady.py), which
 * torch would do as one small operation each: row and column `slot` of the q x q
 * row-major matrices gram and dr_gram set to g and h (real symmetric Grams, so the row is
 * also the column), dr_rhs set to c, where values = [g, h, c] (3q doubles), and
 * *counters[i] = counts[i] for i < k. Plain stores: the same bytes as torch's copies. */
int64_t aadl_commit_f64(double *gram, double *dr_gram, double *dr_rhs, int64_t q, int64_t slot,
                        const double *values, int64_t *const *counters, const int64_t *counts,
                        int64_t k) {
    if (slot < 0 || slot >= q || k < 0) return -1;
    const double *g = values, *h = values + q, *c = values + 2 * q;
    for (int64_t i = 0; i < q; i++) {
        gram[slot * q + i] = g[i];
        gram[i * q + slot] = g[i];
        dr_gram[slot * q + i] = h[i];
        dr_gram[i * q + slot] = h[i];
        dr_rhs[i] = c[i];
    }
    for (int64_t i = 0; i < k; i++) *counters[i] = counts[i];
    return 0;
}

/* 1 if each of the n float32 values x[i] is finite (neither infinite nor NaN), else 0: the
 * test `-max <= min(x)` and `max(x) <= max` of float32's largest finite `max`. Shared among
 * `threads` OpenMP threads (the answer does not depend on how many). */
int64_t aadl_finite_f32(const float *x, int64_t n, int64_t threads) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) num_threads(threads)
    for (int64_t i = 0; i < n; i++) bad |= (uint32_t)((bits[i] & 0x7f800000u) == 0x7f800000u);
    return bad ? 0 : 1;
}

/* 1 if every value of the float32 vectors x[l] (n[l] values each, l < leaves) is finite,
 * else 0: aadl_finite_f32 of each in turn (stopping at the first that is not), on the
 * threads of native.py's finite_f32(): at most max_threads, one per parallel_min values. */
int64_t aadl_finite_leaves_f32(int64_t leaves, const float *const *x, const int64_t *n,
                               int64_t max_threads, int64_t parallel_min) {
    for (int64_t l = 0; l < leaves; l++) {
        int64_t threads = n[l] / parallel_min;
        threads = threads > max_threads ? max_threads : threads;
        if (!aadl_finite_f32(x[l], n[l], threads < 1 ? 1 : threads)) return 0;
    }
    return 1;
}

/* The steady call's small system, read from the committed Grams (`solve_known()`'s inputs
 * in aadl_func/_src/core/lstsq.py): with the newest residual in slot `head` of the q-slot
 * window, the slots in chronological order s_j = (head + 1 + j) mod q and the m = q - 1
 * later ones l_i = s_{i + 1}, unit = max_j gram[s_j][s_j] (the first of equal values, as
 * Python's max; 1 when it is not > 0), h[i][k] = dr_gram[l_i][l_k] / unit (m x m,
 * row-major), c[i] = dr_rhs[l_i] / unit and diag[i] = dr_gram[l_i][l_i]: one IEEE
 * division each, as Python's. The caller knows every value finite. Returns unit (-1 for
 * a bad slot). */
double aadl_system_f64(const double *gram, const double *dr_gram, const double *dr_rhs,
                       int64_t q, int64_t head, double *h, double *c, double *diag) {
    if (q < 2 || head < 0 || head >= q) return -1.0;
    int64_t m = q - 1;
    double unit = gram[((head + 1) % q) * (q + 1)];
    for (int64_t j = 1; j < q; j++) {
        double v = gram[((head + 1 + j) % q) * (q + 1)];
        if (v > unit) unit = v;
    }
    if (!(unit > 0.0)) unit = 1.0;
    for (int64_t i = 0; i < m; i++) {
        int64_t li = (head + 2 + i) % q;
        for (int64_t k = 0; k < m; k++) h[i * m + k] = dr_gram[li * q + (head + 2 + k) % q] / unit;
        c[i] = dr_rhs[li] / unit;
        diag[i] = dr_gram[li * q + li];
    }
    return unit;
}

/* The Gram rows of an append into slot `index` of a real q-slot window
 * (`window.known_rows()`): from the new residual's row g and the Gram's row of the slot
 * before, `before`, values = [g, h, c] with c_t = g_t - g_{t-1} and h_t = p_t - p_{t-1}
 * (indices mod q), p_t = g_t - before_t except p_index = c_index: one IEEE subtraction
 * each, as Python's. Returns 1 if all 3q values are finite, else 0. */
int64_t aadl_rows_f64(const double *g, const double *before, int64_t q, int64_t index,
                      double *values) {
    if (q < 1 || index < 0 || index >= q) return -1;
    double *h = values + q, *c = values + 2 * q;
    int64_t finite = 1;
    for (int64_t t = 0; t < q; t++) {
        int64_t prev = (t + q - 1) % q;
        values[t] = g[t];
        c[t] = g[t] - g[prev];
    }
    for (int64_t t = 0; t < q; t++) {
        int64_t prev = (t + q - 1) % q;
        double p_t = t == index ? c[t] : g[t] - before[t];
        double p_prev = prev == index ? c[prev] : g[prev] - before[prev];
        h[t] = p_t - p_prev;
    }
    for (int64_t t = 0; t < 3 * q; t++) finite &= isfinite(values[t]) ? 1 : 0;
    return finite;
}

/* The cut-off inverse of the small system's eigenvalues (`_cutoff_inverse()` in
 * core/lstsq.py): out_i = 1 / s_i with s_i = max(lambda_i, 0) (+ reg where reg != 0, which
 * would turn -0.0 into 0.0) if s_i > rtol, else 0 (NaN compares false: 0). One IEEE
 * operation each, as Python's. */
void aadl_inverse_f64(const double *eigvals, int64_t m, double reg, double rtol, double *out) {
    for (int64_t i = 0; i < m; i++) {
        double shifted = 0.0 > eigvals[i] ? 0.0 : eigvals[i]; /* Python's max(value, 0.0) */
        if (reg != 0.0) shifted = shifted + reg;
        out[i] = shifted > rtol ? 1.0 / shifted : 0.0;
    }
}

/* -1 for a slot outside the q = m + 1 slots, 0 when a gamma is not finite, else 1. */
static int64_t affine_checked(const double *gamma, int64_t m, int64_t head) {
    if (head < 0 || head > m) return -1;
    for (int64_t i = 0; i < m; i++)
        if (!isfinite(gamma[i])) return 0;
    return 1;
}

/* alpha_j, the j-th difference of [0, gamma_0, ..., gamma_{m-1}, 1] (`_known_affine()`). */
static double affine_weight(const double *gamma, int64_t m, int64_t j) {
    return (j < m ? gamma[j] : 1.0) - (j > 0 ? gamma[j - 1] : 0.0);
}

/* Mode "aadl"'s mixing weights in float32 and in ring order, from the small solve's gamma
 * (m values, chronological): alpha = the differences of [0, gamma, 1] (q = m + 1 values),
 * A_j = alpha_0 + ... + alpha_j (added one after another from 0), -c_j = relaxation *
 * alpha_j - A_j (`aadl_coefficients(..., negated=True)`), and out[(head + 1 + j) mod q] =
 * -c_j rounded once to float32 (`_float32_weights()`). Returns 1, or 0 (nothing written)
 * when a gamma is not finite. */
int64_t aadl_weights_f32(const double *gamma, int64_t m, double relaxation, int64_t head,
                         float *out) {
    int64_t q = m + 1, code = affine_checked(gamma, m, head);
    if (code != 1) return code;
    double total = 0.0;
    for (int64_t j = 0; j < q; j++) {
        double alpha = affine_weight(gamma, m, j);
        total = total + alpha;
        double product = relaxation * alpha;
        out[(head + 1 + j) % q] = (float)(product - total);
    }
    return 1;
}

/* Mode "classic"'s mixing weights in float32 and in ring order, from gamma as in
 * aadl_weights_f32: with alpha the differences of [0, gamma, 1] and A_j their sums added one
 * after another from 0, the points' weights w_0 = 0, w_j = -A_{j-1}
 * (`classic_coefficients()`) at out[(head + 1 + j) mod q] and the steps' relaxation *
 * alpha_j at out[q + (head + 1 + j) mod q], each rounded once to float32
 * (`_float32_weights()` of the two). Returns 1, or 0 (nothing written) when a gamma is not
 * finite. */
int64_t aadl_classic_weights_f32(const double *gamma, int64_t m, double relaxation,
                                 int64_t head, float *out) {
    int64_t q = m + 1, code = affine_checked(gamma, m, head);
    if (code != 1) return code;
    double total = 0.0;
    for (int64_t j = 0; j < q; j++) {
        double alpha = affine_weight(gamma, m, j);
        int64_t slot = (head + 1 + j) % q;
        out[slot] = j == 0 ? 0.0f : (float)(-total);
        out[q + slot] = (float)(relaxation * alpha);
        total = total + alpha;
    }
    return 1;
}

/* LAPACK's dsyevd and BLAS's dgemv (Fortran calling convention, 32-bit integers), found by
 * native.py in the library torch calls them in, and passed in by address: this file links
 * to no LAPACK of its own. */
typedef void (*aadl_syevd_fn)(const char *jobz, const char *uplo, const int *n, double *a,
                              const int *lda, double *w, double *work, const int *lwork,
                              int *iwork, const int *liwork, int *info);
typedef void (*aadl_gemv_fn)(const char *trans, const int *m, const int *n, const double *alpha,
                             const double *a, const int *lda, const double *x, const int *incx,
                             const double *beta, double *y, const int *incy);

/* The small solve's routines and working memory (native.Solver owns the buffers): m x m
 * `vectors`, m each of `eigvals`, `projected` and `gamma`, and LAPACK's `work` and `iwork`
 * of the sizes its workspace query gave (the query torch.linalg.eigh makes). */
typedef struct {
    aadl_syevd_fn syevd;
    aadl_gemv_fn gemv;
    int64_t m;
    int32_t lwork, liwork;
    double *vectors, *eigvals, *work, *projected, *gamma;
    int32_t *iwork;
} aadl_solver;

/* gamma = V inv(Lambda) V^T c for the symmetric m x m row-major h = V Lambda V^T
 * (`known_gamma()` in core/lstsq.py, with its cut-off inverse `aadl_inverse_f64`), by the
 * calls torch makes for torch.linalg.eigh(h) and the two torch.mv: h copied column-major,
 * dsyevd("V", "L") with the queried workspace, then dgemv("T") and dgemv("N") on the
 * column-major eigenvectors, and the elementwise product between them (one IEEE
 * multiplication each). The same routines on the same inputs: the same bits. Returns 0, or
 * LAPACK's non-zero `info` (the caller then lets torch raise its error). */
int64_t aadl_gamma_f64(const aadl_solver *s, const double *h, const double *c, double reg,
                       double rtol) {
    int n = (int)s->m, info = 0, one_step = 1;
    double one = 1.0, zero = 0.0;
    for (int64_t i = 0; i < s->m; i++)
        for (int64_t k = 0; k < s->m; k++) s->vectors[i + k * s->m] = h[i * s->m + k];
    s->syevd("V", "L", &n, s->vectors, &n, s->eigvals, s->work, &s->lwork, s->iwork, &s->liwork,
             &info);
    if (info != 0) return info;
    s->gemv("T", &n, &n, &one, s->vectors, &n, c, &one_step, &zero, s->projected, &one_step);
    /* the cut-off inverse into gamma (scratch until the last product) */
    aadl_inverse_f64(s->eigvals, s->m, reg, rtol, s->gamma);
    for (int64_t i = 0; i < s->m; i++) s->projected[i] = s->gamma[i] * s->projected[i];
    s->gemv("N", &n, &n, &one, s->vectors, &n, s->projected, &one_step, &zero, s->gamma,
            &one_step);
    return 0;
}

/* The steady call's whole small solve in one call: the system read from the committed
 * Grams (`aadl_system_f64` into h, c and diag), gamma for the weight reg / unit
 * (`aadl_gamma_f64`), and the float32 mixing weights in ring order into `out`
 * (`aadl_weights_f32`, or with `classic` `aadl_classic_weights_f32`). Returns 1; 0 when a
 * gamma is not finite (nothing written to `out`); -1 for a bad slot; -2 when LAPACK failed
 * (torch then raises its error). */
int64_t aadl_solve_f32(const aadl_solver *s, const double *gram, const double *dr_gram,
                       const double *dr_rhs, int64_t q, int64_t head, double reg, double rtol,
                       double relaxation, int64_t classic, double *h, double *c, double *diag,
                       float *out) {
    if (q != s->m + 1) return -1;
    double unit = aadl_system_f64(gram, dr_gram, dr_rhs, q, head, h, c, diag);
    if (unit < 0) return -1;
    if (aadl_gamma_f64(s, h, c, reg / unit, rtol) != 0) return -2;
    if (classic) return aadl_classic_weights_f32(s->gamma, s->m, relaxation, head, out);
    return aadl_weights_f32(s->gamma, s->m, relaxation, head, out);
}

/* BLAS's sgemv, as aadl_gemv_fn for float32. */
typedef void (*aadl_sgemv_fn)(const char *trans, const int *m, const int *n, const float *alpha,
                              const float *a, const int *lda, const float *x, const int *incx,
                              const float *beta, float *y, const int *incy);

/* 1 if x + sum_j w[j] s_j is finite in float32 for every order of its roundings, given
 * max |x_i| <= maxima[q] and max |s_j[i]| <= maxima[j] (j < q): their bound
 * maxima[q] + sum_j |w[j]| maxima[j], summed in float64, is at most half of float32's
 * largest finite value. Every partial sum of the terms, rounded at each step, then stays
 * below FLT_MAX by far (each rounding adds at most a relative 2^-24), so no value
 * overflows, and finite terms make no NaN. 0 if not (a bound that is inf or NaN
 * included), when only a pass over the result can tell. */
int64_t aadl_mix_bounded(const float *w, const double *maxima, int64_t q) {
    double bound = maxima[q];
    for (int64_t j = 0; j < q; j++) bound += fabs((double)w[j]) * maxima[j];
    return bound <= 0.5 * FLT_MAX ? 1 : 0;
}

/* The steady call's mix and its finiteness test, every leaf in one call: x[l] += S_l^T w
 * for leaf l's q contiguous slots S_l (q x n[l], row-major, i.e. the n[l] x q column-major
 * matrix whose columns torch.addmv_ takes as `plan.columns`), by the sgemv call torch makes
 * for it ("N", alpha = beta = 1), then aadl_finite_leaves_f32 of the mixed leaves, unless
 * aadl_mix_bounded(w, maxima, q) (maxima != NULL: the bounds of the x and the slots before
 * the mix) says they are finite. Returns 1 if every value is finite, else 0. */
int64_t aadl_mix_f32(aadl_sgemv_fn gemv, int64_t leaves, float *const *x,
                     const float *const *slots, const int64_t *n, int64_t q, const float *w,
                     const double *maxima, int64_t max_threads, int64_t parallel_min) {
    int columns = (int)q, one_step = 1;
    float one = 1.0f;
    for (int64_t l = 0; l < leaves; l++) {
        int rows = (int)n[l];
        gemv("N", &rows, &columns, &one, slots[l], &rows, w, &one_step, &one, x[l], &one_step);
    }
    if (maxima != NULL && aadl_mix_bounded(w, maxima, q)) return 1;
    return aadl_finite_leaves_f32(leaves, (const float *const *)x, n, max_threads, parallel_min);
}

/* Lets the loader check that it got this file's build (bumped with any change of API). */
int64_t aadl_dots_version(void) { return 11; }
