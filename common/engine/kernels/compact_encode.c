/*
 * Builds compact panels (compact_panels.h, which gives the format) from a row-major bfloat16 weight [n][k], at load:
 * tessera_compact_bytes sizes the blob (its exceptions decide it) and tessera_compact_encode writes it. Plain C: it
 * runs once per weight, over the tiles in parallel.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "compact_panels.h"

#define COLS 16 /* panels_bf16.h's PANEL_COLS */
#define GROUP COMPACT_GROUP

static int valid(int64_t n, int64_t k)
{
    return n >= COLS && n % COLS == 0 && k >= 2 && k % 2 == 0 && n <= INT32_MAX && k <= INT32_MAX;
}

/* the weight of tile t's line z at pair kk, natural position j (column j / 2, input 2 kk + j % 2); 0 past n */
static inline uint16_t at(const uint16_t *w, int64_t n, int64_t k, int64_t t, int z, int64_t kk, int j)
{
    const int64_t row = (t * GROUP + z) * COLS + j / 2;
    return row < n ? w[row * k + 2 * kk + j % 2] : 0;
}

static inline int top7(uint16_t v) { return (v >> 8) & 0x7F; } /* the exponent's top 7 bits */

/* the byte of s0 (z < 2) or s1 that holds line z's weight j, and its lane's table among the tile's (s1's after s0's) */
static inline int byte_of(int z, int j) { return 16 * (j / 8) + 8 * (z & 1) + j % 8; }
static inline int lane_of(int z, int j) { return 4 * (z >> 1) + j / 8; }

/* the largest top 7 exponent bits of each of tile t's 8 lanes over its pairs */
static void tops(const uint16_t *w, int64_t n, int64_t k, int64_t t, int top[8])
{
    for (int l = 0; l < 8; l++) top[l] = 0;
    for (int z = 0; z < GROUP; z++)
        for (int j = 0; j < 32; j++) { /* along the weight's row: one column's inputs of one parity */
            const int64_t row = (t * GROUP + z) * COLS + j / 2;
            int *e = &top[lane_of(z, j)];
            for (int64_t i = j % 2; row < n && i < k; i += 2) {
                const int x = top7(w[row * k + i]);
                *e = x > *e ? x : *e;
            }
        }
}

/* the code of v in a lane whose largest top 7 exponent bits are top (sign << 3 | slot), or -1 where no slot holds
 * it: slot 0 holds 0, slot i (1-7) top - 7 + i */
static inline int code_of(uint16_t v, int top)
{
    const int e = top7(v), slot = e == 0 ? 0 : e - top + 7;
    return e != 0 && slot < 1 ? -1 : (v >> 15) << 3 | slot;
}

/* tile t's tables: entry c of a lane, the high byte of sign c >> 3 and slot c & 7 */
static void tables(const int top[8], uint8_t table[COMPACT_TABLES])
{
    for (int l = 0; l < 8; l++)
        for (int c = 0; c < 16; c++) {
            const int slot = c & 7, e = slot == 0 ? 0 : (top[l] - 7 + slot > 0 ? top[l] - 7 + slot : 0);
            table[16 * l + c] = (uint8_t)((c >> 3) << 7 | e);
        }
}

/* whether tile t's pair kk has a weight no slot holds */
static int exception(const uint16_t *w, int64_t n, int64_t k, int64_t t, int64_t kk, const int top[8])
{
    for (int z = 0; z < GROUP; z++)
        for (int j = 0; j < 32; j++)
            if (code_of(at(w, n, k, t, z, kk, j), top[lane_of(z, j)]) < 0) return 1;
    return 0;
}

/* the exceptions of every tile of w */
static void count(const uint16_t *w, int64_t n, int64_t k, int64_t *counts)
{
    const int64_t tiles = (n / COLS + GROUP - 1) / GROUP;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        int top[8];
        tops(w, n, k, t, top);
        int64_t c = 0;
        for (int64_t kk = 0; kk < k / 2; kk++) c += exception(w, n, k, t, kk, top);
        counts[t] = c;
    }
}

