// AMX int8 (Intel's Advanced Matrix Extensions), included by avx512.c when built with -DAMX: tiles of amx_min to
// 16 rows get their integer sums from tile multiplies, fewer rows keep avx512.c's vpdpbusd kernels.
//
// A weight block unpacked as avx512.c does (q4_k: 8 registers, q6_k: 4) is already an AMX weight tile in its
// VNNI layout: row g, column j holds inputs 4g..4g+3 of output j. The activation tile holds the tile's rows'
// bytes of that block (32 or 16 inputs; the row stride is K), and tdpbsud (signed activations times unsigned
// weights) gives every row's exact int32 dot for the block's 16 outputs at once. The float work after it is
// avx512.c's, in common.h's order (one conversion and one multiply-add per row and block, the mins and offsets
// as exact integer sums), so every row's bits are the scalar reference's, whichever kernel ran it.
//
// A super-block's blocks are all unpacked before its first tile load, and all multiplied before the float work
// reads their sums (no tile instruction waits on the store just before it), two sets of tiles (activations,
// weights, sums: tmm0-2 and tmm3-5) alternating. Blocks come in pairs: 8 or 16 per super-block, 4 or 8 in a last
// half one.
//
// Built with -DAMX_EMULATED as well, the tile instructions are tiles.h's plain C: how a CPU without AMX tests this
// file's tiling, layouts and order.
#include "tiles.h"

#define AMX_TILE 16

// Tiles of fewer rows take the vpdpbusd kernels, for each kind (0: q4_k, 1: q6_k, whose tile multiplies take half
// as many inputs). kernels.amx_rows times where AMX starts to pay for each on the machine and sets it
// (amx_set_rows, which returns the value it replaces; 17: never); until then 4, where vpdpbusd turns compute-bound
// (cpu.md, "One activation scale per 256 inputs").
static int amx_min[2] = {4, 4};
int amx_set_rows(int kind, int rows) {
    if (kind < 0 || kind > 1) return -1;
    int before = amx_min[kind];
    amx_min[kind] = rows;
    return before;
}

// Tiles for rows of blocks of `inputs` (32: q4_k, 16: q6_k), both sets alike.
static void tiles_for(int rows, int inputs) {
    TileConfig config = {.palette = 1};
    for (int set = 0; set < 2; set++) {
        config.rows[3 * set] = rows, config.colsb[3 * set] = inputs;             // activations
        config.rows[3 * set + 1] = inputs / 4, config.colsb[3 * set + 1] = 64;   // weights
        config.rows[3 * set + 2] = rows, config.colsb[3 * set + 2] = 64;         // int32 sums
    }
    tile_configure(&config);
}

// Tiles of `rows` rows (a constant in each specialization, so that the rows' sb stay in registers) of q4_k's
// blocks of 32 inputs, or q6_k's of 16 (`q6`), a super-block in three passes: every block unpacked into `w`,
// every block's tile multiply with its sums stored to `dots`, the float work block by block in order.
static inline __attribute__((always_inline)) void amx_tile(const int rows, const int q6, const int8_t *qa,
                                                          const float *sa, const int16_t *s32, const int32_t *o16,
                                                          int64_t K, const uint8_t *panel, float *y, int64_t O) {
    const int super = q6 ? Q6K_SUPER : Q4K_SUPER, block = q6 ? Q6K_BLOCK : Q4K_BLOCK, blocks = q6 ? 16 : 8;
    const int inputs = 256 / blocks, head = q6 ? 32 : 64, regs = q6 ? 4 : 8;  // per block
    _Alignas(64) __m512i w[16 * 4];                       // a super-block unpacked: 16 outputs x 256 inputs
    _Alignas(64) int32_t dots[16][AMX_TILE][PANEL];       // each of up to 16 blocks' sums (about 22 KB of stack)
    for (int64_t s = 0; s < supers(K); s++) {
        const uint8_t *sp = panel + s * super;
        const int n = blocks_in(s, K, blocks);
        const int8_t *a = qa + s * 256;
        prefetch(sp + PREFETCH * super, super);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sp)), sb[AMX_TILE], scale[16];
        for (int b = 0; b < n; b++) {
            const uint8_t *bp = sp + head + b * block;
            if (q6) scale[b] = q6k_scale(d, bp), q6k_unpack(bp, w + b * regs);
            else scale[b] = q4k_scale(d, bp), q4k_unpack(bp, w + b * regs);
        }
        for (int b = 0; b < n; b += 2) {
            tile_load(0, a + b * inputs, K); tile_load(1, w + b * regs, 64); tile_zero(2); tile_dp(2, 0, 1);
            tile_load(3, a + (b + 1) * inputs, K); tile_load(4, w + (b + 1) * regs, 64); tile_zero(5);
            tile_dp(5, 3, 4);
            tile_store(2, dots[b], 64); tile_store(5, dots[b + 1], 64);
        }
        for (int r = 0; r < rows; r++) sb[r] = _mm512_setzero_ps();
        for (int b = 0; b < n; b++) {
            const int64_t kb = s * blocks + b;
#pragma GCC unroll 16
            for (int r = 0; r < rows; r++) {
                __m512i dot = _mm512_load_si512(dots[b][r]);
                if (q6) dot = _mm512_add_epi32(dot, _mm512_set1_epi32(o16[r * (K / 16) + kb]));
                sb[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale[b], sb[r]);
            }
        }
        if (!q6) q4k_mins(rows, sp, Q4K_BLOCK, s, K, s32, sb);
        add_super(rows, sb, sa, s, K, y, O);
    }
}

