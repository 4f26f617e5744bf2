// y[n, o] = sum_k x[n, k] * w[o, k]: each output is accumulated by fused multiply-adds in the order
// k = 0 .. K-1 starting from 0, whatever the number of tokens, the tile or the thread, so a token's
// result is bit-identical however many tokens share the call (batch-invariant by construction).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PANEL 16  // output rows per packed panel: two 8-lane registers
#define TT 6      // tokens per tile: 12 accumulators + 2 weights + 1 broadcast of 16 registers

static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }

#define PACK(W) \
void pack_##W(const W *w, int64_t O, int64_t K, W *out) { \
    int64_t panels = (O + PANEL - 1) / PANEL; \
    for (int64_t p = 0; p < panels; p++) \
        for (int64_t k = 0; k < K; k++) \
            for (int j = 0; j < PANEL; j++) { \
                int64_t o = p * PANEL + j; \
                out[(p * K + k) * PANEL + j] = o < O ? w[o * K + k] : 0; \
            } \
}
typedef uint16_t bf16;
typedef float f32;
PACK(bf16)
PACK(f32)

#define TILE(T, W) \
static void tile_##W##_##T(const float *x, int64_t K, const W *panel, float *out, int64_t O, int64_t width) { \
    __m256 a0[T], a1[T]; \
    for (int t = 0; t < T; t++) { a0[t] = _mm256_setzero_ps(); a1[t] = _mm256_setzero_ps(); } \
    for (int64_t k = 0; k < K; k++) { \
        __m256 w0 = load_##W(panel + k * PANEL), w1 = load_##W(panel + k * PANEL + 8); \
        for (int t = 0; t < T; t++) { \
            __m256 xb = _mm256_broadcast_ss(x + t * K + k); \
            a0[t] = _mm256_fmadd_ps(w0, xb, a0[t]); \
            a1[t] = _mm256_fmadd_ps(w1, xb, a1[t]); \
        } \
    } \
    float buf[PANEL]; \
    for (int t = 0; t < T; t++) { \
        if (width == PANEL) { _mm256_storeu_ps(out + t * O, a0[t]); _mm256_storeu_ps(out + t * O + 8, a1[t]); } \
        else { _mm256_storeu_ps(buf, a0[t]); _mm256_storeu_ps(buf + 8, a1[t]); memcpy(out + t * O, buf, width * sizeof(float)); } \
    } \
}
#define TILES(W) TILE(1, W) TILE(2, W) TILE(3, W) TILE(4, W) TILE(5, W) TILE(6, W)
TILES(bf16)
TILES(f32)

#define LINEAR(W) \
void linear_##W(const float *x, int64_t N, int64_t K, const W *packed, int64_t O, float *y, int threads) { \
    int64_t panels = (O + PANEL - 1) / PANEL; \
    _Pragma("omp parallel for schedule(static) num_threads(threads)") \
    for (int64_t p = 0; p < panels; p++) { \
        const W *panel = packed + p * K * PANEL; \
        int64_t width = O - p * PANEL < PANEL ? O - p * PANEL : PANEL; \
        for (int64_t n = 0; n < N; n += TT) { \
            const float *xs = x + n * K; float *ys = y + n * O + p * PANEL; \
            switch (N - n < TT ? N - n : TT) { \
                case 1: tile_##W##_1(xs, K, panel, ys, O, width); break; \
                case 2: tile_##W##_2(xs, K, panel, ys, O, width); break; \
                case 3: tile_##W##_3(xs, K, panel, ys, O, width); break; \
                case 4: tile_##W##_4(xs, K, panel, ys, O, width); break; \
                case 5: tile_##W##_5(xs, K, panel, ys, O, width); break; \
                default: tile_##W##_6(xs, K, panel, ys, O, width); \
            } \
        } \
    } \
}
LINEAR(bf16)
LINEAR(f32)
