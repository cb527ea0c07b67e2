/* `a8_linear`: y = x @ W^T (+ bias) with the activations rounded to Q8_0 blocks, as llama.cpp computes its Q8_0 and
 * Q4_0 weights (`--quantization w8a8|w4a8`, quant/activations.py): each row of x is rounded per block of 32 values
 * (d = amax / 127, q = roundf(x * (1 / d)), in float32, `round_rows`), each block's dot product with the weight's
 * block is summed in integers (exact), and y[r, j] = sum over blocks of that sum * (dw * dx), in float32.
 *
 * Why: a weight-only product widens every weight to float before it multiplies; at 4 bits that widening, not
 * memory, bounds a decode step. Here 32 weights meet 32 activations in one `maddubs` (AVX2), as in ggml's
 * `ggml_vec_dot_q4_0_q8_0`. The integer sums are exact, so the result is the dequantized product of the rounded
 * activations (`activations.rounded_linear`, the reference it is checked against) up to float32 rounding.
 *
 * Each output takes the same operations in the same order whatever the number of rows or threads: a row's
 * result does not depend on its batch (batched == single, cache on == cache off). The weights are held as
 * quant/layout.py holds them (Q8_0: int8 q [n, k]; Q4_0: bytes [n, k / 2], low nibbles weights 0-15 of a block,
 * high nibbles 16-31, u standing for u - 8; one float16 d per block). Instruction set: AVX2 (`-march=native`)
 * or portable C; `-DA8_ISA=0` picks the portable one (the tests build each the CPU runs). Each C file of hyserve is
 * built alone (kernels.native.build; the tests build copies of it elsewhere), so the float16 and bfloat16
 * conversions below repeat products.c's.
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define TILE_ROWS 8 /* input rows sharing one pass over a tile's weight blocks */
#define GROUP 16    /* weight rows whose blocks stay in the core's cache while every input row passes */

#ifndef A8_ISA
#if defined(__AVX2__) && defined(__FMA__)
#define A8_ISA 1
#else
#define A8_ISA 0
#endif
#endif
#if A8_ISA == 1 && !(defined(__AVX2__) && defined(__FMA__))
#error "A8_ISA names an instruction set this compiler does not target"
#endif
#if A8_ISA > 0 || defined(__F16C__)
#include <immintrin.h>
#endif

static inline float h2f(uint16_t h) { /* IEEE half to float, subnormals included */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112u) << 23) | (man << 13);
    else if (!man) u = sign;
    else {
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

static inline float bf2f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f2bf(float f) { /* to nearest even, as torch's .to(torch.bfloat16); a NaN as its 0x7fc0 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Rows of x (float32, or bfloat16 when `bf16`) rounded to Q8_0 blocks: q [rows, k] int8, d [rows, k / 32] float32,
 * and per block eight int32 `corr` [rows, k / 32, 8]: 8 times the sum of each four consecutive q (the Q4_0 products
 * multiply the unsigned nibbles u and take 8 * x back, lane by lane: the same integers as (u - 8) * x). Per block:
 * amax = max |x|, d = amax / 127, q = roundf(x * (1 / d)) (0 when d is 0): ggml's `quantize_row_q8_0_ref`, but d
 * kept in float32. A NaN or infinity in a block makes its d NaN or infinite (never hidden). */
int round_rows(int rows, int k, const void *x, long x_stride, int bf16, int8_t *q, float *d, int32_t *corr) {
    if (k % BLOCK) return -1;
    const int blocks = k / BLOCK;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++) {
            float v[BLOCK], amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) {
                const long at = (long)r * x_stride + (long)b * BLOCK + i;
                v[i] = bf16 ? bf2f(((const uint16_t *)x)[at]) : ((const float *)x)[at];
                const float a = fabsf(v[i]);
                amax = (a > amax || a != a) ? a : amax;
            }
            const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
            int8_t *qb = q + (long)r * k + (long)b * BLOCK;
            for (int i = 0; i < BLOCK; i++) {
                const float t = roundf(v[i] * inv);
                qb[i] = (int8_t)(t > 127.0f ? 127 : t < -127.0f ? -127 : (t == t ? t : 0));
            }
            d[(long)r * blocks + b] = db;
            for (int lane = 0; lane < 8; lane++)
                corr[((long)r * blocks + b) * 8 + lane] =
                    8 * (qb[4 * lane] + qb[4 * lane + 1] + qb[4 * lane + 2] + qb[4 * lane + 3]);
        }
    return 0;
}

