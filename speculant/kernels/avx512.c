// AVX-512 VNNI: a 16-lane register holds one panel's 16 outputs; each weight block is unpacked once into
// 8 (q4_k, q5_k, q8_b, q4_b, q5_b) or 4 (q6_k) registers of four inputs per output, and every row of the tile
// multiplies it by its four activation bytes broadcast (vpdpbusd: u8 weights x s8 activations into exact int32
// sums); then per row and block one conversion and one multiply-add, in common.h's order.
//
// Built with -DAMX (and where the CPU has AMX int8), tiles of up to 16 rows take amx.h's kernels instead from as
// many rows as those pay on the machine: the same unpacked registers are one AMX weight tile, and the integer sums
// come from a tile multiply.
#include <immintrin.h>
#include "common.h"

#define TILE 8

// dot += w (u8) x the four activation bytes at a (s8), broadcast from memory within the instruction: GCC
// loads them with a separate vpbroadcastd per row and group, which costs as much issue width as the multiply.
static inline __attribute__((always_inline)) __m512i dpbusd_at(__m512i dot, __m512i w, const int8_t *a) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot) : "v"(w), "m"(*(const int32_t *)a));
    return dot;
}

// A super-block's sums land in y (L1-resident), the tile's outputs: sums and weights then fit the 32 registers.
static inline __attribute__((always_inline)) void add_super(const int rows, const __m512 *sb, const float *sa,
                                                           int64_t s, int64_t K, float *y, int64_t O) {
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(y + r * O, _mm512_fmadd_ps(sb[r], _mm512_set1_ps(sa[r * supers(K) + s]),
                                                    s ? _mm512_loadu_ps(y + r * O) : _mm512_setzero_ps()));
}

// Block b's weights unpacked: 8 registers of 4 inputs per output (byte j*4 + t of register g: input 4g + t of
// output j), the layout vpdpbusd multiplies and AMX's weight tile (a register a tile row); the block's scales.
static inline __attribute__((always_inline)) void q4k_unpack(const uint8_t *bp, __m512i *w) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        __m512i raw = _mm512_loadu_si512(bp + 32 + c * 64);
        w[c] = _mm512_and_si512(raw, low);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
}

// q5_k's and q5_b's five bits: q4_k's nibbles (at `nibbles`), each with its high bit from the 64 bytes after them
// (bit 2c: that of group c's low nibble, 2c + 1: its high one) moved to bit 4. A 16-bit lane's shift by at most 4
// (left) or 3 (right) moves no bit of one byte to bit 4 of the other.
static inline __attribute__((always_inline)) void q5_unpack(const uint8_t *nibbles, __m512i *w) {
    const __m512i low = _mm512_set1_epi8(0x0F), bit = _mm512_set1_epi8(0x10);
    const __m512i plane = _mm512_loadu_si512(nibbles + 256);
    for (int c = 0; c < 4; c++) {
        __m512i raw = _mm512_loadu_si512(nibbles + c * 64);
        __m512i lo_bit = 2 * c <= 4 ? _mm512_sll_epi16(plane, _mm_cvtsi32_si128(4 - 2 * c))
                                    : _mm512_srl_epi16(plane, _mm_cvtsi32_si128(2 * c - 4));
        __m512i hi_bit = 2 * c + 1 <= 4 ? _mm512_sll_epi16(plane, _mm_cvtsi32_si128(3 - 2 * c))
                                        : _mm512_srl_epi16(plane, _mm_cvtsi32_si128(2 * c - 3));
        w[c] = _mm512_or_si512(_mm512_and_si512(raw, low), _mm512_and_si512(lo_bit, bit));
        w[c + 4] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), low), _mm512_and_si512(hi_bit, bit));
    }
}

static inline __m512 q4k_scale(__m512 d, const uint8_t *bp) {
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bp))));
}

// q6_k's block of 16 inputs: 4 registers, as q4_k's 8.
static inline __attribute__((always_inline)) void q6k_unpack(const uint8_t *bp, __m512i *w) {
    const __m512i low = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
    __m512i lo0 = _mm512_loadu_si512(bp + 16), lo1 = _mm512_loadu_si512(bp + 80), hi = _mm512_loadu_si512(bp + 144);
    w[0] = _mm512_or_si512(_mm512_and_si512(lo0, low), _mm512_slli_epi16(_mm512_and_si512(hi, two), 4));
    w[1] = _mm512_or_si512(_mm512_and_si512(lo1, low), _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hi, 2), two), 4));
    w[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo0, 4), low), _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hi, 4), two), 4));
    w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo1, 4), low), _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hi, 6), two), 4));
}