// Each kind's tiles, one specialization per tile height (common.h's DISPATCH).
#define q4k_amx(rows, ...) amx_tile(rows, 0, __VA_ARGS__)
#define q6k_amx(rows, ...) amx_tile(rows, 1, __VA_ARGS__)
DISPATCH(q4k_amx, AMX_TILE)
DISPATCH(q6k_amx, AMX_TILE)

// common.h's MATMUL with tiles of up to 16 rows. Each thread configures its tiles for the tile heights it meets,
// in every call that has an AMX tile, and at the end puts back the configuration it found (the tile state is the
// thread's: ggml's AMX kernels, on the same OpenMP threads, configure theirs once per thread and rely on it).
#define MATMUL_AMX(NAME, KIND, SUPER, TAIL, INPUTS, AMX_FN, VNNI_FN)                                      \
    void NAME(const int8_t *qa, const float *sa, const int16_t *s32, const int32_t *o16, int64_t rows,    \
              int64_t K, const uint8_t *packed, int64_t O, float *y, int threads) {                       \
        int64_t stride = panel_bytes(K, SUPER, TAIL);                                                     \
        const int least = amx_min[KIND];                                                                  \
        _Pragma("omp parallel num_threads(threads)") {                                                    \
            int configured = 0;                                                                           \
            TileConfig found;                                                                             \
            _Pragma("omp for schedule(static)")                                                           \
            for (int64_t p = 0; p < O / PANEL; p++)                                                       \
                for (int64_t n = 0; n < rows; n += AMX_TILE) {                                            \
                    int m = rows - n < AMX_TILE ? rows - n : AMX_TILE;                                    \
                    const int8_t *q = qa + n * K;                                                         \
                    const float *s = sa + n * supers(K);                                                  \
                    const int16_t *m32 = s32 + n * (K / 32);                                              \
                    const int32_t *m16 = o16 + n * (K / 16);                                              \
                    float *out = y + n * O + p * PANEL;                                                   \
                    for (int j = 0; m < least && j < m; j += TILE)                                        \
                        VNNI_FN(m - j < TILE ? m - j : TILE, q + j * K, s + j * supers(K),                \
                                m32 + j * (K / 32), m16 + j * (K / 16), K, packed + p * stride,           \
                                out + j * O, O);                                                          \
                    if (m < least) continue;                                                              \
                    if (!configured) tile_configuration(&found);                                          \
                    if (m != configured) tiles_for(m, INPUTS), configured = m;                            \
                    AMX_FN(m, q, s, m32, m16, K, packed + p * stride, out, O);                            \
                }                                                                                         \
            if (configured && found.palette) tile_configure(&found);                                      \
            else if (configured) tile_release();                                                          \
        }                                                                                                 \
    }
MATMUL_AMX(matmul_q4_k, 0, Q4K_SUPER, Q4K_TAIL, 32, q4k_amx_rows, q4k_tile_rows)
MATMUL_AMX(matmul_q6_k, 1, Q6K_SUPER, Q6K_TAIL, 16, q6k_amx_rows, q6k_tile_rows)
