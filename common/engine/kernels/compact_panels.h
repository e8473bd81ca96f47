/*
 * Compact panels: a bfloat16 weight in the panel layout (panels_bf16.h) in 12 bits a weight instead of 16, lossless.
 * A decode step of a few rows is bound by reading its weights, so it runs in about the time of its bytes.
 *
 * A tile's 4 panels (16 output columns each) hold, for each pair of inputs, 4 lines of 32 weights (a line: one
 * panel's 16 columns x the pair, 64 bytes in panels). A bfloat16 is a high byte (sign, exponent's top 7 bits) and a
 * low byte (exponent's last bit, 7 mantissa bits). The tile's record for a pair is 192 bytes:
 *   [0, 64)    s0: the low bytes of lines 0 and 1
 *   [64, 128)  s1: the low bytes of lines 2 and 3
 *   [128, 192) codes: a 4-bit code per weight for its high byte; the low nibble of byte q is s0[q]'s, the high
 *              one s1[q]'s
 * A code is the sign (bit 3) and a slot (bits 0-2) of a table of 8 values of the exponent's top 7 bits, one table per
 * 16 bytes of s0 or s1 (a 128-bit lane: 8 columns of two panels) for all of the tile's pairs: slot 0 holds 0 (zeros
 * and the smallest values), slots 1-7 the 7 largest values up to the lane's largest, so 14 binades below it. The
 * decoder looks a high byte up with one byte shuffle (vpshufb, a 16-entry table per lane: sign and slot) and puts it
 * beside its low byte with one interleave: no arithmetic. Weights are of a size within output columns, so a pair's
 * 128 weights fit their codes almost always; a record where one does not (a weight 2^14 times smaller than its lane's
 * largest but not near zero) is an exception: the tile's bitmap (a bit per pair, after its tables) marks it, and its
 * 4 lines are kept whole, as panels, in the blob's side section, in order. Measured (bench.compact_panels): 4.0% of
 * the records of the 1B shape's random weights, 5.7% of the embedded model's real ones; with them the blob is
 * 0.79-0.81x the panels' bytes.
 * The bytes of s0 are in the order the decoder's byte-to-word interleave (unpacklo/hi within 128-bit lanes) puts
 * back as the lines': line h's weight j (h = 0, 1) at byte 16 (j / 8) + 8 h + j % 8; s1 likewise for lines 2, 3.
 * A narrower last tile (n / 16 not a multiple of 4) is padded with zero lines.
 *
 * Decoding a pair's 4 lines costs 3 loads, 2 ands, a shift, 2 shuffles and 4 interleaves, and a test of its bit (a
 * branch almost never taken): 2-3 instructions a line, against the line's one vdpbf16ps a row. The sums run over k
 * in the panels' order: outputs equal the panels' bit for bit.
 *
 * The blob (a uint8 tensor, common/engine/compact_panels.py builds it):
 *   [0, 64)        int64 header: COMPACT_MAGIC, n, k, tiles, tile_bytes, starts_at, lines_at, exceptions
 *   64 + t * tile_bytes   tile t: tables (128 bytes: s0's lanes, then s1's), bitmap (uint64 words, padded to 64
 *                  bytes), records (k / 2 x 192)
 *   starts_at      int64 [tiles + 1]: each tile's first exception
 *   lines_at       uint16 [exceptions][4][32]: an exception's lines as the panels hold them
 */
#ifndef TESSERA_COMPACT_PANELS_H
#define TESSERA_COMPACT_PANELS_H

#include <stdint.h>

#define COMPACT_MAGIC 0x3431504354ULL /* "TCP14" */
#define COMPACT_HEADER 64
#define COMPACT_GROUP 4     /* panels a tile, as panels_bf16.h's PANEL_GROUP */
#define COMPACT_RECORD 192  /* bytes of a tile's pair */
#define COMPACT_TABLES 128  /* a tile's tables: 8 lanes x 16 entries */
enum { CH_MAGIC, CH_N, CH_K, CH_TILES, CH_TILE_BYTES, CH_STARTS_AT, CH_LINES_AT, CH_COUNT };

/* the bytes of a tile's bitmap (uint64 words, padded to 64 bytes) and of a whole tile */
static inline int64_t compact_bitmap_bytes(int64_t k) { return (k / 2 + 511) / 512 * 64; }
static inline int64_t compact_tile_bytes(int64_t k)
{
    return COMPACT_TABLES + compact_bitmap_bytes(k) + k / 2 * COMPACT_RECORD;
}