static inline __m512 q6k_scale(__m512 d, const uint8_t *bp) {
    return _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)bp))));
}

// q4_k's (q5_k's: blocks of `block` bytes) mins of super-block s: each lane's m of blocks 2j and 2j + 1 as int16
// pairs, times the rows' pairs of sums (vpdpwssd), taken from the rows' sb.
static inline __attribute__((always_inline)) void q4k_mins(const int rows, const uint8_t *sp, int64_t block,
                                                          int64_t s, int64_t K, const int16_t *s32, __m512 *sb) {
    __m512i mins[4];
    for (int j = 0; j < blocks_in(s, K, 8) / 2; j++) {
        const uint8_t *m = sp + 64 + 2 * j * block + 16;
        __m512i even = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)m));
        __m512i odd = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(m + block)));
        mins[j] = _mm512_or_si512(even, _mm512_slli_epi32(odd, 16));
    }
    __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sp + 32)));
#pragma GCC unroll 16
    for (int r = 0; r < rows; r++) {
        const int16_t *sums = s32 + r * (K / 32) + s * 8;
        __m512i total = _mm512_setzero_si512();
        for (int j = 0; j < blocks_in(s, K, 8) / 2; j++) {
            __m512i pair = _mm512_set1_epi32(load32((const int8_t *)(sums + 2 * j)));
            total = _mm512_dpwssd_epi32(total, mins[j], pair);
        }
        sb[r] = _mm512_fnmadd_ps(dmin, _mm512_cvtepi32_ps(total), sb[r]);
    }
}

// q4_k, and q5_k (`five`: each block's high bits after its nibbles).
static inline __attribute__((always_inline)) void k_tile(const int five, const int rows, const int8_t *qa,
                                                        const float *sa, const int16_t *s32, int64_t K,
                                                        const uint8_t *panel, float *y, int64_t O) {
    const int64_t super = five ? Q5K_SUPER : Q4K_SUPER, block = five ? Q5K_BLOCK : Q4K_BLOCK;
    for (int64_t s = 0; s < supers(K); s++) {
        const uint8_t *sp = panel + s * super;
        prefetch(sp + PREFETCH * super, super);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sp)), sb[TILE];
        for (int r = 0; r < rows; r++) sb[r] = _mm512_setzero_ps();
        for (int b = 0; b < blocks_in(s, K, 8); b++) {
            const uint8_t *bp = sp + 64 + b * block;
            __m512 scale = q4k_scale(d, bp);
            __m512i w[8];
            if (five) q5_unpack(bp + 32, w);
            else q4k_unpack(bp, w);
            int64_t kb = s * 8 + b;
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                const int8_t *a = qa + r * K + kb * 32;
                __m512i dot = _mm512_setzero_si512();
                for (int g = 0; g < 8; g++) dot = dpbusd_at(dot, w[g], a + 4 * g);
                sb[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, sb[r]);
            }
        }
        q4k_mins(rows, sp, block, s, K, s32, sb);
        add_super(rows, sb, sa, s, K, y, O);
    }
}

static inline __attribute__((always_inline)) void q6k_tile(const int rows, const int8_t *qa, const float *sa,
                                                          const int16_t *s32, const int32_t *o16, int64_t K,
                                                          const uint8_t *panel, float *y, int64_t O) {
    for (int64_t s = 0; s < supers(K); s++) {
        const uint8_t *sp = panel + s * Q6K_SUPER;
        prefetch(sp + PREFETCH * Q6K_SUPER, Q6K_SUPER);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sp)), sb[TILE];
        for (int r = 0; r < rows; r++) sb[r] = _mm512_setzero_ps();
        for (int b = 0; b < blocks_in(s, K, 16); b++) {
            const uint8_t *bp = sp + 32 + b * Q6K_BLOCK;
            __m512 scale = q6k_scale(d, bp);
            __m512i w[4];
            q6k_unpack(bp, w);
            int64_t k16 = s * 16 + b;
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                const int8_t *a = qa + r * K + k16 * 16;
                __m512i dot = _mm512_set1_epi32(o16[r * (K / 16) + k16]);
                for (int g = 0; g < 4; g++) dot = dpbusd_at(dot, w[g], a + 4 * g);
                sb[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, sb[r]);
            }
        }
        add_super(rows, sb, sa, s, K, y, O);
    }
}