/* Per instruction set: `acc_t` (an output's accumulator), `wblock_t` (a weight block made ready: Q4_0's nibbles as
 * unsigned bytes, Q8_0's values with their magnitudes), `block_dot` (acc + (the block's integer dot with an
 * activation block) * scale), `acc_sum`. Each lane's integer sum is exact, so either form gives the same integers. */
#if A8_ISA == 1
typedef __m256 acc_t;
typedef struct { __m256i v, mag; } wblock_t;
static inline acc_t acc_zero(void) { return _mm256_setzero_ps(); }
static inline wblock_t weight_block(const int four_bit, const void *q, long j, int b, int blocks) {
    wblock_t w;
    if (four_bit) { /* weights 0-15 the low nibbles, 16-31 the high ones: 32 bytes u in 0..15 */
        const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + (j * blocks + b) * (BLOCK / 2)));
        w.v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0f));
        w.mag = w.v;
    } else {
        w.v = _mm256_loadu_si256((const __m256i *)((const int8_t *)q + (j * blocks + b) * BLOCK));
        w.mag = _mm256_abs_epi8(w.v);
    }
    return w;
}
/* Q4_0: u times x (u unsigned, `maddubs`: each pair summed into 16 bits, at most 2 * 15 * 127), pairs of those
 * into 32 bits, minus 8 times x's four (`corr`). Q8_0: |w| times x with w's sign (at most 2 * 128 * 127, no
 * saturation). Then the eight exact sums as floats, times the scale, added. */
static inline acc_t block_dot(const int four_bit, acc_t acc, wblock_t w, const int8_t *xb, const int32_t *cb,
                              __m256 scale) {
    const __m256i x = _mm256_loadu_si256((const __m256i *)xb);
    const __m256i pairs = four_bit ? _mm256_maddubs_epi16(w.v, x) : _mm256_maddubs_epi16(w.mag, _mm256_sign_epi8(x, w.v));
    __m256i sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    if (four_bit) sums = _mm256_sub_epi32(sums, _mm256_loadu_si256((const __m256i *)cb));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc);
}
static inline __m256 scale_of(float s) { return _mm256_set1_ps(s); }
static inline float acc_sum(acc_t v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}
#else
typedef float acc_t;
typedef struct { int8_t v[BLOCK]; } wblock_t;
static inline acc_t acc_zero(void) { return 0.0f; }
static inline wblock_t weight_block(const int four_bit, const void *q, long j, int b, int blocks) {
    wblock_t w;
    if (four_bit) {
        const uint8_t *qb = (const uint8_t *)q + (j * blocks + b) * (BLOCK / 2);
        for (int i = 0; i < BLOCK / 2; i++) {
            w.v[i] = (int8_t)((qb[i] & 0x0f) - 8);
            w.v[BLOCK / 2 + i] = (int8_t)((qb[i] >> 4) - 8);
        }
    } else {
        memcpy(w.v, (const int8_t *)q + (j * blocks + b) * BLOCK, BLOCK);
    }
    return w;
}
static inline acc_t block_dot(const int four_bit, acc_t acc, wblock_t w, const int8_t *xb, const int32_t *cb,
                              float scale) {
    (void)four_bit, (void)cb;
    int32_t s = 0;
    for (int i = 0; i < BLOCK; i++) s += (int32_t)w.v[i] * xb[i];
    return acc + (float)s * scale;
}
static inline float scale_of(float s) { return s; }
static inline float acc_sum(acc_t v) { return v; }
#endif

#define INLINE static inline __attribute__((always_inline))

