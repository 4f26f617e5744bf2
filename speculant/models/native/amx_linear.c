// y[n, o] = sum_k x[n, k] w[o, k] with Intel AMX (bf16 inputs, fp32 accumulation): each output row of a
// tile accumulates its own dot products, 32 inputs per instruction, chunk after chunk in input order, so
// a row's result never depends on the other rows of the call (batch-invariant by construction).
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define ROWS 16   // tokens per tile
#define COLS 16   // outputs per tile (a panel)
#define CHUNK 32  // inputs per tile multiply (bf16 pairs: 16 rows of 64 bytes)

typedef struct { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } tile_config;

// Ask Linux for the AMX tile state; 1 on success.
int amx_init(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

static void configure(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) { c.rows[t] = ROWS; c.colsb[t] = 64; }
    _tile_loadconfig(&c);
}

// w [O, K] bf16 -> panels of 16 outputs, chunks of 32 inputs in VNNI order (pairs of inputs side by side),
// zeros past O and past K.
void amx_pack(const uint16_t *w, int64_t O, int64_t K, uint16_t *out) {
    int64_t panels = (O + COLS - 1) / COLS, chunks = (K + CHUNK - 1) / CHUNK;
    for (int64_t p = 0; p < panels; p++)
        for (int64_t c = 0; c < chunks; c++)
            for (int r = 0; r < CHUNK / 2; r++)
                for (int n = 0; n < COLS; n++)
                    for (int e = 0; e < 2; e++) {
                        int64_t o = p * COLS + n, k = c * CHUNK + 2 * r + e;
                        out[(((p * chunks + c) * (CHUNK / 2) + r) * COLS + n) * 2 + e] = o < O && k < K ? w[o * K + k] : 0;
                    }
}

// x [N, K] bf16, packed weights, y [N, O] fp32. Threads split the output panels (two per task).
void amx_linear(const uint16_t *x, int64_t N, int64_t K, const uint16_t *packed, int64_t O, float *y, int threads) {
    int64_t panels = (O + COLS - 1) / COLS, chunks = (K + CHUNK - 1) / CHUNK, blocks = (N + ROWS - 1) / ROWS;
    int64_t pairs = (panels + 1) / 2;
    #pragma omp parallel num_threads(threads)
    {
        configure();
        uint16_t xbuf[ROWS * CHUNK];
        float cbuf[ROWS * COLS];
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < pairs; g++) {
            int64_t p0 = 2 * g, p1 = p0 + 1 < panels ? p0 + 1 : p0;
            for (int64_t b = 0; b < blocks; b++) {
                int64_t rows = N - b * ROWS < ROWS ? N - b * ROWS : ROWS;
                _tile_zero(0);
                _tile_zero(1);
                for (int64_t c = 0; c < chunks; c++) {
                    int64_t width = K - c * CHUNK < CHUNK ? K - c * CHUNK : CHUNK;
                    if (rows == ROWS && width == CHUNK) {
                        _tile_loadd(4, x + b * ROWS * K + c * CHUNK, K * 2);
                    } else {  // a partial block or chunk: zeros fill the rest of the tile
                        memset(xbuf, 0, sizeof xbuf);
                        for (int r = 0; r < rows; r++) memcpy(xbuf + r * CHUNK, x + (b * ROWS + r) * K + c * CHUNK, width * 2);
                        _tile_loadd(4, xbuf, CHUNK * 2);
                    }
                    _tile_loadd(5, packed + (p0 * chunks + c) * CHUNK * COLS, 64);
                    _tile_loadd(6, packed + (p1 * chunks + c) * CHUNK * COLS, 64);
                    _tile_dpbf16ps(0, 4, 5);
                    _tile_dpbf16ps(1, 4, 6);
                }
                for (int t = 0; t < (p1 == p0 ? 1 : 2); t++) {
                    int64_t p = t ? p1 : p0, width = O - p * COLS < COLS ? O - p * COLS : COLS;
                    if (t == 0) _tile_stored(0, cbuf, COLS * 4); else _tile_stored(1, cbuf, COLS * 4);
                    for (int r = 0; r < rows; r++) memcpy(y + (b * ROWS + r) * O + p * COLS, cbuf + r * COLS, width * 4);
                }
            }
        }
        _tile_release();
    }
}
