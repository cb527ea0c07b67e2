/* `a8_linear`: y = x @ W^T (+ bias) with the activations rounded to Q8_0 blocks, as llama.cpp computes its Q8_0 and
 * Q4_0 weights (`--quantization w8a8|w4a8`): each row of x is rounded per block of 32 values (d = amax / 127,
 * q = roundf(x * (1 / d)), in float32, `round_rows`), each block's dot product with the weight's block is summed in
 * integers (exact), and y[r, j] = sum over blocks of that sum * (dw * dx), in float32. The reference it is checked
 * against is `layout.dequantized_linear(rounded=True)`; the results agree up to float32 rounding.
 *
 * Why: a weight-only product widens every weight to float before it multiplies; at 4 bits that widening, not
 * memory, bounds a decode step, and in a prefill piece a float32 product does 8 multiplications per instruction
 * where `maddubs` does 32. The weights are taken 8 rows at a time (a "set"), one output a lane: a block's integer
 * sums of the 8 rows end in one vector, so converting, scaling and adding cost one instruction each per 8 outputs
 * (ggml's repacked Q4_0 products do the same). The model's weights are interleaved at load (`layout.interleave_`,
 * in place: each set one stretch, 4 rows' pieces of a block in one load; `interleaved_rows`); a weight whose rows
 * are not whole sets, or not interleaved, is read row after row as layout.py quantizes it (`set_rows`).
 *
 * Each output takes the same operations in the same order whatever the number of rows or threads: a row's
 * result does not depend on its batch or its piece's length (batched == single, cache on == cache off). The
 * weights are held as quant/layout.py holds them (Q8_0: int8 q [n, k]; Q4_0: bytes [n, k / 2], low nibbles weights
 * 0-15 of a block, high nibbles 16-31, u standing for u - 8; Q6_0: 24 bytes a block, byte i < 16 weight i's 6 bits
 * and weight 16 + i's top two, bytes 16-23 the low nibbles of weights 16-23 and (high) 24-31, u standing for
 * u - 32; one float16 d per block). Instruction set: AVX2
 * (`-march=native`) or portable C; `-DA8_ISA=0` picks the portable one (the tests build each the CPU runs). Each C
 * file of hyserve is built alone (kernels.native.build; the tests build copies of it elsewhere), so the float16
 * and bfloat16 conversions below repeat products.c's.
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
#if !defined(__clang__) && defined(__GNUC__)
/* GCC 12 at -O2 and up with -march=native on a CPU with AVX512-VNNI (AMD Zen 4) turns the portable loops' signed
 * int8 dot products into vpdpbusd, which multiplies unsigned by signed bytes: wrong sums (tests/test_quant_a8.py
 * caught it). This file's intrinsics are AVX2's; VNNI is not used on purpose anywhere in it. */
#pragma GCC target("no-avx512vnni")
#endif

#define BLOCK 32
#define Q8 0 /* the formats, as `a8_linear` takes them: rows as layout.py holds them, */
#define Q4 1
#define Q6 2
#define INTERLEAVED 3 /* or, added to one of those, sets of 8 rows interleaved (`layout.interleave_`) */
#define BLOCK_BYTES(f) ((f) % INTERLEAVED == Q4 ? BLOCK / 2 : (f) % INTERLEAVED == Q6 ? BLOCK * 3 / 4 : BLOCK)
#define INLINE static inline __attribute__((always_inline))

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
 * and `sum8` [rows, k / 32] int32, 8 times each block's sum of q (the Q4_0 products multiply the unsigned nibbles u
 * and take 8 * x back: the same integers as (u - 8) * x). Per block: amax = max |x|, d = amax / 127,
 * q = roundf(x * (1 / d)) (0 when d is 0): ggml's `quantize_row_q8_0_ref`, but d kept in float32. A NaN or infinity
 * in a block makes its d NaN or infinite (never hidden). The AVX2 build takes a block in four vectors, roundf as
 * trunc plus one away from zero where the dropped part is a half or more (exact: x - trunc(x) is); every call of
 * a product rounds its input, and libm's roundf, one call a value, cost a decode step's product more than its
 * weights did at 1,024 columns. */
