// y[n, o] = sum_k x[n, k] w[o, k] with Intel AMX. bf16: bf16 inputs, fp32 accumulation; each output row of
// a tile accumulates its own dot products, 32 inputs per instruction, chunk after chunk in input order, so
// a row's result never depends on the other rows of the call (batch-invariant by construction).
// int8: int8 inputs (each row quantized on its own by the caller), int32 accumulation, which is exact in
// any order.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "tiles.h"  // speculant/kernels/: the tile configuration and Linux's permission (amx_ready)

#define ROWS 16   // tokens per tile
#define COLS 16   // outputs per tile (a panel)
#define CHUNK 32  // inputs per tile multiply (bf16 pairs: 16 rows of 64 bytes)

static void configure(void) {
    TileConfig c = {.palette = 1};
    for (int t = 0; t < 8; t++) { c.rows[t] = ROWS; c.colsb[t] = 64; }
    tile_configure(&c);
}

// w [O, K] with elements of `size` bytes (2: bf16, 1: int8) -> panels of 16 outputs, chunks of 64 bytes of
// inputs per output, in VNNI order: 4 / size inputs side by side; zeros past O and past K.
static void pack(const char *w, int64_t O, int64_t K, int size, char *out) {
    int64_t group = 4 / size, chunk = 64 / size;
    int64_t panels = (O + COLS - 1) / COLS, chunks = (K + chunk - 1) / chunk;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < chunks; c++)
            for (int r = 0; r < ROWS; r++)
                for (int n = 0; n < COLS; n++)
                    for (int e = 0; e < group; e++) {
                        int64_t o = p * COLS + n, k = c * chunk + group * r + e;
                        char *to = out + ((((p * chunks + c) * ROWS + r) * COLS + n) * group + e) * size;
                        if (o < O && k < K) memcpy(to, w + (o * K + k) * size, size); else memset(to, 0, size);
                    }
}

void amx_pack(const uint16_t *w, int64_t O, int64_t K, uint16_t *out) { pack((const char *)w, O, K, 2, (char *)out); }
void amx_pack_i8(const int8_t *w, int64_t O, int64_t K, int8_t *out) { pack((const char *)w, O, K, 1, (char *)out); }

// x [N, K] (elements of `size` bytes) copied into zeros of [blocks * 16, chunks * chunk]: every tile then
// loads whole rows and chunks; NULL when no copy is needed.
static void *staged(const void *x, int64_t N, int64_t K, int64_t chunk, int size, int64_t *stride) {
    int64_t rows = (N + ROWS - 1) / ROWS * ROWS, width = (K + chunk - 1) / chunk * chunk;
    *stride = width * size;
    if (rows == N && width == K) return NULL;
    char *buf = calloc(rows * width, size);
    for (int64_t r = 0; r < N; r++) memcpy(buf + r * width * size, (const char *)x + r * K * size, K * size);
    return buf;
}