/* y[r, j0 .. j0 + J) for input rows r < R over all blocks: each weight block made ready once for the R rows. The
 * scales of eight blocks at a time are converted and multiplied as vectors (AVX2), the same products as one by
 * one. The next tile's weights (the rows after these) are fetched ahead, a block's share per block: the hardware
 * prefetchers do not keep J interleaved rows streaming. */
INLINE void tile(const int four_bit, const int J, const int R, const void *q, const uint16_t *d, long j0, int blocks,
                 const int8_t *xq, const float *xd, const int32_t *corr, long k, float *y, long n) {
    acc_t acc[4][TILE_ROWS];
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[jj][r] = acc_zero();
    const int block_bytes = four_bit ? BLOCK / 2 : BLOCK;
    const char *next = (const char *)q + (j0 + J) * (long)blocks * block_bytes;
    int b = 0;
#if A8_ISA == 1
    for (; b + 8 <= blocks; b += 8) {
        __m256 dw8[4];
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++)
            dw8[jj] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + (j0 + jj) * blocks + b)));
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            const __m256i at = _mm256_set1_epi32(i);
            for (int line = 0; line < J * block_bytes; line += 64)
                __builtin_prefetch(next + (long)(b + i) * J * block_bytes + line, 0, 3);
#pragma GCC unroll 4
            for (int jj = 0; jj < J; jj++) {
                const wblock_t w = weight_block(four_bit, q, j0 + jj, b + i, blocks);
                const __m256 dw = _mm256_permutevar8x32_ps(dw8[jj], at);
#pragma GCC unroll 8
                for (int r = 0; r < R; r++) {
                    const __m256 dx = _mm256_set1_ps(xd[r * blocks + b + i]);
                    acc[jj][r] = block_dot(four_bit, acc[jj][r], w, xq + r * k + (long)(b + i) * BLOCK,
                                           corr + ((long)r * blocks + b + i) * 8, _mm256_mul_ps(dw, dx));
                }
            }
        }
    }
#endif
    for (; b < blocks; b++) {
        for (int line = 0; line < J * block_bytes; line += 64)
            __builtin_prefetch(next + (long)b * J * block_bytes + line, 0, 3);
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++) {
            const wblock_t w = weight_block(four_bit, q, j0 + jj, b, blocks);
            const float dw = h2f(d[(j0 + jj) * blocks + b]);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                acc[jj][r] = block_dot(four_bit, acc[jj][r], w, xq + r * k + (long)b * BLOCK,
                                       corr + ((long)r * blocks + b) * 8, scale_of(dw * xd[r * blocks + b]));
        }
    }
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) y[r * n + j0 + jj] = acc_sum(acc[jj][r]);
}

/* Weight rows side by side for R input rows: their J * R accumulators fit the registers. */
#define WEIGHT_ROWS(R) ((R) <= 2 ? 4 : (R) <= 4 ? 2 : 1)

/* Weight rows [first, last) for R input rows, WEIGHT_ROWS(R) at a time, then the rest one by one. */
INLINE void stretch(const int four_bit, const int R, const void *q, const uint16_t *d, long first, long last,
                    int blocks, const int8_t *xq, const float *xd, const int32_t *corr, long k, float *y, long n) {
    const int J = WEIGHT_ROWS(R);
    long j = first;
    for (; j + J <= last; j += J) tile(four_bit, J, R, q, d, j, blocks, xq, xd, corr, k, y, n);
    for (; j < last; j++) tile(four_bit, 1, R, q, d, j, blocks, xq, xd, corr, k, y, n);
}

/* Weight rows [first, last) for every input row: by groups of GROUP weight rows, each group passed by all the
 * input rows, TILE_ROWS at a time, while its blocks are in the core's cache (a prefill piece reads each weight
 * from memory once, not once per TILE_ROWS rows). */
