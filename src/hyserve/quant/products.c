/* `q8_products` (and `q4_products`): y = x @ W^T for a few float32 rows x [rows, k] against a weight held as
 * GGUF's Q8_0 values (quant/layout.py): int8 q [n, k] row-major and one float16 scale d [n, k / 32] per block
 * of 32 weights along k, W[j, i] = d[j, i / 32] * q[j, i]. Sums in float32; the caller rounds to the
 * activation's dtype.
 *
 * The formula of one output y[r, j] (`dot_q8`, `dot_q4`, per instruction set): per block, the 32 products of
 * the exact weights with x summed in a fixed order into a partial s, then acc += scale * s, then acc's lanes
 * added in a fixed order. The products run it weight-stationary (`tile`): each block of weights is widened to
 * float once and applied to every input row (up to `TILE_ROWS` at a time, each with accumulators of its own),
 * and a few weight rows run side by side so that one input row has independent chains to overlap. Each
 * output still takes exactly its formula's operations in its formula's order: a row's result does not depend
 * on its batch (batched == single, cache on == cache off), and it equals `q8_reference` (the per-output loop
 * the tests compare against) bit for bit.
 *
 * Each thread streams its own contiguous stretch of W's rows. The instruction set is the compiler's
 * (`-march=native`): AVX512F, else AVX2 with FMA, else portable C; `-DPRODUCTS_ISA=0|1|2` picks a lower one
 * (the tests build each that the CPU runs). VNNI's int8 products are not used: they need int8 activations,
 * which would change the results (weight-only quantization keeps the activations as they are).
 *
 * tests/test_quant.py's wrong-build test weights the first `scale = h2f(d[b])` line after each instruction
 * set's `dot_q8` / `dot_q4` by the next block's scale: that line is the one in `block_q8` / `block_q4`, which
 * every instruction set's products run (the reference functions spell theirs inline, and each format's block
 * follows its references).
 */
/* Every product and sum rounded as written, never fused into an FMA by the compiler: whether GCC fuses a * b + c
 * depends on its tuning for the CPU (it avoids FMA chains on AMD's), so a fused formula would differ between
 * builds. The vector paths spell their FMAs out; the portable one is then the C standard's arithmetic, the same
 * on every compiler and the same as on the CPUs without FMA that run it. */
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
#define TILE_ROWS 8 /* input rows sharing one pass over the weights */

#ifndef PRODUCTS_ISA
#if defined(__AVX512F__)
#define PRODUCTS_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define PRODUCTS_ISA 1
#else
#define PRODUCTS_ISA 0
#endif
#endif
#if (PRODUCTS_ISA == 2 && !defined(__AVX512F__)) || (PRODUCTS_ISA == 1 && !(defined(__AVX2__) && defined(__FMA__)))
#error "PRODUCTS_ISA names an instruction set this compiler does not target"
#endif

#if PRODUCTS_ISA > 0 || defined(__F16C__)
#include <immintrin.h>
#endif

static inline float h2f(uint16_t h) { /* IEEE half to float, subnormals included (exact: the same float) */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) u = sign | 0x7f800000u | (man << 13);
    else if (exp) u = sign | ((exp + 112u) << 23) | (man << 13);
    else if (!man) u = sign;
    else { /* subnormal: normalise */
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

/* Per instruction set: `vec` (an accumulator), the formula's pieces for the tiles (`weights_*`: a block's 32
 * weights as floats, CHUNKS vectors; `block_sum`: the block's partial s against one input row; `scaled_add`;
 * `lanes_sum`), `WEIGHT_ROWS(R)`: weight rows a tile runs side by side with R input rows (their accumulators
 * fit the registers). */
#if PRODUCTS_ISA == 2
typedef __m512 vec;
#define CHUNKS 2
#define WEIGHT_ROWS(R) ((R) <= 4 ? 4 : 2)
static inline vec vzero(void) { return _mm512_setzero_ps(); }
static inline void weights_q8(const int8_t *qb, vec w[CHUNKS]) {
    w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qb)));
    w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 16))));
}
static inline void weights_q4(const uint8_t *qb, vec w[CHUNKS]) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qb), low = _mm_set1_epi8(0x0f);
    const __m512 eight = _mm512_set1_ps(8.0f);
    w[0] = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low))), eight);
    w[1] = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low))), eight);
}
static inline vec block_sum(const vec w[CHUNKS], const float *xb) {
    return _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w[0], _mm512_loadu_ps(xb)));
}
static inline vec scaled_add(vec acc, float scale, vec s) { return _mm512_fmadd_ps(_mm512_set1_ps(scale), s, acc); }
static inline float lanes_sum(vec v) { return _mm512_reduce_add_ps(v); }
#elif PRODUCTS_ISA == 1
typedef __m256 vec;
#define CHUNKS 4
#define WEIGHT_ROWS(R) ((R) <= 2 ? 4 : (R) <= 4 ? 2 : 1)
static inline vec vzero(void) { return _mm256_setzero_ps(); }

