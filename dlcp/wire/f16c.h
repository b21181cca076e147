/* Whether this CPU can run F16C code (dlcp.wire._bulk's fp16 lanes,
 * dlcp.codecs._fp16's encode): HAVE_F16C_BUILD where the compiler targets
 * x86-64, and have_f16c() at run time. Header-only; each extension has its
 * own copy of the cached answer. */
#ifndef DLCP_F16C_H
#define DLCP_F16C_H

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#define HAVE_F16C_BUILD 1
#else
#define HAVE_F16C_BUILD 0
#endif

/* Whether F16C code runs here (built for x86-64 and the CPU has F16C and AVX). */
static int
have_f16c(void)
{
#if HAVE_F16C_BUILD
    /* CPUID leaf 1: ECX bit 29 F16C, 28 AVX, 27 OSXSAVE; and the OS saves the
     * AVX state (XCR0 bits 1 and 2). Not __builtin_cpu_supports("f16c"):
     * clang before 15 does not know that name. */
    static int known = -1;
    if (known < 0) {
        unsigned int a = 0, b = 0, c = 0, d = 0;
        known = 0;
        if (__get_cpuid(1, &a, &b, &c, &d) && (c & (1u << 27)) && (c & (1u << 28))
            && (c & (1u << 29))) {
            unsigned int lo, hi;
            __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
            (void)hi;
            known = (lo & 6u) == 6u;
        }
    }
    return known;
#else
    return 0;
#endif
}

#endif