#if A8_ISA == 1
INLINE __m256 load8(const void *x, long at, int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + at))), 16));
    return _mm256_loadu_ps((const float *)x + at);
}

static void round_block(const void *x, long at, int bf16, int8_t *qb, float *d, int32_t *sum8) {
    __m256 v[4], amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < 4; j++) {
        v[j] = load8(x, at + 8 * j, bf16);
        const __m256 a = _mm256_andnot_ps(sign, v[j]);
        amax = _mm256_max_ps(amax, a);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    }
    float m[8];
    _mm256_storeu_ps(m, amax);
    float top = m[0];
    for (int i = 1; i < 8; i++) top = m[i] > top ? m[i] : top;
    if (_mm256_movemask_ps(nan)) top = NAN;
    const float db = top / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    const __m256 vinv = _mm256_set1_ps(inv), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
    __m256i q[4], total = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256 p = _mm256_mul_ps(v[j], vinv);
        const __m256 t = _mm256_round_ps(p, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
        const __m256 away = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(p, t)), half, _CMP_GE_OQ);
        __m256 r = _mm256_add_ps(t, _mm256_and_ps(away, _mm256_or_ps(one, _mm256_and_ps(sign, p))));
        r = _mm256_and_ps(_mm256_min_ps(_mm256_max_ps(r, lo), hi), _mm256_cmp_ps(r, r, _CMP_ORD_Q)); /* NaN: 0 */
        q[j] = _mm256_cvttps_epi32(r);
        total = _mm256_add_epi32(total, q[j]);
    }
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)qb, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    *d = db;
    *sum8 = 8 * _mm_cvtsi128_si32(s4);
}
#else
static void round_block(const void *x, long at, int bf16, int8_t *qb, float *d, int32_t *sum8) {
    float v[BLOCK], amax = 0.0f;
    for (int i = 0; i < BLOCK; i++) {
        v[i] = bf16 ? bf2f(((const uint16_t *)x)[at + i]) : ((const float *)x)[at + i];
        const float a = fabsf(v[i]);
        amax = (a > amax || a != a) ? a : amax;
    }
    const float db = amax / 127.0f, inv = db != 0.0f ? 1.0f / db : 0.0f;
    int32_t sum = 0;
    for (int i = 0; i < BLOCK; i++) {
        const float t = roundf(v[i] * inv);
        qb[i] = (int8_t)(t > 127.0f ? 127 : t < -127.0f ? -127 : (t == t ? t : 0));
        sum += qb[i];
    }
    *d = db;
    *sum8 = 8 * sum;
}
#endif

int round_rows(int rows, int k, const void *x, long x_stride, int bf16, int8_t *q, float *d, int32_t *sum8) {
    if (k % BLOCK) return -1;
    const int blocks = k / BLOCK;
    for (int r = 0; r < rows; r++)
        for (int b = 0; b < blocks; b++)
            round_block(x, (long)r * x_stride + (long)b * BLOCK, bf16, q + (long)r * k + (long)b * BLOCK,
                        d + (long)r * blocks + b, sum8 + (long)r * blocks + b);
    return 0;
}

#define SET 8 /* weight rows whose outputs share one vector, a lane each */
#define TILE 8  /* input rows passing each of a set's blocks while it is unpacked (`sets` has a case for each count) */
#define AHEAD 2048 /* bytes an interleaved set is fetched ahead of its product: a one-row product over Q8_0 weights
                    * ran 5-10% slower at none and at 1,024, as fast at 4,096 */
#define GROUP 8 /* sets (64 weight rows) kept in the core's cache while every tile of input rows passes them */

/* The outputs of input rows x[0 .. R) and one set's 8 weight rows (q: the set's first row, rows `row_bytes` apart;
 * d: its scales, rows `blocks` apart) into out[r * 8 + row]. Each output is, over its blocks in order,
 * acc += (the block's exact integer dot product) * (dw * dx) in float32: the same operations whatever R, the set's
 * neighbours or the threads (a row's result does not depend on its batch). */