static inline float hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 p = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(p, _mm_shuffle_ps(p, p, 1)));
}

static inline __m256 widen8(const int8_t *q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)q)));
}

static inline __m256 widen4(__m128i nibbles) { /* the low 8 bytes, each 0..15, as floats -8..7 */
    return _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(nibbles)), _mm256_set1_ps(8.0f));
}

static inline void weights_q8(const int8_t *qb, vec w[CHUNKS]) {
    for (int c = 0; c < CHUNKS; c++) w[c] = widen8(qb + 8 * c);
}
static inline void weights_q4(const uint8_t *qb, vec w[CHUNKS]) { /* u - 8 in bytes, then as weights_q8 */
    const __m128i raw = _mm_loadu_si128((const __m128i *)qb), low = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(raw, low), eight);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), low), eight);
    w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
    w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
    w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
    w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
static inline vec block_sum(const vec w[CHUNKS], const float *xb) {
    __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xb));
    s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), s);
    s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), s);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), s);
}
static inline vec scaled_add(vec acc, float scale, vec s) { return _mm256_fmadd_ps(_mm256_set1_ps(scale), s, acc); }
static inline float lanes_sum(vec v) { return hsum8(v); }
#else
typedef float vec;
#define CHUNKS BLOCK /* a "vector" of one lane: the block's 32 weights one by one */
#define WEIGHT_ROWS(R) ((R) == 1 ? 4 : (R) == 2 ? 2 : 1)
static inline vec vzero(void) { return 0.0f; }
static inline void weights_q8(const int8_t *qb, vec w[CHUNKS]) {
    for (int i = 0; i < BLOCK; i++) w[i] = (float)qb[i];
}
static inline void weights_q4(const uint8_t *qb, vec w[CHUNKS]) {
    for (int i = 0; i < BLOCK / 2; i++) w[i] = (float)((qb[i] & 0x0f) - 8);
    for (int i = 0; i < BLOCK / 2; i++) w[BLOCK / 2 + i] = (float)((qb[i] >> 4) - 8);
}
static inline vec block_sum(const vec w[CHUNKS], const float *xb) {
    float s = 0.0f;
    for (int i = 0; i < BLOCK; i++) s += w[i] * xb[i];
    return s;
}
static inline vec scaled_add(vec acc, float scale, vec s) {
    acc += scale * s;
    return acc;
}
static inline float lanes_sum(vec v) { return v; }
#endif

/* Q8_0: the formula of one output as the products ran it before the tiles (the reference), then a block as the
 * tiles load it. */
#if PRODUCTS_ISA == 2
static float dot_q8(const int8_t *q, const uint16_t *d, const float *x, int blocks) {
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int8_t *qb = q + (long)b * BLOCK;
        const float *xb = x + (long)b * BLOCK;
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)qb)));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qb + 16))));
        const __m512 s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
        acc = _mm512_fmadd_ps(_mm512_set1_ps(h2f(d[b])), s, acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#elif PRODUCTS_ISA == 1
static float dot_q8(const int8_t *q, const uint16_t *d, const float *x, int blocks) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const int8_t *qb = q + (long)b * BLOCK;
        const float *xb = x + (long)b * BLOCK;
        __m256 s = _mm256_mul_ps(widen8(qb), _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(widen8(qb + 8), _mm256_loadu_ps(xb + 8), s);
        s = _mm256_fmadd_ps(widen8(qb + 16), _mm256_loadu_ps(xb + 16), s);
        s = _mm256_fmadd_ps(widen8(qb + 24), _mm256_loadu_ps(xb + 24), s);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(d[b])), s, acc);
    }
    return hsum8(acc);
}
#else
static float dot_q8(const int8_t *q, const uint16_t *d, const float *x, int blocks) {
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        float s = 0.0f;
        for (int i = 0; i < BLOCK; i++) s += (float)q[(long)b * BLOCK + i] * x[(long)b * BLOCK + i];
        acc += h2f(d[b]) * s;
    }
    return acc;
}
#endif