// q8_b's, q4_b's and q5_b's (`bits`) blocks: 8 registers of q + 128 as they lie (the dot then starts at -128 times
// the activations' sum, q's offset), or q4_k's nibbles unpacked as q4_k's (their header 32 bytes longer), with
// q5_k's high bits for q5_b; then d*dot + m*sum.
static inline __attribute__((always_inline)) void blocks32_tile(const int bits, const int rows, const int8_t *qa,
                                                               const float *sa, const int16_t *s32, int64_t K,
                                                               const uint8_t *panel, float *y, int64_t O) {
    const int64_t block = bits == 8 ? Q8B_BLOCK : bits == 5 ? Q5B_BLOCK : Q4B_BLOCK;
    for (int64_t s = 0; s < supers(K); s++) {
        const uint8_t *sp = panel + s * 8 * block;
        prefetch(sp + PREFETCH * 8 * block, 8 * block);
        __m512 sb[TILE];
        for (int r = 0; r < rows; r++) sb[r] = _mm512_setzero_ps();
        for (int b = 0; b < blocks_in(s, K, 8); b++) {
            const uint8_t *bp = sp + b * block;
            __m512 d, m;
            __m512i w[8];
            if (bits != 8) {
                d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)bp));
                m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(bp + 32)));
                if (bits == 5) q5_unpack(bp + 64, w);
                else q4k_unpack(bp + 32, w);
            } else {
                d = _mm512_loadu_ps(bp), m = _mm512_loadu_ps(bp + 64);
                for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(bp + 128 + g * 64);
            }
            int64_t kb = s * 8 + b;
#pragma GCC unroll 8
            for (int r = 0; r < rows; r++) {
                const int8_t *a = qa + r * K + kb * 32;
                int32_t sum = s32[r * (K / 32) + kb];
                __m512i dot = _mm512_set1_epi32(bits == 8 ? -128 * sum : 0);
                for (int g = 0; g < 8; g++) dot = dpbusd_at(dot, w[g], a + 4 * g);
                sb[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, sb[r]);
                sb[r] = _mm512_fmadd_ps(_mm512_set1_ps((float)sum), m, sb[r]);
            }
        }
        add_super(rows, sb, sa, s, K, y, O);
    }
}

#define q4k_tile(rows, qa, sa, s32, o16, K, panel, y, O) k_tile(0, rows, qa, sa, s32, K, panel, y, O)
#define q5k_tile(rows, qa, sa, s32, o16, K, panel, y, O) k_tile(1, rows, qa, sa, s32, K, panel, y, O)
#define q8b_tile(rows, qa, sa, s32, o16, K, panel, y, O) blocks32_tile(8, rows, qa, sa, s32, K, panel, y, O)
#define q4b_tile(rows, qa, sa, s32, o16, K, panel, y, O) blocks32_tile(4, rows, qa, sa, s32, K, panel, y, O)
#define q5b_tile(rows, qa, sa, s32, o16, K, panel, y, O) blocks32_tile(5, rows, qa, sa, s32, K, panel, y, O)

DISPATCH(q4k_tile, TILE)
DISPATCH(q6k_tile, TILE)
DISPATCH(q8b_tile, TILE)
DISPATCH(q4b_tile, TILE)
DISPATCH(q5k_tile, TILE)
DISPATCH(q5b_tile, TILE)
MATMUL(matmul_q5_k, Q5K_SUPER, Q5K_TAIL, TILE, q5k_tile_rows)
MATMUL(matmul_q5_b, Q5B_SUPER, Q5B_TAIL, TILE, q5b_tile_rows)
MATMUL(matmul_q8_b, Q8B_SUPER, Q8B_TAIL, TILE, q8b_tile_rows)
MATMUL(matmul_q4_b, Q4B_SUPER, Q4B_TAIL, TILE, q4b_tile_rows)
#ifdef AMX
#include "amx.h"
#else
MATMUL(matmul_q4_k, Q4K_SUPER, Q4K_TAIL, TILE, q4k_tile_rows)
MATMUL(matmul_q6_k, Q6K_SUPER, Q6K_TAIL, TILE, q6k_tile_rows)
#endif

// layer.h's sum of products with scalar.c's bits: the 16 lanes in one register, the tree as its halves added.
static inline float sum16(const float *a, const float *b, int64_t n) {
    __m512 lanes = _mm512_setzero_ps();
    int64_t whole = n - n % 16;
    for (int64_t i = 0; i < whole; i += 16)
        lanes = _mm512_add_ps(lanes, _mm512_mul_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i)));
    __m256 w8 = _mm256_add_ps(_mm512_castps512_ps256(lanes),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
    return lanes8_sum(w8, a, b, whole, n);
}

#include "layer.h"