#if A8_ISA == 1
/* The scales of rows 0-7 for blocks b .. b + nb (nb <= 8) as floats, one vector per block: eight rows' eight
 * float16 scales transposed as 16-bit values, then converted. */
INLINE void set_scales(const uint16_t *d, int blocks, int b, int nb, __m256 *dw) {
    if (nb == 8) {
        __m128i r[8], t[8], u[8];
        for (int j = 0; j < 8; j++) r[j] = _mm_loadu_si128((const __m128i *)(d + (long)j * blocks + b));
        for (int j = 0; j < 4; j++) {
            t[2 * j] = _mm_unpacklo_epi16(r[2 * j], r[2 * j + 1]);
            t[2 * j + 1] = _mm_unpackhi_epi16(r[2 * j], r[2 * j + 1]);
        }
        for (int h = 0; h < 2; h++) /* rows 0-3, then 4-7 */
            for (int j = 0; j < 2; j++) {
                u[4 * h + 2 * j] = _mm_unpacklo_epi32(t[4 * h + j], t[4 * h + 2 + j]);
                u[4 * h + 2 * j + 1] = _mm_unpackhi_epi32(t[4 * h + j], t[4 * h + 2 + j]);
            }
        for (int j = 0; j < 4; j++) { /* u[j]: rows 0-3 of blocks 2j, 2j + 1; u[4 + j]: rows 4-7 */
            dw[2 * j] = _mm256_cvtph_ps(_mm_unpacklo_epi64(u[j], u[4 + j]));
            dw[2 * j + 1] = _mm256_cvtph_ps(_mm_unpackhi_epi64(u[j], u[4 + j]));
        }
    } else {
        for (int i = 0; i < nb; i++) {
            uint16_t h[8];
            for (int j = 0; j < 8; j++) h[j] = d[(long)j * blocks + b + i];
            dw[i] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h));
        }
    }
}

/* Rows p and p + 4's 16 bytes at `at` as one vector (row p the low half). */
INLINE __m256i row_pair(const uint8_t *q, long row_bytes, int p, long at) {
    const __m128i lo = _mm_loadu_si128((const __m128i *)(q + p * row_bytes + at));
    const __m128i hi = _mm_loadu_si128((const __m128i *)(q + (p + 4) * row_bytes + at));
    return _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
}

/* Rows p and p + 4's 8 bytes at `at` as one vector, each twice (row p the low half). */
INLINE __m256i row_pair_8(const uint8_t *q, long row_bytes, int p, long at) {
    long long lo, hi;
    memcpy(&lo, q + p * row_bytes + at, 8);
    memcpy(&hi, q + (p + 4) * row_bytes + at, 8);
    return _mm256_blend_epi32(_mm256_set1_epi64x(lo), _mm256_set1_epi64x(hi), 0xf0);
}

/* Q4_0: each pair of rows' nibbles as unsigned bytes, weights 0-15 (`w[p]`) against x's first 16 values in both
 * halves and 16-31 (`w[4 + p]`) against its last 16: `maddubs` (at most 2 * 15 * 127 a pair), the two halves
 * added in 16 bits (at most 4 * 15 * 127), pairs into 32 bits. Q6_0: the same over 6-bit values, weights 0-15
 * as they lie, 16-31 each nibble with its top bits put above it (at most 4 * 63 * 127 = 32004 in 16 bits). Q8_0:
 * the magnitudes against x with the weights' signs (at most 2 * 128 * 127 a pair, so each half into 32 bits on
 * its own). Then the four rows' partial sums of
 * each vector added across (`hadd`, twice): rows 0-7 in lanes 0-7; Q4_0 takes 8 * x's block sum back, Q6_0 32 *. */
