// AVX2 (+FMA, F16C): an 8-lane register holds half a panel's outputs, the halves in turn; each weight
// block is unpacked once per half and every row of the tile multiplies it by its four activation bytes
// broadcast (vpmaddubsw: u8 x s8 pairs into int16; vpmaddwd by ones: pairs of those into int32). The int16
// sums of several vpmaddubsw are added before one vpmaddwd, as far as they cannot overflow: a pair is at
// most 2 * 15 * 127 = 3810 for q4_k's nibbles (eight pairs added: 30480), 2 * 31 * 127 = 7874 for q5_k's five bits
// (four added: 31496) and 2 * 63 * 127 = 16002 for q6_k's six bits (two added: 32004), below int16's 32767, so the
// int32 sums are exactly those of one vpmaddwd each.
#include <immintrin.h>
#include "common.h"

#define TILE 8  // rows per unpacked block; the accumulators beyond the 16 registers live in L1

#include "avx2_k.h"

static inline __attribute__((always_inline)) void q6k_tile(const int rows, const int8_t *qa, const float *sa,
                                                          const int16_t *s32, const int32_t *o16, int64_t K,
                                                          const uint8_t *panel, float *y, int64_t O) {
    const __m256i low = _mm256_set1_epi8(0x0F), two = _mm256_set1_epi8(0x03), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++)
        for (int64_t s = 0; s < supers(K); s++) {
            const uint8_t *sp = panel + s * Q6K_SUPER;
            if (h == 0) prefetch(sp + PREFETCH * Q6K_SUPER, Q6K_SUPER);
            __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sp + h * 16))), sb[TILE];
            for (int r = 0; r < rows; r++) sb[r] = _mm256_setzero_ps();
            for (int b = 0; b < blocks_in(s, K, 16); b++) {
                const uint8_t *bp = sp + 32 + b * Q6K_BLOCK;
                __m256 scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(bp + h * 8)))));
                __m256i lo0 = _mm256_loadu_si256((const __m256i *)(bp + 16 + h * 32));
                __m256i lo1 = _mm256_loadu_si256((const __m256i *)(bp + 80 + h * 32));
                __m256i hi = _mm256_loadu_si256((const __m256i *)(bp + 144 + h * 32));
                __m256i w[4] = {
                    _mm256_or_si256(_mm256_and_si256(lo0, low), _mm256_slli_epi16(_mm256_and_si256(hi, two), 4)),
                    _mm256_or_si256(_mm256_and_si256(lo1, low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 2), two), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 4), two), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), low), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hi, 6), two), 4)),
                };
                int64_t k16 = s * 16 + b;
                for (int r = 0; r < rows; r++) {
                    const int8_t *a = qa + r * K + k16 * 16;
                    __m256i dot = _mm256_add_epi32(
                        _mm256_madd_epi16(_mm256_add_epi16(pairs(w[0], a), pairs(w[1], a + 4)), ones),
                        _mm256_madd_epi16(_mm256_add_epi16(pairs(w[2], a + 8), pairs(w[3], a + 12)), ones));
                    dot = _mm256_add_epi32(dot, _mm256_set1_epi32(o16[r * (K / 16) + k16]));
                    sb[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, sb[r]);
                }
            }
            add_super8(rows, sb, sa, s, K, y + h * 8, O);
        }
}

// q8_b's block, half a panel at a time: q (the stored byte less 128) as |q| (u8) times the activations with q's
// sign (vpsignb), so that a pair of products, at most 2 * 128 * 127 = 32512, fits vpmaddubsw's int16.
static inline __attribute__((always_inline)) void q8b_tile(const int rows, const int8_t *qa, const float *sa,
                                                          const int16_t *s32, const int32_t *o16, int64_t K,
                                                          const uint8_t *panel, float *y, int64_t O) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; h++)
        for (int64_t s = 0; s < supers(K); s++) {
            const uint8_t *sp = panel + s * Q8B_SUPER;
            if (h == 0) prefetch(sp + PREFETCH * Q8B_SUPER, Q8B_SUPER);
            __m256 sb[TILE];
            for (int r = 0; r < rows; r++) sb[r] = _mm256_setzero_ps();
            for (int b = 0; b < blocks_in(s, K, 8); b++) {
                const uint8_t *bp = sp + b * Q8B_BLOCK;
                __m256 d = _mm256_loadu_ps((const float *)bp + h * 8), m = _mm256_loadu_ps((const float *)(bp + 64) + h * 8);
                int64_t kb = s * 8 + b;
                __m256i dot[TILE];
                for (int r = 0; r < rows; r++) dot[r] = _mm256_setzero_si256();
                for (int g = 0; g < 8; g++) {
                    __m256i q = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(bp + 128 + g * 64 + h * 32)), flip);
                    __m256i magnitude = _mm256_abs_epi8(q);
                    for (int r = 0; r < rows; r++) {
                        __m256i a = _mm256_sign_epi8(_mm256_set1_epi32(load32(qa + r * K + kb * 32 + 4 * g)), q);
                        dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, a), ones));
                    }
                }
                for (int r = 0; r < rows; r++) {
                    sb[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), d, sb[r]);
                    sb[r] = _mm256_fmadd_ps(_mm256_set1_ps((float)s32[r * (K / 32) + kb]), m, sb[r]);
                }
            }
            add_super8(rows, sb, sa, s, K, y + h * 8, O);
        }
}

#define q4k_tile(rows, qa, sa, s32, o16, K, panel, y, O) k_tile(0, rows, qa, sa, s32, K, panel, y, O)
#define q5k_tile(rows, qa, sa, s32, o16, K, panel, y, O) k_tile(1, rows, qa, sa, s32, K, panel, y, O)
#define q4b_tile(rows, qa, sa, s32, o16, K, panel, y, O) b_tile(0, rows, qa, sa, s32, K, panel, y, O)
#define q5b_tile(rows, qa, sa, s32, o16, K, panel, y, O) b_tile(1, rows, qa, sa, s32, K, panel, y, O)

DISPATCH(q4k_tile, TILE)
DISPATCH(q5k_tile, TILE)
DISPATCH(q6k_tile, TILE)
DISPATCH(q8b_tile, TILE)
DISPATCH(q4b_tile, TILE)
DISPATCH(q5b_tile, TILE)
MATMUL(matmul_q4_k, Q4K_SUPER, Q4K_TAIL, TILE, q4k_tile_rows)
MATMUL(matmul_q5_k, Q5K_SUPER, Q5K_TAIL, TILE, q5k_tile_rows)
MATMUL(matmul_q6_k, Q6K_SUPER, Q6K_TAIL, TILE, q6k_tile_rows)
MATMUL(matmul_q8_b, Q8B_SUPER, Q8B_TAIL, TILE, q8b_tile_rows)
MATMUL(matmul_q4_b, Q4B_SUPER, Q4B_TAIL, TILE, q4b_tile_rows)
MATMUL(matmul_q5_b, Q5B_SUPER, Q5B_TAIL, TILE, q5b_tile_rows)

// layer.h's sum of products with scalar.c's bits: lanes 0-7 and 8-15 in two registers, the tree as halves added.
static inline float sum16(const float *a, const float *b, int64_t n) {
    __m256 low = _mm256_setzero_ps(), high = _mm256_setzero_ps();
    int64_t whole = n - n % 16;
    for (int64_t i = 0; i < whole; i += 16) {
        low = _mm256_add_ps(low, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
        high = _mm256_add_ps(high, _mm256_mul_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8)));
    }
    __m256 w8 = _mm256_add_ps(low, high);
    return lanes8_sum(w8, a, b, whole, n);
}

#include "layer.h"