/* Block b of weight row j, `blocks` blocks to a row: its weights widened into w, its scale returned. */
static inline float block_q8(const int8_t *q, const uint16_t *d, long j, int b, int blocks, vec w[CHUNKS]) {
    d += j * blocks;
    weights_q8(q + (j * blocks + b) * BLOCK, w);
    const float scale = h2f(d[b]);
    return scale;
}

/* Q4_0: the same. */
#if PRODUCTS_ISA == 2
static float dot_q4(const uint8_t *q, const uint16_t *d, const float *x, int blocks) {
    __m512 acc = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    const __m512 eight = _mm512_set1_ps(8.0f);
    for (int b = 0; b < blocks; b++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + (long)b * BLOCK / 2));
        const float *xb = x + (long)b * BLOCK;
        const __m512 w0 = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, low))), eight);
        const __m512 w1 = _mm512_sub_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), low))), eight);
        const __m512 s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
        acc = _mm512_fmadd_ps(_mm512_set1_ps(h2f(d[b])), s, acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#elif PRODUCTS_ISA == 1
static float dot_q4(const uint8_t *q, const uint16_t *d, const float *x, int blocks) {
    __m256 acc = _mm256_setzero_ps();
    const __m128i low = _mm_set1_epi8(0x0f);
    for (int b = 0; b < blocks; b++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(q + (long)b * BLOCK / 2));
        const __m128i lo = _mm_and_si128(raw, low), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low);
        const float *xb = x + (long)b * BLOCK;
        __m256 s = _mm256_mul_ps(widen4(lo), _mm256_loadu_ps(xb));
        s = _mm256_fmadd_ps(widen4(_mm_srli_si128(lo, 8)), _mm256_loadu_ps(xb + 8), s);
        s = _mm256_fmadd_ps(widen4(hi), _mm256_loadu_ps(xb + 16), s);
        s = _mm256_fmadd_ps(widen4(_mm_srli_si128(hi, 8)), _mm256_loadu_ps(xb + 24), s);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(d[b])), s, acc);
    }
    return hsum8(acc);
}
#else
static float dot_q4(const uint8_t *q, const uint16_t *d, const float *x, int blocks) {
    float acc = 0.0f;
    for (int b = 0; b < blocks; b++) {
        const uint8_t *qb = q + (long)b * BLOCK / 2;
        const float *xb = x + (long)b * BLOCK;
        float s = 0.0f;
        for (int i = 0; i < BLOCK / 2; i++) s += (float)((qb[i] & 0x0f) - 8) * xb[i];
        for (int i = 0; i < BLOCK / 2; i++) s += (float)((qb[i] >> 4) - 8) * xb[BLOCK / 2 + i];
        acc += h2f(d[b]) * s;
    }
    return acc;
}
#endif

static inline float block_q4(const uint8_t *q, const uint16_t *d, long j, int b, int blocks, vec w[CHUNKS]) {
    d += j * blocks;
    weights_q4(q + (j * blocks + b) * (BLOCK / 2), w);
    const float scale = h2f(d[b]);
    return scale;
}

#define INLINE static inline __attribute__((always_inline))

/* Blocks [b0, b1) of y[r, j0 .. j0 + J) for input rows r < R (R <= TILE_ROWS, J <= 4, both constants once
 * inlined): each weight block is widened once for the R rows; J * R accumulators in registers, taken from and
 * left in `saved` [J][R] between the chunks of a row (a stored float is the same float), summed into y after the
 * last block. `four_bit`: Q4_0, else Q8_0. */
INLINE void tile(const int four_bit, const int J, const int R, const void *q, const uint16_t *d, long j0, int blocks,
                 int b0, int b1, const float *x, long x_stride, vec *saved, float *y, long n) {
    vec acc[4][TILE_ROWS];
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) acc[jj][r] = b0 ? saved[jj * R + r] : vzero();
    /* The next tile's weights (the rows after these, contiguous) fetched ahead, a block's share per block: the
     * hardware prefetchers do not keep J interleaved rows streaming from memory. */
    const int block_bytes = four_bit ? BLOCK / 2 : BLOCK;
    const char *next = (const char *)q + (j0 + J) * (long)blocks * block_bytes;
    for (int b = b0; b < b1; b++) {
        for (int line = 0; line < J * block_bytes; line += 64)
            __builtin_prefetch(next + (long)b * J * block_bytes + line, 0, 3);
#pragma GCC unroll 4
        for (int jj = 0; jj < J; jj++) {
            vec w[CHUNKS];
            const float scale_b = four_bit ? block_q4((const uint8_t *)q, d, j0 + jj, b, blocks, w)
                                           : block_q8((const int8_t *)q, d, j0 + jj, b, blocks, w);
#pragma GCC unroll 8
            for (int r = 0; r < R; r++)
                acc[jj][r] = scaled_add(acc[jj][r], scale_b, block_sum(w, x + r * x_stride + (long)b * BLOCK));
        }
    }