INLINE void set_rows(const int fmt, const int R, const uint8_t *q, long row_bytes, const uint16_t *d, int blocks,
                     const int8_t *xq, long k, const float *xd, const int32_t *xs, float *out) {
    __m256 acc[TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int bb = BLOCK_BYTES(fmt);
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
    const __m256i low6 = _mm256_set1_epi8(0x3f), nibbles = _mm256_setr_epi64x(0, 4, 0, 4);
    /* The next set's rows (8 whole rows, one stretch of memory) fetched ahead in the order they lie, each block its
     * share: the hardware prefetchers do not keep 8 interleaved row streams going, nor did fetching each row's next
     * line (a one-row product over a Q8_0 head ran a third slower so). Its scales too (also one stretch): without,
     * a one-row product over 1024 x 3584 Q4_0 weights ran 15% slower. */
    const uint8_t *next = q + SET * row_bytes;
    const char *next_d = (const char *)(d + SET * blocks);
    for (int b = 0; b < blocks; b += 8) {
        const int nb = blocks - b < 8 ? blocks - b : 8;
        __builtin_prefetch(next_d + (long)b * 2 * SET, 0, 3); /* 8 blocks' scales of 8 rows: 128 bytes */
        __builtin_prefetch(next_d + (long)b * 2 * SET + 64, 0, 3);
        __m256 dw[8];
        set_scales(d, blocks, b, nb, dw);
        for (int i = 0; i < nb; i++) {
            const long at = (long)(b + i) * bb;
            for (long line = (long)(b + i) * bb * SET; line < (long)(b + i + 1) * bb * SET; line += 64)
                __builtin_prefetch(next + line, 0, 3);
            __m256i w[8], mag[8];
            for (int p = 0; p < 4; p++) {
                if (fmt == Q6) { /* 16-23: the low nibbles of bytes 16-23, 24-31 their high ones (one lane each) */
                    const __m256i raw = row_pair(q, row_bytes, p, at);
                    w[p] = _mm256_and_si256(raw, low6);
                    const __m256i rest = _mm256_srlv_epi64(row_pair_8(q, row_bytes, p, at + BLOCK / 2), nibbles);
                    w[4 + p] = _mm256_or_si256(_mm256_and_si256(rest, low4),
                                               _mm256_and_si256(_mm256_srli_epi16(raw, 2), top2));
                } else if (fmt == Q4) {
                    const __m256i raw = row_pair(q, row_bytes, p, at);
                    w[p] = _mm256_and_si256(raw, low4);
                    w[4 + p] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
                } else {
                    w[p] = row_pair(q, row_bytes, p, at);
                    w[4 + p] = row_pair(q, row_bytes, p, at + BLOCK / 2);
                    mag[p] = _mm256_abs_epi8(w[p]);
                    mag[4 + p] = _mm256_abs_epi8(w[4 + p]);
                }
            }
#pragma GCC unroll 8
            for (int r = 0; r < R; r++) {
                const int8_t *xb = xq + r * k + (long)(b + i) * BLOCK;
                const __m256i xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)xb));
                const __m256i xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(xb + 16)));
                __m256i s[4];
                for (int p = 0; p < 4; p++)
                    if (fmt != Q8)
                        s[p] = _mm256_madd_epi16(
                            _mm256_add_epi16(_mm256_maddubs_epi16(w[p], xlo), _mm256_maddubs_epi16(w[4 + p], xhi)),
                            ones);
                    else
                        s[p] = _mm256_add_epi32(
                            _mm256_madd_epi16(_mm256_maddubs_epi16(mag[p], _mm256_sign_epi8(xlo, w[p])), ones),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(mag[4 + p], _mm256_sign_epi8(xhi, w[4 + p])),
                                              ones));
                __m256i sums = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
                if (fmt != Q8) /* the nibbles' offset: 8 * x's block sum (Q4_0), 32 * (Q6_0) */
                    sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(xs[r * blocks + b + i] * (fmt == Q6 ? 4 : 1)));
                const __m256 scale = _mm256_mul_ps(dw[i], _mm256_set1_ps(xd[r * blocks + b + i]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * SET, acc[r]);
}
/* The same outputs over a set whose 8 rows are interleaved (`layout.interleave_`): block after block, each block's
 * bytes as pieces of 8 (piece c: bytes 8c .. 8c + 7 of a row's block), for each piece rows 0, 1, 4, 5 then 2, 3, 6,
 * 7; the set's scales [blocks][8]. One load takes a piece of four rows; against x's 8 values of that piece
 * (broadcast), `maddubs` and `madd` leave each row's sum in two lanes, and one `hadd` of the two groups puts rows
 * 0-7 in lanes 0-7 (that order is why the groups hold those rows). A set is one stretch of memory (the hardware
 * prefetcher follows it) and its scales load as they lie: against `set_rows`, no 128-bit inserts, no scale
 * transposes, one `hadd` a block instead of three. Q4_0: pieces 0, 1 hold weights 0-7 and 8-15 (low nibbles) and
 * 16-31 (high), 16-bit sums at most 8 * 15 * 127; Q6_0: pieces 0, 1 weights 0-15 and the top bits of 16-31, piece 2
 * their low nibbles, two products a 16-bit sum (at most 4 * 63 * 127); Q8_0: pieces 0-3 weights 0-31, each product
 * into 32 bits alone. */