INLINE void rows_stretch(const int four_bit, int rows, const void *q, const uint16_t *d, long first, long last,
                         int blocks, const int8_t *xq, const float *xd, const int32_t *corr, long k, float *y,
                         long n) {
    for (long g = first; g < last; g += GROUP) {
        const long end = g + GROUP < last ? g + GROUP : last;
        for (int r0 = 0; r0 < rows; r0 += TILE_ROWS) {
            const int8_t *xr = xq + (long)r0 * k;
            const float *dr = xd + (long)r0 * blocks;
            const int32_t *cr = corr + (long)r0 * blocks * 8;
            float *yr = y + (long)r0 * n;
            switch (rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS) {
            case 1: stretch(four_bit, 1, q, d, g, end, blocks, xr, dr, cr, k, yr, n); break;
            case 2: stretch(four_bit, 2, q, d, g, end, blocks, xr, dr, cr, k, yr, n); break;
            case 3: stretch(four_bit, 3, q, d, g, end, blocks, xr, dr, cr, k, yr, n); break;
            case 4: stretch(four_bit, 4, q, d, g, end, blocks, xr, dr, cr, k, yr, n); break;
            case 5: stretch(four_bit, 5, q, d, g, end, blocks, xr, dr, cr, k, yr, n); break;
            case 6: stretch(four_bit, 6, q, d, g, end, blocks, xr, dr, cr, k, yr, n); break;
            case 7: stretch(four_bit, 7, q, d, g, end, blocks, xr, dr, cr, k, yr, n); break;
            default: stretch(four_bit, TILE_ROWS, q, d, g, end, blocks, xr, dr, cr, k, yr, n); break;
            }
        }
    }
}

/* The instruction set this build runs: 1 AVX2, 0 portable C (for `hyserve env`). */
int a8_isa(void) { return A8_ISA; }

/* x [rows, k] (rows `x_stride` elements apart; bfloat16 when `bf16`, else float32) times the weight (`four_bit`:
 * Q4_0 bytes, else Q8_0 int8; d float16 [n, k / 32]), plus `bias` (float32, or NULL), into y [rows, n] in x's
 * dtype. `scratch`: room for rows * k int8 and rows * k / 32 float32 (the rounded rows), or NULL to allocate it.
 * 0, or -1 when k is not a whole number of blocks or memory runs out (nothing written). */
int a8_linear(int four_bit, int rows, int n, int k, const void *x, long x_stride, int bf16, const void *q,
              const uint16_t *d, const float *bias, void *y, int threads) {
    if (k % BLOCK) return -1;
    const int blocks = k / BLOCK;
    const size_t xq_bytes = ((size_t)rows * k + 63) / 64 * 64; /* then corr (as many bytes), xd, y in float32 */
    char *scratch = malloc(2 * xq_bytes + sizeof(float) * (size_t)rows * blocks + (bf16 ? sizeof(float) * (size_t)rows * n : 0));
    if (!scratch) return -1;
    int8_t *xq = (int8_t *)scratch;
    int32_t *corr = (int32_t *)(scratch + xq_bytes);
    float *xd = (float *)(scratch + 2 * xq_bytes), *yf = bf16 ? xd + (size_t)rows * blocks : (float *)y;
    round_rows(rows, k, x, x_stride, bf16, xq, xd, corr);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const long per = ((n + nt - 1) / nt + 3) / 4 * 4, first = t * per < n ? t * per : n,
                   last = first + per < n ? first + per : n;
        if (four_bit) /* a constant in each: the format's branch leaves the inner loops */
            rows_stretch(1, rows, q, d, first, last, blocks, xq, xd, corr, k, yf, n);
        else
            rows_stretch(0, rows, q, d, first, last, blocks, xq, xd, corr, k, yf, n);
        if (bf16 || bias)
            for (int r = 0; r < rows; r++)
                for (long j = first; j < last; j++) {
                    const float v = bias ? yf[(long)r * n + j] + bias[j] : yf[(long)r * n + j];
                    if (bf16) ((uint16_t *)y)[(long)r * n + j] = f2bf(v);
                    else yf[(long)r * n + j] = v;
                }
    }
    free(scratch);
    return 0;
}
