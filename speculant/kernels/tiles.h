// Intel AMX's tile state, shared by every speculant kernel that multiplies tiles (kernels/amx.h, and
// kernels/amx_linear.c): the configuration, Linux's permission, and the int8 tile instructions that
// kernels/amx.h uses, as inline assembly that names the memory each one reads and writes (GCC 12's
// _tile_loadconfig names 8 of the 64 bytes, what crashed ggml's native build, and its _tile_loadd none).
//
// Built with -DAMX_EMULATED, the same functions are plain C with the instructions' semantics (and their checks of
// shapes): how a CPU without AMX tests the code built on them.
#include <stdint.h>
#include <string.h>

// The tile configuration (palette 1): rows and bytes per row of tiles 0-7.
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

#ifdef AMX_EMULATED
#include <stdlib.h>

static __thread TileConfig emulated_config;
static __thread uint8_t emulated_tiles[8][16][64];

static void tile_configure(const TileConfig *config) {
    emulated_config = *config;
    memset(emulated_tiles, 0, sizeof emulated_tiles);
}
static void tile_configuration(TileConfig *config) { *config = emulated_config; }
static void tile_release(void) { memset(&emulated_config, 0, sizeof emulated_config); }

// As tileloadd: the configured rows of colsb bytes from base, each row stride bytes after the last.
static void tile_load_at(int t, const void *base, int64_t stride) {
    if (!emulated_config.palette) abort();
    memset(emulated_tiles[t], 0, sizeof emulated_tiles[t]);
    for (int r = 0; r < emulated_config.rows[t]; r++)
        memcpy(emulated_tiles[t][r], (const uint8_t *)base + r * stride, emulated_config.colsb[t]);
}
static void tile_store_at(int t, void *base, int64_t stride) {
    for (int r = 0; r < emulated_config.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, emulated_tiles[t][r], emulated_config.colsb[t]);
}
static void tile_zero_at(int t) { memset(emulated_tiles[t], 0, sizeof emulated_tiles[t]); }

// As tdpbsud: c[m][n] += the sum over k < a's colsb / 4 and i < 4 of a[m][4k + i] (s8) * b[k][4n + i] (u8);
// shapes that the instruction refuses (#UD) abort.
static void tile_dp_at(int c, int a, int b) {
    const TileConfig *tc = &emulated_config;
    if (tc->rows[c] != tc->rows[a] || tc->colsb[c] != tc->colsb[b] || tc->colsb[a] != 4 * tc->rows[b]) abort();
    for (int m = 0; m < tc->rows[c]; m++)
        for (int n = 0; n < tc->colsb[c] / 4; n++) {
            int32_t sum;
            memcpy(&sum, &emulated_tiles[c][m][4 * n], 4);
            for (int k = 0; k < tc->colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++)
                    sum += (int8_t)emulated_tiles[a][m][4 * k + i] * emulated_tiles[b][k][4 * n + i];
            memcpy(&emulated_tiles[c][m][4 * n], &sum, 4);
        }
}
#define tile_load(t, base, stride) tile_load_at(t, base, stride)
#define tile_store(t, base, stride) tile_store_at(t, base, stride)
#define tile_zero(t) tile_zero_at(t)
#define tile_dp(c, a, b) tile_dp_at(c, a, b)

int amx_ready(void) { return 1; }
#else
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static void tile_configure(const TileConfig *config) { __asm__ volatile("ldtilecfg %0" ::"m"(*config)); }
static void tile_configuration(TileConfig *config) { __asm__ volatile("sttilecfg %0" : "=m"(*config)); }
static void tile_release(void) { __asm__ volatile("tilerelease" ::); }
#define tile_load(t, base, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"(base), "r"((int64_t)(stride)) : "memory")
#define tile_store(t, base, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"(base), "r"((int64_t)(stride)) : "memory")
#define tile_zero(t) __asm__ volatile("tilezero %%tmm" #t ::)
#define tile_dp(c, a, b) __asm__ volatile("tdpbsud %%tmm" #b ", %%tmm" #a ", %%tmm" #c ::)

// Linux hands out AMX's tile state only to a process that asks for it; without it the first tile instruction
// raises SIGILL. 1 when granted.
int amx_ready(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }
#endif