INLINE void interleaved_rows(const int fmt, const int R, const uint8_t *q, const uint16_t *d, int blocks,
                             const int8_t *xq, long k, const float *xd, const int32_t *xs, float *out) {
    __m256 acc[TILE];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const int bb = BLOCK_BYTES(fmt);
    const __m256i ones = _mm256_set1_epi16(1), low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30);
    const __m256i low6 = _mm256_set1_epi8(0x3f);
    for (int b = 0; b < blocks; b++) {
        const uint8_t *qb = q + (long)b * bb * SET;
        for (int line = 0; line < bb * SET; line += 64) /* the set's stretch ahead of the hardware prefetcher */
            __builtin_prefetch(qb + AHEAD + line, 0, 3);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + (long)b * SET)));
        __m256i w[2][4], mag[2][4]; /* [group][piece of 8 weights]: weights 8c .. 8c + 7 of the group's rows */
        for (int g = 0; g < 2; g++) {
#define PIECE(c) _mm256_loadu_si256((const __m256i *)(qb + 64 * (c) + 32 * g))
            if (fmt == Q4) {
                const __m256i p0 = PIECE(0), p1 = PIECE(1);
                w[g][0] = _mm256_and_si256(p0, low4);
                w[g][1] = _mm256_and_si256(p1, low4);
                w[g][2] = _mm256_and_si256(_mm256_srli_epi16(p0, 4), low4);
                w[g][3] = _mm256_and_si256(_mm256_srli_epi16(p1, 4), low4);
            } else if (fmt == Q6) {
                const __m256i p0 = PIECE(0), p1 = PIECE(1), p2 = PIECE(2);
                w[g][0] = _mm256_and_si256(p0, low6);
                w[g][1] = _mm256_and_si256(p1, low6);
                w[g][2] = _mm256_or_si256(_mm256_and_si256(p2, low4), _mm256_and_si256(_mm256_srli_epi16(p0, 2), top2));
                w[g][3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(p2, 4), low4),
                                          _mm256_and_si256(_mm256_srli_epi16(p1, 2), top2));
            } else
                for (int c = 0; c < 4; c++) {
                    w[g][c] = PIECE(c);
                    mag[g][c] = _mm256_abs_epi8(w[g][c]);
                }