#pragma GCC unroll 4
    for (int jj = 0; jj < J; jj++)
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            if (b1 < blocks) saved[jj * R + r] = acc[jj][r];
            else y[r * n + j0 + jj] = lanes_sum(acc[jj][r]);
        }
}

#define X_FLOATS 4096 /* of the input rows kept in the L1 cache while a group of weight rows passes over them */
#define GROUP 16      /* weight rows, a multiple of every WEIGHT_ROWS */

/* Weight rows [first, last) for R input rows: WEIGHT_ROWS(R) at a time, then the rest one by one. With many
 * long rows, by groups of GROUP weight rows and chunks of X_FLOATS / R columns: each chunk of the input rows is
 * read from the L1 cache by the whole group, not from further away by each weight row. */
INLINE void stretch(const int four_bit, const int R, const void *q, const uint16_t *d, long first, long last,
                    int blocks, const float *x, long x_stride, float *y, long n) {
    const int J = WEIGHT_ROWS(R), fit = X_FLOATS / (R * BLOCK), chunk = fit < 1 ? 1 : fit < blocks ? fit : blocks;
    vec saved[GROUP * TILE_ROWS];
    for (long g = first; g < last; g += GROUP) {
        const long end = g + GROUP < last ? g + GROUP : last;
        for (int b0 = 0; b0 < blocks; b0 += chunk) {
            const int b1 = b0 + chunk < blocks ? b0 + chunk : blocks;
            long j = g;
            for (; j + J <= end; j += J)
                tile(four_bit, J, R, q, d, j, blocks, b0, b1, x, x_stride, saved + (j - g) * R, y, n);
            for (; j < end; j++)
                tile(four_bit, 1, R, q, d, j, blocks, b0, b1, x, x_stride, saved + (j - g) * R, y, n);
        }
    }
}

INLINE void rows_stretch(const int four_bit, int rows, const void *q, const uint16_t *d, long first, long last,
                         int blocks, const float *x, long x_stride, float *y, long n) {
    for (int r0 = 0; r0 < rows; r0 += TILE_ROWS) {
        const float *xr = x + r0 * x_stride;
        float *yr = y + r0 * n;
        switch (rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS) {
        case 1: stretch(four_bit, 1, q, d, first, last, blocks, xr, x_stride, yr, n); break;
        case 2: stretch(four_bit, 2, q, d, first, last, blocks, xr, x_stride, yr, n); break;
        case 3: stretch(four_bit, 3, q, d, first, last, blocks, xr, x_stride, yr, n); break;
        case 4: stretch(four_bit, 4, q, d, first, last, blocks, xr, x_stride, yr, n); break;
        case 5: stretch(four_bit, 5, q, d, first, last, blocks, xr, x_stride, yr, n); break;
        case 6: stretch(four_bit, 6, q, d, first, last, blocks, xr, x_stride, yr, n); break;
        case 7: stretch(four_bit, 7, q, d, first, last, blocks, xr, x_stride, yr, n); break;
        default: stretch(four_bit, TILE_ROWS, q, d, first, last, blocks, xr, x_stride, yr, n); break;
        }
    }
}

/* The instruction set this build runs: 2 AVX512F, 1 AVX2, 0 portable C (for `hyserve env`). */
int q8_isa(void) { return PRODUCTS_ISA; }

/* A thread's stretch of the n weight rows: contiguous, whole tiles of 4 but for the last. */
#define THREAD_STRETCH(n)                                                                                   \
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();                                         \
    const long per = (((n) + nt - 1) / nt + 3) / 4 * 4, first = t * per < (n) ? t * per : (n),             \
               last = first + per < (n) ? first + per : (n)

/* All four return 0, or -1 when k is not a whole number of blocks (nothing written). */
int q8_products(int rows, int n, int k, const float *x, long x_stride, const int8_t *q, const uint16_t *d,
                float *y, int threads) {
    if (k % BLOCK) return -1;
#pragma omp parallel num_threads(threads)
    {
        THREAD_STRETCH(n);
        rows_stretch(0, rows, q, d, first, last, k / BLOCK, x, x_stride, y, n);
    }
    return 0;
}