/* 0 where blob is compact panels of an [n, k] weight, else -1 */
static inline int compact_check(const uint8_t *blob, int64_t n, int64_t k)
{
    const int64_t *h = (const int64_t *)blob;
    return h[CH_MAGIC] == (int64_t)COMPACT_MAGIC && h[CH_N] == n && h[CH_K] == k
           && h[CH_TILE_BYTES] == compact_tile_bytes(k) ? 0 : -1;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#ifndef COMPACT_AHEAD /* a benchmark's build may set these */
/* bytes ahead in its tile's records the decoder prefetches: 10-11 pairs, as the panels' few-row steps prefetch 2 KB
 * ahead. The 1B shape's linears from memory at 1 row, against the panels in one process (runs of 8 rounds, the memory
 * at 28-56 GB/s; bench.compact_panels --defines COMPACT_AHEAD=6144 builds the other): 0.75-0.82x the panels' time at
 * 2 KB ahead (or none), 0.83-0.89x at 6 KB, the ratio of the bytes being 0.79x (docs/history/benchmarks-rounds.md,
 * "At 1B parameters (moved 2026-12-07)") */
#define COMPACT_AHEAD 2048
#endif
#ifndef COMPACT_CHUNK_PAIRS
#define COMPACT_CHUNK_PAIRS 64 /* pairs decoded into L1 at once for steps of more than one tile of rows: 16 KB */
#endif
#ifndef COMPACT_CHUNK_AHEAD
#define COMPACT_CHUNK_AHEAD 12288 /* bytes ahead the decoder of chunks prefetches */
#endif

/* A tile being read: its records, tables and bitmap, and the side lines of its exceptions from the pair at hand */
typedef struct {
    const uint8_t *records;
    const uint64_t *bitmap;
    const uint16_t *side;
    __m512i table0, table1;
} compact_tile_t;

/* tile t of blob (of k inputs), positioned at pair kk0 (the side lines skip the exceptions before it) */
static inline compact_tile_t compact_tile_at(const uint8_t *blob, int64_t k, int64_t t, int kk0)
{
    const int64_t *h = (const int64_t *)blob;
    const uint8_t *tile = blob + COMPACT_HEADER + t * compact_tile_bytes(k);
    compact_tile_t c;
    c.table0 = _mm512_loadu_si512(tile);
    c.table1 = _mm512_loadu_si512(tile + 64);
    c.bitmap = (const uint64_t *)(tile + COMPACT_TABLES);
    c.records = tile + COMPACT_TABLES + compact_bitmap_bytes(k);
    int64_t skip = ((const int64_t *)(blob + h[CH_STARTS_AT]))[t];
    for (int i = 0; i < kk0 / 64; i++) skip += __builtin_popcountll(c.bitmap[i]);
    if (kk0 % 64) skip += __builtin_popcountll(c.bitmap[kk0 / 64] & ((1ULL << (kk0 % 64)) - 1));
    c.side = (const uint16_t *)(blob + h[CH_LINES_AT]) + skip * COMPACT_GROUP * 32;
    return c;
}

/* w[0..4) = the tile's 4 lines at pair kk (the side lines moved past it where it is an exception); its records
 * prefetched from prefetch bytes ahead */
static inline __attribute__((always_inline)) void compact_pair(compact_tile_t *c, int kk, __m512i w[COMPACT_GROUP],
                                                               const int64_t prefetch)
{
    const uint8_t *r = c->records + (int64_t)kk * COMPACT_RECORD;
    const char *ahead = (const char *)r + prefetch;
    __builtin_prefetch(ahead, 0, 2);
    __builtin_prefetch(ahead + 64, 0, 2);
    __builtin_prefetch(ahead + 128, 0, 2);
    const __m512i low = _mm512_set1_epi8(0x0F);
    const __m512i s0 = _mm512_loadu_si512(r), s1 = _mm512_loadu_si512(r + 64), codes = _mm512_loadu_si512(r + 128);
    const __m512i h0 = _mm512_shuffle_epi8(c->table0, _mm512_and_si512(codes, low));
    const __m512i h1 = _mm512_shuffle_epi8(c->table1, _mm512_and_si512(_mm512_srli_epi16(codes, 4), low));
    w[0] = _mm512_unpacklo_epi8(s0, h0);
    w[1] = _mm512_unpackhi_epi8(s0, h0);
    w[2] = _mm512_unpacklo_epi8(s1, h1);
    w[3] = _mm512_unpackhi_epi8(s1, h1);
    if (__builtin_expect((c->bitmap[kk >> 6] >> (kk & 63)) & 1, 0)) { /* an exception: its lines as they are */
        for (int z = 0; z < COMPACT_GROUP; z++) w[z] = _mm512_loadu_si512(c->side + z * 32);
        c->side += COMPACT_GROUP * 32;
    }
}
#endif

#endif