#undef PIECE
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const int8_t *xb = xq + r * k + (long)b * BLOCK;
            __m256i x[4], v[2];
            for (int c = 0; c < 4; c++) {
                long long piece;
                memcpy(&piece, xb + 8 * c, 8);
                x[c] = _mm256_set1_epi64x(piece);
            }
            for (int g = 0; g < 2; g++) {
                if (fmt == Q4)
                    v[g] = _mm256_madd_epi16(
                        _mm256_add_epi16(
                            _mm256_add_epi16(_mm256_maddubs_epi16(w[g][0], x[0]), _mm256_maddubs_epi16(w[g][1], x[1])),
                            _mm256_add_epi16(_mm256_maddubs_epi16(w[g][2], x[2]), _mm256_maddubs_epi16(w[g][3], x[3]))),
                        ones);
                else if (fmt == Q6)
                    v[g] = _mm256_add_epi32(
                        _mm256_madd_epi16(
                            _mm256_add_epi16(_mm256_maddubs_epi16(w[g][0], x[0]), _mm256_maddubs_epi16(w[g][1], x[1])),
                            ones),
                        _mm256_madd_epi16(
                            _mm256_add_epi16(_mm256_maddubs_epi16(w[g][2], x[2]), _mm256_maddubs_epi16(w[g][3], x[3])),
                            ones));
                else {
                    __m256i p[4];
                    for (int c = 0; c < 4; c++)
                        p[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(mag[g][c], _mm256_sign_epi8(x[c], w[g][c])), ones);
                    v[g] = _mm256_add_epi32(_mm256_add_epi32(p[0], p[1]), _mm256_add_epi32(p[2], p[3]));
                }
            }
            __m256i sums = _mm256_hadd_epi32(v[0], v[1]);
            if (fmt != Q8) /* the offset, as in `set_rows` */
                sums = _mm256_sub_epi32(sums, _mm256_set1_epi32(xs[r * blocks + b] * (fmt == Q6 ? 4 : 1)));
            const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(xd[r * blocks + b]));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + r * SET, acc[r]);
}
#else
/* Weight i of a block (`wb`: its bytes) as a signed integer. */
static inline int weight(const int fmt, const uint8_t *wb, int i) {
    if (fmt == Q8) return (int8_t)wb[i];
    if (fmt == Q4) return (i < BLOCK / 2 ? wb[i] & 0x0f : wb[i - BLOCK / 2] >> 4) - 8;
    if (i < BLOCK / 2) return (wb[i] & 0x3f) - 32;
    const int j = i - BLOCK / 2, low = j < 8 ? wb[BLOCK / 2 + j] & 0x0f : wb[BLOCK / 2 + j - 8] >> 4;
    return (low | (wb[j] >> 6) << 4) - 32;
}

INLINE void set_rows(const int fmt, const int R, const uint8_t *q, long row_bytes, const uint16_t *d, int blocks,
                     const int8_t *xq, long k, const float *xd, const int32_t *xs, float *out) {
    (void)xs;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < SET; j++) {
            float acc = 0.0f;
            for (int b = 0; b < blocks; b++) {
                const uint8_t *wb = q + j * row_bytes + (long)b * BLOCK_BYTES(fmt);
                const int8_t *xb = xq + r * k + (long)b * BLOCK;
                int32_t s = 0;
                for (int i = 0; i < BLOCK; i++) s += weight(fmt, wb, i) * xb[i];
                acc = acc + (float)s * (h2f(d[(long)j * blocks + b]) * xd[r * blocks + b]);
            }
            out[r * SET + j] = acc;
        }
}
/* Row j's byte t of block b in an interleaved set (see the AVX2 `interleaved_rows`). */
static inline uint8_t interleaved_byte(const uint8_t *q, int bb, int b, int j, int t) {
    static const int group[SET] = {0, 0, 1, 1, 0, 0, 1, 1}, place[SET] = {0, 1, 0, 1, 2, 3, 2, 3};
    return q[(long)b * bb * SET + 64 * (t / 8) + 32 * group[j] + 8 * place[j] + t % 8];
}

INLINE void interleaved_rows(const int fmt, const int R, const uint8_t *q, const uint16_t *d, int blocks,
                             const int8_t *xq, long k, const float *xd, const int32_t *xs, float *out) {
    (void)xs;
    const int bb = BLOCK_BYTES(fmt);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < SET; j++) {
            float acc = 0.0f;
            for (int b = 0; b < blocks; b++) {
                uint8_t wb[BLOCK];
                for (int t = 0; t < bb; t++) wb[t] = interleaved_byte(q, bb, b, j, t);
                const int8_t *xb = xq + r * k + (long)b * BLOCK;
                int32_t s = 0;
                for (int i = 0; i < BLOCK; i++) s += weight(fmt, wb, i) * xb[i];
                acc = acc + (float)s * (h2f(d[(long)b * SET + j]) * xd[r * blocks + b]);
            }
            out[r * SET + j] = acc;
        }
}
#endif

