/*
 * AMX tiles (Intel Xeon from Sapphire Rapids): asking Linux for them and configuring them, shared by the kernels
 * that multiply on them (panels_bf16.h for bfloat16 panels, int8_gemm.c for W8A8, paged_attention.c for prompt
 * chunks). Linux gives a process the
 * tiles' state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); amx_ready asks on its first
 * call and remembers the answer, so a kernel where it is refused takes its path without tiles.
 */
#ifndef TESSERA_AMX_H
#define TESSERA_AMX_H

#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

/* the 64-byte tile configuration of palette 1 (ldtilecfg's operand) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config_t;

/* 1 once Linux lets this process use the tiles (asked on the first call), else 0 */
static int amx_ready(void)
{
    static int state; /* 0: not asked yet, 1: granted, -1: refused */
    int s = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0 ? 1 : -1;
        __atomic_store_n(&state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

/* tiles 0-7 configured for this thread: tile t has rows[t] rows of 64 bytes */
static void amx_configure(const uint8_t rows[8])
{
    amx_config_t cfg;
    __builtin_memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = rows[t];
        cfg.colsb[t] = 64;
    }
    /* not _tile_loadconfig: GCC 12's tells the compiler it reads 8 bytes of the configuration, so the stores of
     * the rest may be dropped (an invalid configuration: the tiles fault); the whole struct as the operand */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
}
#endif

#endif