/* `q4_products`: the same over GGUF's Q4_0 values: q [n, k / 2] bytes, per block of 32 weights 16 bytes whose low
 * nibbles are its weights 0-15 and high nibbles 16-31, each nibble u standing for (u - 8); W = d * (u - 8). */
int q4_products(int rows, int n, int k, const float *x, long x_stride, const uint8_t *q, const uint16_t *d,
                float *y, int threads) {
    if (k % BLOCK) return -1;
#pragma omp parallel num_threads(threads)
    {
        THREAD_STRETCH(n);
        rows_stretch(1, rows, q, d, first, last, k / BLOCK, x, x_stride, y, n);
    }
    return 0;
}

/* `q8_linear` / `q4_linear`: a linear layer's call as the model makes it, so that Python does no per-call work
 * but allocate y: x and y in the activation's dtype (`bf16`: bfloat16, else float32), rows of x `x_stride` elements
 * apart, y contiguous, `bias` (float32, or NULL) added to the float32 sums, then rounded to bfloat16 to nearest
 * even as torch's `.to(torch.bfloat16)` rounds (a NaN as its 0x7fc0). The sums are the products' own, so the result is
 * bit for bit `products(x.float()) + bias` rounded to the dtype. */
static inline float bf2f(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u; /* any NaN: torch's one NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static int linear(const int four_bit, int rows, int n, int k, const void *x, long x_stride, int bf16, const void *q,
                  const uint16_t *d, const float *bias, void *y, int threads) {
    if (k % BLOCK) return -1;
    float *xf = NULL, *yf = (float *)y;
    if (bf16) {
        xf = malloc(sizeof(float) * ((size_t)rows * k + (size_t)rows * n));
        if (!xf) return -1;
        yf = xf + (size_t)rows * k;
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < k; i++) xf[(size_t)r * k + i] = bf2f(((const uint16_t *)x)[r * x_stride + i]);
    }
    const float *xs = bf16 ? xf : (const float *)x;
    const long xs_stride = bf16 ? k : x_stride;
#pragma omp parallel num_threads(threads)
    {
        THREAD_STRETCH(n);
        rows_stretch(four_bit, rows, q, d, first, last, k / BLOCK, xs, xs_stride, yf, n);
        if (bf16 || bias) /* float32 without a bias: the sums are y already */
            for (int r = 0; r < rows; r++)
                for (long j = first; j < last; j++) {
                    const float v = bias ? yf[(long)r * n + j] + bias[j] : yf[(long)r * n + j];
                    if (bf16) ((uint16_t *)y)[(long)r * n + j] = f2bf(v);
                    else yf[(long)r * n + j] = v;
                }
    }
    free(xf);
    return 0;
}

int q8_linear(int rows, int n, int k, const void *x, long x_stride, int bf16, const int8_t *q, const uint16_t *d,
              const float *bias, void *y, int threads) {
    return linear(0, rows, n, k, x, x_stride, bf16, q, d, bias, y, threads);
}

int q4_linear(int rows, int n, int k, const void *x, long x_stride, int bf16, const uint8_t *q, const uint16_t *d,
              const float *bias, void *y, int threads) {
    return linear(1, rows, n, k, x, x_stride, bf16, q, d, bias, y, threads);
}

/* The per-output loops the products ran before the tiles: each (weight row, input row) its own pass over the
 * row's blocks. Kept as the reference the tests compare the products with bit for bit, and as the benchmark's
 * "before". */
int q8_reference(int rows, int n, int k, const float *x, long x_stride, const int8_t *q, const uint16_t *d,
                 float *y, int threads) {
    if (k % BLOCK) return -1;
    const int blocks = k / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        THREAD_STRETCH(n);
        for (long j = first; j < last; j++)
            for (int r = 0; r < rows; r++)
                y[(long)r * n + j] = dot_q8(q + j * (long)k, d + j * (long)blocks, x + r * x_stride, blocks);
    }
    return 0;
}

int q4_reference(int rows, int n, int k, const float *x, long x_stride, const uint8_t *q, const uint16_t *d,
                 float *y, int threads) {
    if (k % BLOCK) return -1;
    const int blocks = k / BLOCK;
#pragma omp parallel num_threads(threads)
    {
        THREAD_STRETCH(n);
        for (long j = first; j < last; j++)
            for (int r = 0; r < rows; r++)
                y[(long)r * n + j] = dot_q4(q + j * (long)k / 2, d + j * (long)blocks, x + r * x_stride, blocks);
    }
    return 0;
}