/* `call(R)` with R the count of input rows, a constant (1-7, or TILE) in each case. */
#define BY_ROWS(rows, call)                                                                                            \
    do {                                                                                                               \
        switch (rows) {                                                                                                \
        case 1: call(1); break;                                                                                        \
        case 2: call(2); break;                                                                                        \
        case 3: call(3); break;                                                                                        \
        case 4: call(4); break;                                                                                        \
        case 5: call(5); break;                                                                                        \
        case 6: call(6); break;                                                                                        \
        case 7: call(7); break;                                                                                        \
        default: call(TILE); break;                                                                                    \
        }                                                                                                              \
    } while (0)

/* Sets [first, last) of weight rows for every input row: GROUP sets at a time, each group passed by all the input
 * rows, TILE at a time, while its blocks are in the core's cache (a prefill piece reads each weight from memory
 * once). The last set, when n is not a multiple of 8, reads `pad` (its rows, then zeros). The outputs with the
 * bias added, written in y's dtype. */
INLINE void sets(const int fmt, int rows, long n, long k, const int8_t *xq, const float *xd, const int32_t *xs,
                 const uint8_t *q, const uint16_t *d, const uint8_t *pad_q, const uint16_t *pad_d, const float *bias,
                 void *y, int bf16, long first, long last) {
    const int blocks = (int)(k / BLOCK);
    const long row_bytes = (long)blocks * BLOCK_BYTES(fmt);
    float out[TILE * SET];
    for (long g = first; g < last; g += GROUP) {
        const long end = g + GROUP < last ? g + GROUP : last;
        for (int r0 = 0; r0 < rows; r0 += TILE) {
            const int R = rows - r0 < TILE ? rows - r0 : TILE;
            const int8_t *xr = xq + (long)r0 * k;
            const float *dr = xd + (long)r0 * blocks;
            const int32_t *sr = xs + (long)r0 * blocks;
            for (long s = g; s < end; s++) {
                const int whole = (s + 1) * SET <= n;
                const uint8_t *qs = whole ? q + s * SET * row_bytes : pad_q;
                const uint16_t *ds = whole ? d + s * SET * blocks : pad_d;
                /* R a constant in each case: the accumulators stay in registers */
#define INTERLEAVED_SET(R) interleaved_rows(fmt - INTERLEAVED, R, qs, ds, blocks, xr, k, dr, sr, out)
#define ROWS_SET(R) set_rows(fmt, R, qs, row_bytes, ds, blocks, xr, k, dr, sr, out)
                if (fmt >= INTERLEAVED) /* (the same addresses: a set's 8 rows, its 8 rows' scales) */
                    BY_ROWS(R, INTERLEAVED_SET);
                else
                    BY_ROWS(R, ROWS_SET);
#undef INTERLEAVED_SET
#undef ROWS_SET
                const int outputs = whole ? SET : (int)(n - s * SET);
                for (int r = 0; r < R; r++)
                    for (int j = 0; j < outputs; j++) {
                        const long at = (long)(r0 + r) * n + s * SET + j;
                        const float v = bias ? out[r * SET + j] + bias[s * SET + j] : out[r * SET + j];
                        if (bf16) ((uint16_t *)y)[at] = f2bf(v);
                        else ((float *)y)[at] = v;
                    }
            }
        }
    }
}

/* The instruction set this build runs: 1 AVX2, 0 portable C (for `hyserve env`). */
int a8_isa(void) { return A8_ISA; }