static int64_t layout(int64_t n, int64_t k, int64_t exceptions, int64_t *starts_at, int64_t *lines_at)
{
    const int64_t tiles = (n / COLS + GROUP - 1) / GROUP;
    *starts_at = COMPACT_HEADER + tiles * compact_tile_bytes(k);
    *lines_at = (*starts_at + 8 * (tiles + 1) + 63) / 64 * 64;
    return *lines_at + exceptions * GROUP * 64;
}

/* *bytes = the size of w's compact panels; -1 for shapes the panels do not take or without memory */
int tessera_compact_bytes(const uint16_t *w, int64_t n, int64_t k, int64_t *bytes)
{
    if (!valid(n, k)) return -1;
    const int64_t tiles = (n / COLS + GROUP - 1) / GROUP;
    int64_t *counts = malloc(sizeof(int64_t) * tiles), total = 0, starts_at, lines_at;
    if (counts == NULL) return -1;
    count(w, n, k, counts);
    for (int64_t t = 0; t < tiles; t++) total += counts[t];
    free(counts);
    *bytes = layout(n, k, total, &starts_at, &lines_at);
    return 0;
}

/* writes w's compact panels into blob (bytes long, as tessera_compact_bytes gave); -1 for shapes the panels do not
 * take, a size that differs, or without memory */
int tessera_compact_encode(const uint16_t *w, int64_t n, int64_t k, uint8_t *blob, int64_t bytes)
{
    if (!valid(n, k)) return -1;
    const int64_t tiles = (n / COLS + GROUP - 1) / GROUP, pairs = k / 2;
    int64_t *counts = malloc(sizeof(int64_t) * tiles), starts_at, lines_at;
    if (counts == NULL) return -1;
    count(w, n, k, counts);
    int64_t total = 0;
    for (int64_t t = 0; t < tiles; t++) total += counts[t];
    if (layout(n, k, total, &starts_at, &lines_at) != bytes) {
        free(counts);
        return -1;
    }
    memset(blob, 0, COMPACT_HEADER);
    int64_t *h = (int64_t *)blob;
    h[CH_MAGIC] = (int64_t)COMPACT_MAGIC;
    h[CH_N] = n;
    h[CH_K] = k;
    h[CH_TILES] = tiles;
    h[CH_TILE_BYTES] = compact_tile_bytes(k);
    h[CH_STARTS_AT] = starts_at;
    h[CH_LINES_AT] = lines_at;
    h[CH_COUNT] = total;
    int64_t *starts = (int64_t *)(blob + starts_at);
    starts[0] = 0;
    for (int64_t t = 0; t < tiles; t++) starts[t + 1] = starts[t] + counts[t];
    free(counts);
    memset(blob + starts_at + 8 * (tiles + 1), 0, (size_t)(lines_at - starts_at - 8 * (tiles + 1)));
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++) {
        uint8_t *tile = blob + COMPACT_HEADER + t * compact_tile_bytes(k);
        uint64_t *bitmap = (uint64_t *)(tile + COMPACT_TABLES);
        uint8_t *records = tile + COMPACT_TABLES + compact_bitmap_bytes(k);
        uint16_t *side = (uint16_t *)(blob + lines_at) + starts[t] * GROUP * 32;
        int top[8];
        tops(w, n, k, t, top);
        tables(top, tile);
        memset(bitmap, 0, (size_t)compact_bitmap_bytes(k));
        for (int64_t kk = 0; kk < pairs; kk++) {
            uint8_t *r = records + kk * COMPACT_RECORD;
            memset(r + 128, 0, 64);
            for (int z = 0; z < GROUP; z++)
                for (int j = 0; j < 32; j++) {
                    const uint16_t v = at(w, n, k, t, z, kk, j);
                    const int q = byte_of(z, j), code = code_of(v, top[lane_of(z, j)]);
                    r[64 * (z >> 1) + q] = (uint8_t)(v & 0xFF);
                    r[128 + q] |= (uint8_t)((code < 0 ? 0 : code) << (4 * (z >> 1)));
                }
            if (exception(w, n, k, t, kk, top)) {
                bitmap[kk / 64] |= 1ULL << (kk % 64);
                for (int z = 0; z < GROUP; z++)
                    for (int j = 0; j < 32; j++) side[z * 32 + j] = at(w, n, k, t, z, kk, j);
                side += GROUP * 32;
            }
        }
    }
    return 0;
}