// The loop both kernels share. Threads split the output panels, two per task; each 16-row block of the
// staged x runs through every 64-byte chunk of inputs in order, multiplied into one fp32 (bf16) or int32
// (int8) tile per panel. int8 results are scaled back by row and output scales, plus the bias.
static void run_tiles(const char *xs, int64_t stride, int64_t N, int64_t chunks, const char *packed, int64_t O,
                      int int8, float *y, const float *row_scale, const float *scales, const float *bias, int threads) {
    int64_t panels = (O + COLS - 1) / COLS, blocks = (N + ROWS - 1) / ROWS, pairs = (panels + 1) / 2;
    #pragma omp parallel num_threads(threads)
    {
        // These OpenMP threads may be ggml's too (one libgomp): its AMX matmul configures tiles once per thread
        // and keeps them, so leave each thread's tiles as they were found (released only if none were loaded).
        TileConfig found;
        tile_configuration(&found);
        configure();
        union { float f[ROWS * COLS]; int32_t i[ROWS * COLS]; } tile;
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < pairs; g++) {
            int64_t p0 = 2 * g, p1 = p0 + 1 < panels ? p0 + 1 : p0;
            for (int64_t b = 0; b < blocks; b++) {
                int64_t rows = N - b * ROWS < ROWS ? N - b * ROWS : ROWS;
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t c = 0; c < chunks; c++) {
                    _tile_loadd(4, xs + b * ROWS * stride + c * 64, stride);
                    _tile_loadd(5, packed + (p0 * chunks + c) * 1024, 64);
                    _tile_loadd(6, packed + (p1 * chunks + c) * 1024, 64);
                    if (int8) {
                        _tile_dpbssd(0, 4, 5);
                        _tile_dpbssd(1, 4, 6);
                    } else {
                        _tile_dpbf16ps(0, 4, 5);
                        _tile_dpbf16ps(1, 4, 6);
                    }
                }
                for (int t = 0; t < (p1 == p0 ? 1 : 2); t++) {
                    int64_t p = t ? p1 : p0, width = O - p * COLS < COLS ? O - p * COLS : COLS;
                    if (t == 0) _tile_stored(0, tile.f, COLS * 4); else _tile_stored(1, tile.f, COLS * 4);
                    for (int r = 0; r < rows; r++) {
                        float *out = y + (b * ROWS + r) * O + p * COLS;
                        if (!int8) { memcpy(out, tile.f + r * COLS, width * 4); continue; }
                        for (int n = 0; n < width; n++)
                            out[n] = (float)tile.i[r * COLS + n] * row_scale[b * ROWS + r] * scales[p * COLS + n]
                                     + (bias ? bias[p * COLS + n] : 0.0f);
                    }
                }
            }
        }
        if (found.palette) tile_configure(&found); else tile_release();
    }
}

// x [N, K] bf16, packed weights, y [N, O] fp32.
void amx_linear(const uint16_t *x, int64_t N, int64_t K, const uint16_t *packed, int64_t O, float *y, int threads) {
    int64_t stride;
    void *buf = staged(x, N, K, CHUNK, 2, &stride);
    run_tiles(buf ? buf : (const char *)x, stride, N, (K + CHUNK - 1) / CHUNK, (const char *)packed, O, 0, y, NULL,
              NULL, NULL, threads);
    free(buf);
}

#define CHUNK8 64  // int8 inputs per tile multiply (groups of 4: 16 rows of 64 bytes)

// y [N, O] fp32 = (q(x) W^T) * row scale * scales[o] + bias[o]: x [N, K] fp32, each row quantized to int8
// on its own (symmetric, scale max |x| / 127, rounded to nearest even), packed int8 weights with their
// per-output scales; bias may be NULL. The int32 sums are exact.
void amx_linear_i8(const float *x, int64_t N, int64_t K, const int8_t *packed, const float *scales,
                   const float *bias, int64_t O, float *y, int threads) {
    int64_t chunks = (K + CHUNK8 - 1) / CHUNK8, stride = chunks * CHUNK8;
    int8_t *xs = calloc((N + ROWS - 1) / ROWS * ROWS * stride, 1);
    float *row_scale = malloc(N * sizeof(float));
    for (int64_t r = 0; r < N; r++) {
        float most = 0.0f;
        for (int64_t k = 0; k < K; k++) { float a = x[r * K + k] < 0 ? -x[r * K + k] : x[r * K + k]; if (a > most) most = a; }
        float scale = most > 1e-30f ? most / 127.0f : 1e-30f;
        row_scale[r] = scale;
        for (int64_t k = 0; k < K; k++) xs[r * stride + k] = (int8_t)__builtin_rintf(x[r * K + k] / scale);
    }
    run_tiles((const char *)xs, stride, N, chunks, (const char *)packed, O, 1, y, row_scale, scales, bias, threads);
    free(xs);
    free(row_scale);
}