/* x [rows, k] (rows `x_stride` elements apart; bfloat16 when `bf16`, else float32) times the weight (`fmt`: Q8
 * int8 values, Q4 or Q6 bytes, d float16 [n, k / 32]; or, `fmt` + INTERLEAVED, their sets of 8 rows interleaved),
 * plus `bias` (float32, or NULL), into y [rows, n] in x's dtype. The threads round their share of x's rows, then
 * compute their share of the sets of 8 weight rows. 0, or -1 when k is not a whole number of blocks, an interleaved
 * n not one of sets, or memory runs out (nothing written). */
int a8_linear(int fmt, int rows, int n, int k, const void *x, long x_stride, int bf16, const void *q,
              const uint16_t *d, const float *bias, void *y, int threads) {
    if (k % BLOCK || fmt < Q8 || fmt > Q6 + INTERLEAVED || (fmt >= INTERLEAVED && n % SET)) return -1;
    const int blocks = k / BLOCK;
    const long row_bytes = (long)blocks * BLOCK_BYTES(fmt), tail = n % SET;
    const size_t xq_bytes = ((size_t)rows * k + 63) / 64 * 64, per_row = sizeof(float) + sizeof(int32_t);
    const size_t pad_q_bytes = tail ? ((size_t)SET * row_bytes + 63) / 64 * 64 : 0;
    char *scratch = malloc(xq_bytes + per_row * (size_t)rows * blocks + pad_q_bytes +
                           (tail ? sizeof(uint16_t) * SET * (size_t)blocks : 0));
    if (!scratch) return -1;
    int8_t *xq = (int8_t *)scratch;
    float *xd = (float *)(scratch + xq_bytes);
    int32_t *xs = (int32_t *)(xd + (size_t)rows * blocks);
    uint8_t *pad_q = (uint8_t *)(xs + (size_t)rows * blocks);
    uint16_t *pad_d = (uint16_t *)(pad_q + pad_q_bytes);
    if (tail) { /* the last set's rows, then zero rows (their outputs are not written) */
        memset(pad_q, 0, pad_q_bytes);
        memset(pad_d, 0, sizeof(uint16_t) * SET * (size_t)blocks);
        memcpy(pad_q, (const uint8_t *)q + (n - tail) * row_bytes, tail * row_bytes);
        memcpy(pad_d, d + (n - tail) * blocks, sizeof(uint16_t) * tail * blocks);
    }
    const long all_sets = (n + SET - 1) / SET;
    const size_t x_size = bf16 ? sizeof(uint16_t) : sizeof(float);
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int per_t = (rows + nt - 1) / nt, r_first = t * per_t < rows ? t * per_t : rows,
                  r_last = r_first + per_t < rows ? r_first + per_t : rows;
        round_rows(r_last - r_first, k, (const char *)x + (size_t)r_first * x_stride * x_size, x_stride, bf16,
                   xq + (size_t)r_first * k, xd + (size_t)r_first * blocks, xs + (size_t)r_first * blocks);
#pragma omp barrier
        const long per = (all_sets + nt - 1) / nt, first = t * per < all_sets ? t * per : all_sets,
                   last = first + per < all_sets ? first + per : all_sets;
        switch (fmt) { /* a constant in each: the format's branches leave the inner loops */
        case Q4: sets(Q4, rows, n, k, xq, xd, xs, q, d, pad_q, pad_d, bias, y, bf16, first, last); break;
        case Q8 + INTERLEAVED: sets(Q8 + INTERLEAVED, rows, n, k, xq, xd, xs, q, d, 0, 0, bias, y, bf16, first, last); break;
        case Q4 + INTERLEAVED: sets(Q4 + INTERLEAVED, rows, n, k, xq, xd, xs, q, d, 0, 0, bias, y, bf16, first, last); break;
        case Q6 + INTERLEAVED: sets(Q6 + INTERLEAVED, rows, n, k, xq, xd, xs, q, d, 0, 0, bias, y, bf16, first, last); break;
        case Q6: sets(Q6, rows, n, k, xq, xd, xs, q, d, pad_q, pad_d, bias, y, bf16, first, last); break;
        default: sets(Q8, rows, n, k, xq, xd, xs, q, d, pad_q, pad_d, bias, y, bf16, first, last); break;
        }
    }
    free(scratch);
    return 0;
}
