/*
 * dlcp.wire._ghash: the ghash-aes packet MAC (see dlcp/wire/mac.py) in C.
 *
 * The same function as mac.GhashAesKey's Python path, bit for bit: AES-256-GCM
 * under the hash key with a zero 12-byte nonce, the payload as associated data
 * and the 48 header bytes as plaintext; its 16-byte tag, encrypted with one
 * AES-256 block under the PRP key, is the packet's tag.
 *
 * Why C: through the `cryptography` package each packet costs an AES-GCM
 * object call (about 0.7 us before any byte is hashed) plus joins and copies
 * in Python. Here one EVP context per key is reset per packet, and `encode`
 * builds each datagram in one allocation: the payload is copied in first and
 * the MAC then reads the copy while it is in cache.
 *
 * All methods hold the GIL; a daemon is one thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <stdint.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <immintrin.h>

#include "bytes_of.h"
#include "datagrams.h"
#include "gathered.h"

#define HEAD 48   /* header bytes a tag covers */
#define TAG 16
#define HEADER (HEAD + TAG)
_Static_assert(HEADER == GATHERED_HEADER, "a Gathered datagram holds one header");
#define NPOW 128  /* POLYVAL key powers held (a chunk of blocks reduced once) */

static const unsigned char NONCE[12] = {0};

typedef struct {
    PyObject_HEAD
    EVP_CIPHER_CTX *gcm;
    EVP_CIPHER_CTX *ecb;
    int avx512;                    /* GHASH by tag_avx512 (else OpenSSL's GCM) */
    unsigned char pw[NPOW * 16];   /* POLYVAL powers of the hash key: H^NPOW .. H^1 */
    unsigned char ks[HEAD];        /* GCM's keystream for the header (fixed nonce) */
    unsigned char ej0[16];         /* E_K(J0): the mask of GCM's tag */
    int aesni;                     /* the tag's AES by AES-NI here (rk), not by EVP */
    unsigned char rk[15 * 16] __attribute__((aligned(16))); /* AES-256 round keys, PRP key */
} MacObject;

static int avx512_usable = -1;     /* the CPU has AVX-512BW and VPCLMULQDQ (set once) */
static int avx512_setup(MacObject *self, const unsigned char *hash_key);
static int aesni_setup(MacObject *self, const unsigned char *prp_key);
#define PRP_BATCH 8 /* tags whose AES blocks are made together (tags_of) */
static void aesni_blocks(const MacObject *self, const unsigned char *in, unsigned char *out,
                         int k);

static void
Mac_dealloc(MacObject *self)
{
    EVP_CIPHER_CTX_free(self->gcm);
    EVP_CIPHER_CTX_free(self->ecb);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Mac_init(MacObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"hash_key", "prp_key", "avx512", NULL};
    Py_buffer kh, kp;
    int want_avx512 = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*y*|p", kwlist, &kh, &kp, &want_avx512))
        return -1;
    int rc = -1;
    if (kh.len != 32 || kp.len != 32) {
        PyErr_SetString(PyExc_ValueError, "both keys must be 32 bytes");
        goto done;
    }
    EVP_CIPHER_CTX_free(self->gcm);
    EVP_CIPHER_CTX_free(self->ecb);
    self->gcm = EVP_CIPHER_CTX_new();
    self->ecb = EVP_CIPHER_CTX_new();
    if (self->gcm == NULL || self->ecb == NULL
        || EVP_EncryptInit_ex(self->gcm, EVP_aes_256_gcm(), NULL, NULL, NULL) != 1
        || EVP_CIPHER_CTX_ctrl(self->gcm, EVP_CTRL_GCM_SET_IVLEN, 12, NULL) != 1
        || EVP_EncryptInit_ex(self->gcm, NULL, NULL, kh.buf, NONCE) != 1
        || EVP_EncryptInit_ex(self->ecb, EVP_aes_256_ecb(), NULL, kp.buf, NULL) != 1
        || EVP_CIPHER_CTX_set_padding(self->ecb, 0) != 1) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL could not set up AES-256-GCM/ECB");
        goto done;
    }
    self->avx512 = 0;
    if (want_avx512 && avx512_usable && avx512_setup(self, kh.buf) < 0) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL could not derive the GHASH key");
        goto done;
    }
    self->aesni = self->avx512 && aesni_setup(self, kp.buf) == 0;
    rc = 0;
done:
    PyBuffer_Release(&kh);
    PyBuffer_Release(&kp);
    return rc;
}

static void tag_avx512(const MacObject *self, const unsigned char *head,
                       const unsigned char *payload, size_t plen, unsigned char *inner);

/* GCM's tag of (head[0:48], payload[0:plen]) into inner[0:16], before the
 * PRP block (prp_blocks) makes it the packet's tag; 0 on success. */
static int
inner_of(MacObject *self, const unsigned char *head, const unsigned char *payload,
         Py_ssize_t plen, unsigned char *inner)
{
    unsigned char ct[HEAD + 16];
    int n = 0, m = 0;
    if (self->gcm == NULL || self->ecb == NULL || plen > INT_MAX)
        return -1;
    if (self->avx512) {
        tag_avx512(self, head, payload, (size_t)plen, inner);
        return 0;
    }
    if (EVP_EncryptInit_ex(self->gcm, NULL, NULL, NULL, NONCE) != 1)
        return -1;
    if (plen > 0 && EVP_EncryptUpdate(self->gcm, NULL, &n, payload, (int)plen) != 1)
        return -1;
    if (EVP_EncryptUpdate(self->gcm, ct, &n, head, HEAD) != 1)
        return -1;
    if (EVP_EncryptFinal_ex(self->gcm, ct + n, &m) != 1)
        return -1;
    if (EVP_CIPHER_CTX_ctrl(self->gcm, EVP_CTRL_GCM_GET_TAG, TAG, inner) != 1)
        return -1;
    return 0;
}

/* The PRP (AES-256 under the PRP key) of k (1 to PRP_BATCH) blocks of 16
 * bytes, in to out; 0 on success. */
static int
prp_blocks(MacObject *self, const unsigned char *in, unsigned char *out, int k)
{
    if (self->aesni) { /* EVP's call costs several times the AES itself */
        aesni_blocks(self, in, out, k);
        return 0;
    }
    int n = 0;
    if (EVP_EncryptUpdate(self->ecb, out, &n, in, TAG * k) != 1 || n != TAG * k)
        return -1;
    return 0;
}

/* The tags of k (1 to PRP_BATCH) packets (heads[j][0:48], payloads[j][0:
 * plens[j]]) into out[16 j : 16 j + 16]: their GCM tags, then their AES
 * blocks together (prp_blocks); 0 on success. With `ahead`, the next
 * payload is asked for while one is hashed (gathered_prefetch: datagrams
 * about to be sent). Received payloads follow one another in their buffer,
 * where the hardware's prefetch does as well: verify passes 0. */
static int
tags_of(MacObject *self, const unsigned char *const *heads, const unsigned char *const *payloads,
        const Py_ssize_t *plens, int k, unsigned char *out, int ahead)
{
    unsigned char inner[TAG * PRP_BATCH] = {0};
    for (int j = 0; j < k; j++) {
        if (ahead && j + 1 < k)
            gathered_prefetch((const char *)payloads[j] + plens[j],
                              (const char *)payloads[j + 1], plens[j + 1]);
        if (inner_of(self, heads[j], payloads[j], plens[j], inner + TAG * j) < 0)
            return -1;
    }
    return prp_blocks(self, inner, out, k);
}

/* The tag of (head[0:48], payload[0:plen]) into out[0:16]; 0 on success. */
static int
tag_of(MacObject *self, const unsigned char *head, const unsigned char *payload,
       Py_ssize_t plen, unsigned char *out)
{
    return tags_of(self, &head, &payload, &plen, 1, out, 0);
}

/* ---- GHASH with AVX-512 VPCLMULQDQ ------------------------------------------
 *
 * OpenSSL 3.0 hashes about 6 GB/s here (128-bit carry-less multiplies, eight
 * blocks at a time); this multiplies four blocks per 512-bit multiply by
 * their own powers of the key (up to NPOW of them held) and reduces once per
 * chunk of NPOW blocks: a datagram of up to 2 KiB once. The arithmetic is
 * POLYVAL's (RFC 8452), GHASH's byte-reversed twin:
 *   GHASH(H, X1..Xn) = rev(POLYVAL(mulX(rev(H)), rev(X1), .., rev(Xn)))
 * and POLYVAL is sum_j dot(Xj, P^(n-j+1)), dot(a, b) = a*b*x^-128 modulo
 * x^128 + x^127 + x^126 + x^121 + 1, P^k the k-fold dot power of the key: the
 * products of a chunk are summed unreduced and reduced once.
 *
 * The GCM tag with the fixed nonce is GHASH over the payload (associated data,
 * zero-padded to 16 bytes), the header's ciphertext (header XOR the keystream
 * E_K(J0+1..3), a per-key constant) and the lengths block, XOR E_K(J0). The
 * tests hold it to OpenSSL's GCM for every length around the block edges.
 */
#define AVX512 __attribute__((target("avx512f,avx512bw,vpclmulqdq,pclmul,sse4.1")))

AVX512 static inline __m128i
reduce128(__m128i lo, __m128i hi)
{
    const __m128i poly = _mm_set_epi64x((long long)0xc200000000000000ULL, 1);
    __m128i t = _mm_clmulepi64_si128(lo, poly, 0x10);
    lo = _mm_xor_si128(_mm_shuffle_epi32(lo, 0x4e), t);
    t = _mm_clmulepi64_si128(lo, poly, 0x10);
    lo = _mm_xor_si128(_mm_shuffle_epi32(lo, 0x4e), t);
    return _mm_xor_si128(lo, hi);
}

AVX512 static __m128i
dot128(__m128i a, __m128i b)
{
    __m128i lo = _mm_clmulepi64_si128(a, b, 0x00);
    __m128i hi = _mm_clmulepi64_si128(a, b, 0x11);
    __m128i mi = _mm_xor_si128(_mm_clmulepi64_si128(a, b, 0x01), _mm_clmulepi64_si128(a, b, 0x10));
    lo = _mm_xor_si128(lo, _mm_slli_si128(mi, 8));
    hi = _mm_xor_si128(hi, _mm_srli_si128(mi, 8));
    return reduce128(lo, hi);
}

AVX512 static inline __m128i
fold4(__m512i z)
{
    __m256i a = _mm256_xor_si256(_mm512_castsi512_si256(z), _mm512_extracti64x4_epi64(z, 1));
    return _mm_xor_si128(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
}

/* The products of 4 zmm of data blocks (byte-reversed) with 4 zmm of powers,
 * added into lo, hi and mi (the two middle terms unreduced). Four carry-less
 * multiplies a block: Karatsuba's three (the middle term from the halves
 * XORed, with the powers' XORed halves held beside them) measured 8 % slower
 * here (EPYC Zen 4, 1408-byte payloads: 76 ns a datagram against 70), as the
 * shuffle and XOR it adds per zmm cost more than the multiply it saves. */
#define MUL4(x, q)                                                                       \
    do {                                                                                 \
        lo = _mm512_xor_si512(lo, _mm512_clmulepi64_epi128(x, q, 0x00));                 \
        hi = _mm512_xor_si512(hi, _mm512_clmulepi64_epi128(x, q, 0x11));                 \
        mi = _mm512_ternarylogic_epi64(mi, _mm512_clmulepi64_epi128(x, q, 0x01),         \
                                       _mm512_clmulepi64_epi128(x, q, 0x10), 0x96);      \
    } while (0)

AVX512 static inline __m128i
reduce512(__m512i lo, __m512i hi, __m512i mi)
{
    __m128i l = fold4(lo), h = fold4(hi), m = fold4(mi);
    l = _mm_xor_si128(l, _mm_slli_si128(m, 8));
    h = _mm_xor_si128(h, _mm_srli_si128(m, 8));
    return reduce128(l, h);
}

/* Add the products of m (>= 1) consecutive blocks at p with the m power
 * slots from pws on (block j times slot j) into lo, hi and mi, unreduced;
 * acc joins the first block. Nothing is read past the m blocks. */
AVX512 static inline __attribute__((always_inline)) void
mul_run(__m512i *lo_, __m512i *hi_, __m512i *mi_, __m128i acc, const unsigned char *p,
        size_t m, const unsigned char *pws)
{
    const __m512i rev = _mm512_broadcast_i32x4(
        _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512i lo = *lo_, hi = *hi_, mi = *mi_;
    __m512i a = _mm512_inserti32x4(_mm512_setzero_si512(), acc, 0);
    size_t g = 0;
    for (; g + 8 <= m; g += 8, p += 128, pws += 128) {
        /* payloads hashed in place stream from memory: ask for them early */
        _mm_prefetch((const char *)(p + 1024), _MM_HINT_T0);
        _mm_prefetch((const char *)(p + 1088), _MM_HINT_T0);
        __m512i x0 = _mm512_shuffle_epi8(_mm512_loadu_si512((const void *)p), rev);
        __m512i x1 = _mm512_shuffle_epi8(_mm512_loadu_si512((const void *)(p + 64)), rev);
        x0 = _mm512_xor_si512(x0, a);
        a = _mm512_setzero_si512();
        MUL4(x0, _mm512_loadu_si512((const void *)pws));
        MUL4(x1, _mm512_loadu_si512((const void *)(pws + 64)));
    }
    for (; g < m; g += 4, p += 64, pws += 64) {
        size_t left = m - g;
        __mmask8 k = left >= 4 ? 0xff : (__mmask8)((1u << (2 * left)) - 1); /* 64-bit words */
        __m512i x = _mm512_shuffle_epi8(_mm512_maskz_loadu_epi64(k, (const void *)p), rev);
        x = _mm512_xor_si512(x, a);
        a = _mm512_setzero_si512();
        MUL4(x, _mm512_maskz_loadu_epi64(k, (const void *)pws));
    }
    *lo_ = lo;
    *hi_ = hi;
    *mi_ = mi;
}

/* POLYVAL of a packet's blocks from acc = 0: the payload's `full` whole
 * blocks, then the tail made in registers (no round trip through memory:
 * a load of bytes just stored piecewise waits for the stores): the
 * payload's partial block `pb` where `part`, the header's ciphertext and the
 * lengths block (`hz`, 4 blocks). Horner's rule over chunks of at most NPOW
 * blocks, the last chunk ending at the packet's last block: in a chunk
 * ending at block b, block j is multiplied by H^(b - j) (slot NPOW - b + j)
 * and the accumulator joins the chunk's first block, so a chunk's products
 * are summed unreduced and reduced once. A datagram of up to NPOW blocks
 * (2 KiB) is one chunk: one reduction, no chain of latencies between its
 * blocks. The tail (4 or 5 blocks) always lies in the last chunk. */
AVX512 static __m128i
polyval_all(const MacObject *self, const unsigned char *payload, size_t full, int part,
            __m128i pb, __m512i hz)
{
    size_t tn = 4 + (part != 0);
    size_t n = full + tn;
    size_t a = 0, b = n - (n - 1) / NPOW * NPOW; /* the first chunk: 1 .. NPOW blocks */
    __m128i acc = _mm_setzero_si128();
    for (; a < n; a = b, b += NPOW) {
        __m512i lo = _mm512_setzero_si512(), hi = lo, mi = lo;
        const unsigned char *pws = self->pw + (NPOW - (b - a)) * 16;
        size_t k = a < full ? (b < full ? b : full) - a : 0; /* payload blocks here */
        if (k) {
            mul_run(&lo, &hi, &mi, acc, payload + a * 16, k, pws);
            acc = _mm_setzero_si128();
        }
        if (b == n) { /* the last chunk: the tail's blocks, at the last tn slots */
            const unsigned char *tws = self->pw + (NPOW - tn) * 16;
            if (part) {
                __m512i x = _mm512_inserti32x4(_mm512_setzero_si512(), _mm_xor_si128(pb, acc), 0);
                MUL4(x, _mm512_maskz_loadu_epi64(0x3, (const void *)tws));
                acc = _mm_setzero_si128();
                tws += 16;
            }
            hz = _mm512_xor_si512(hz, _mm512_inserti32x4(_mm512_setzero_si512(), acc, 0));
            MUL4(hz, _mm512_loadu_si512((const void *)tws));
        }
        acc = reduce512(lo, hi, mi);
    }
    return acc;
}

AVX512 static void
tag_avx512(const MacObject *self, const unsigned char *head, const unsigned char *payload,
           size_t plen, unsigned char *inner)
{
    const __m128i rev = _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i rev4 = _mm512_broadcast_i32x4(rev);
    size_t full = plen / 16;
    int part = (int)(plen % 16);
    /* the payload's partial block, zero-padded */
    __m128i pb = _mm_setzero_si128();
    if (part)
        pb = _mm_shuffle_epi8(_mm512_castsi512_si128(_mm512_maskz_loadu_epi8(
                                  (__mmask64)((1u << part) - 1), (const void *)(payload + full * 16))),
                              rev);
    /* the header's ciphertext (3 blocks: header XOR keystream) and the lengths
     * block (the payload's and the header's bits, 64 bits each, big-endian) */
    __m512i hz = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)head)),
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(head + 32))), 1);
    hz = _mm512_xor_si512(hz, _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)self->ks)),
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(self->ks + 32))), 1));
    __m128i len = _mm_set_epi64x((long long)__builtin_bswap64((uint64_t)HEAD * 8),
                                 (long long)__builtin_bswap64((uint64_t)plen * 8));
    hz = _mm512_shuffle_epi8(_mm512_inserti32x4(hz, len, 3), rev4);
    __m128i acc = polyval_all(self, payload, full, part, pb, hz);
    __m128i g = _mm_shuffle_epi8(acc, rev);  /* GHASH, in the message's byte order */
    g = _mm_xor_si128(g, _mm_loadu_si128((const __m128i *)self->ej0));
    _mm_storeu_si128((__m128i *)inner, g);
}

AVX512 static void
avx512_powers(MacObject *self, const unsigned char *h_bytes)
{
    const __m128i rev = _mm_set_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m128i hr = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)h_bytes), rev);
    /* mulX: times x in POLYVAL's field (a left shift, reduced) */
    uint64_t lo = (uint64_t)_mm_cvtsi128_si64(hr);
    uint64_t hi = (uint64_t)_mm_extract_epi64(hr, 1);
    uint64_t carry = hi >> 63;
    hi = (hi << 1) | (lo >> 63);
    lo <<= 1;
    if (carry) {
        lo ^= 1;
        hi ^= 0xc200000000000000ULL;
    }
    __m128i h = _mm_set_epi64x((long long)hi, (long long)lo);
    __m128i pk = h;
    for (int k = 1; k <= NPOW; k++) {  /* P^k at slot NPOW - k */
        _mm_storeu_si128((__m128i *)(self->pw + (NPOW - k) * 16), pk);
        pk = dot128(pk, h);
    }
}

/* ---- the tag's AES-256 block with AES-NI -------------------------------------
 * The key expansion of Intel's AES-NI white paper (AES-256). Used only when
 * it agrees with OpenSSL on a block at set-up (aesni_setup). */
#define AESNI __attribute__((target("aes,sse4.1")))

/* t XOR its copies shifted up by 4, 8 and 12 bytes: each word of a round key
 * is the XOR of the previous key's words up to it */
AESNI static inline __m128i
xor_shifted(__m128i t)
{
    __m128i u = _mm_slli_si128(t, 4);
    t = _mm_xor_si128(t, u);
    u = _mm_slli_si128(u, 4);
    t = _mm_xor_si128(t, u);
    u = _mm_slli_si128(u, 4);
    return _mm_xor_si128(t, u);
}

AESNI static inline __m128i
expand_a(__m128i t1, __m128i t2)
{
    return _mm_xor_si128(xor_shifted(t1), _mm_shuffle_epi32(t2, 0xff));
}

AESNI static inline __m128i
expand_b(__m128i t1, __m128i t3)
{
    __m128i t2 = _mm_shuffle_epi32(_mm_aeskeygenassist_si128(t1, 0x00), 0xaa);
    return _mm_xor_si128(xor_shifted(t3), t2);
}

#define EXPAND(i, rcon)                                                    \
    do {                                                                   \
        t1 = expand_a(t1, _mm_aeskeygenassist_si128(t3, rcon));            \
        _mm_store_si128((__m128i *)(self->rk + 16 * (i)), t1);             \
        if ((i) < 14) {                                                    \
            t3 = expand_b(t1, t3);                                         \
            _mm_store_si128((__m128i *)(self->rk + 16 * ((i) + 1)), t3);   \
        }                                                                  \
    } while (0)

AESNI static void
aesni_expand(MacObject *self, const unsigned char *key)
{
    __m128i t1 = _mm_loadu_si128((const __m128i *)key);
    __m128i t3 = _mm_loadu_si128((const __m128i *)(key + 16));
    _mm_store_si128((__m128i *)self->rk, t1);
    _mm_store_si128((__m128i *)(self->rk + 16), t3);
    EXPAND(2, 0x01);
    EXPAND(4, 0x02);
    EXPAND(6, 0x04);
    EXPAND(8, 0x08);
    EXPAND(10, 0x10);
    EXPAND(12, 0x20);
    EXPAND(14, 0x40);
}

AESNI static void
aesni_blocks(const MacObject *self, const unsigned char *in, unsigned char *out, int k)
{
    /* PRP_BATCH independent chains of 14 rounds, interleaved so that their
     * latencies overlap, held in registers: the loops have constant bounds
     * (a chain per block of `in`, the rest repeat block 0; only k are stored).
     * With k as the bound, the chains went through memory at every round. */
    const __m128i *rk = (const __m128i *)self->rk;
    __m128i m[PRP_BATCH];
#pragma GCC unroll 8
    for (int j = 0; j < PRP_BATCH; j++)
        m[j] = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(in + 16 * (j < k ? j : 0))),
                             _mm_load_si128(rk));
#pragma GCC unroll 13
    for (int i = 1; i < 14; i++) {
        const __m128i r = _mm_load_si128(rk + i);
#pragma GCC unroll 8
        for (int j = 0; j < PRP_BATCH; j++)
            m[j] = _mm_aesenc_si128(m[j], r);
    }
    const __m128i last = _mm_load_si128(rk + 14);
#pragma GCC unroll 8
    for (int j = 0; j < PRP_BATCH; j++)
        if (j < k)
            _mm_storeu_si128((__m128i *)(out + 16 * j), _mm_aesenclast_si128(m[j], last));
}

/* Expand the PRP key for aesni_blocks where the CPU has AES-NI, and check it
 * against OpenSSL (self->ecb) on a batch of blocks: 0 to use it, -1 not to. */
static int
aesni_setup(MacObject *self, const unsigned char *prp_key)
{
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("aes"))
        return -1;
    aesni_expand(self, prp_key);
    unsigned char in[16 * PRP_BATCH], want[16 * PRP_BATCH], got[16 * PRP_BATCH];
    for (int i = 0; i < (int)sizeof in; i++)
        in[i] = (unsigned char)(i * 37 + i / 16 * 91);
    int n = 0;
    if (EVP_EncryptUpdate(self->ecb, want, &n, in, sizeof in) != 1 || n != (int)sizeof in)
        return -1;
    for (int k = 1; k <= PRP_BATCH; k++) { /* every batch size, each block its own */
        memset(got, 0, sizeof got);
        aesni_blocks(self, in, got, k);
        if (memcmp(want, got, 16 * (size_t)k) != 0)
            return -1;
    }
    return 0;
}

/* Derive H, E_K(J0) and the header keystream under the hash key; 0 on success. */
static int
avx512_setup(MacObject *self, const unsigned char *hash_key)
{
    if (avx512_usable < 0) {
        __builtin_cpu_init();
        avx512_usable = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                        && __builtin_cpu_supports("vpclmulqdq")
                        && __builtin_cpu_supports("pclmul");
    }
    if (!avx512_usable)
        return 0;
    unsigned char in[5 * 16] = {0}, out[5 * 16 + 16];
    /* block 0: zero (H); blocks 1-4: the counter blocks J0 .. J0+3 */
    for (int i = 1; i <= 4; i++)
        in[i * 16 + 15] = (unsigned char)i;
    EVP_CIPHER_CTX *ctx = EVP_CIPHER_CTX_new();
    int n = 0, ok = ctx != NULL
                    && EVP_EncryptInit_ex(ctx, EVP_aes_256_ecb(), NULL, hash_key, NULL) == 1
                    && EVP_CIPHER_CTX_set_padding(ctx, 0) == 1
                    && EVP_EncryptUpdate(ctx, out, &n, in, sizeof in) == 1 && n == sizeof in;
    EVP_CIPHER_CTX_free(ctx);
    if (!ok)
        return -1;
    memcpy(self->ej0, out + 16, 16);
    memcpy(self->ks, out + 32, HEAD);
    avx512_powers(self, out);
    OPENSSL_cleanse(out, sizeof out);
    self->avx512 = 1;
    return 0;
}

static int
openssl_failed(void)
{
    PyErr_SetString(PyExc_RuntimeError,
                    "no packet tag: the key is not set up, or OpenSSL failed");
    return -1;
}

PyDoc_STRVAR(tags_doc,
"tags(heads, payloads) -> bytes\n\n"
"The 16-byte tags of packets (48 header bytes each, payload), back to back.");

static PyObject *
Mac_tags(MacObject *self, PyObject *args)
{
    PyObject *heads, *payloads;
    if (!PyArg_ParseTuple(args, "OO", &heads, &payloads))
        return NULL;
    PyObject *hs = PySequence_Fast(heads, "heads must be a sequence");
    if (hs == NULL)
        return NULL;
    PyObject *ps = PySequence_Fast(payloads, "payloads must be a sequence");
    if (ps == NULL) {
        Py_DECREF(hs);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(hs);
    if (PySequence_Fast_GET_SIZE(ps) != n) {
        PyErr_Format(PyExc_ValueError, "%zd headers but %zd payloads", n,
                     PySequence_Fast_GET_SIZE(ps));
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, n * TAG);
    if (result == NULL)
        goto done;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    for (Py_ssize_t i = 0; i < n; i++) {
        Bytes h, p;
        if (bytes_get(PySequence_Fast_GET_ITEM(hs, i), &h) < 0)
            goto fail;
        if (h.len != HEAD) {
            bytes_release(&h);
            PyErr_Format(PyExc_ValueError, "headers must be %d bytes each", HEAD);
            goto fail;
        }
        if (bytes_get(PySequence_Fast_GET_ITEM(ps, i), &p) < 0) {
            bytes_release(&h);
            goto fail;
        }
        int bad = tag_of(self, (const unsigned char *)h.buf, (const unsigned char *)p.buf, p.len,
                         out + i * TAG);
        bytes_release(&h);
        bytes_release(&p);
        if (bad) {
            openssl_failed();
            goto fail;
        }
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    Py_DECREF(hs);
    Py_DECREF(ps);
    return result;
}

/* One datagram: the header's first 48 bytes, the tag, then the payload
 * (copied first: the MAC reads the copy just written, still in cache). */
static PyObject *
datagram_of(MacObject *self, const unsigned char *head, const void *payload, Py_ssize_t len)
{
    PyObject *dg = PyBytes_FromStringAndSize(NULL, HEADER + len);
    if (dg == NULL)
        return NULL;
    unsigned char *d = (unsigned char *)PyBytes_AS_STRING(dg);
    memcpy(d, head, HEAD);
    memcpy(d + HEADER, payload, (size_t)len);
    if (tag_of(self, d, d + HEADER, len, d + HEAD)) {
        Py_DECREF(dg);
        openssl_failed();
        return NULL;
    }
    return dg;
}

PyDoc_STRVAR(encode_doc,
"encode(heads, payloads) -> list[bytes]\n\n"
"Datagrams of packets whose 64-byte header records lie back to back in `heads`\n"
"(their tag bytes are ignored): each is the header's first 48 bytes, its tag,\n"
"then the payload.");

static PyObject *
Mac_encode(MacObject *self, PyObject *args)
{
    Py_buffer raw;
    PyObject *payloads;
    if (!PyArg_ParseTuple(args, "y*O", &raw, &payloads))
        return NULL;
    PyObject *ps = PySequence_Fast(payloads, "payloads must be a sequence");
    if (ps == NULL) {
        PyBuffer_Release(&raw);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ps);
    PyObject *list = NULL;
    if (raw.len != n * HEADER) {
        PyErr_Format(PyExc_ValueError, "%zd header bytes for %zd packets of %d", raw.len, n,
                     HEADER);
        goto done;
    }
    list = PyList_New(n);
    if (list == NULL)
        goto done;
    const unsigned char *heads = raw.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Bytes p;
        if (bytes_get(PySequence_Fast_GET_ITEM(ps, i), &p) < 0)
            goto fail;
        PyObject *dg = datagram_of(self, heads + i * HEADER, p.buf, p.len);
        bytes_release(&p);
        if (dg == NULL)
            goto fail;
        PyList_SET_ITEM(list, i, dg);
    }
    goto done;
fail:
    Py_CLEAR(list);
done:
    Py_DECREF(ps);
    PyBuffer_Release(&raw);
    return list;
}

/* encode_from's and encode_gather's arguments: n (starts and lengths: int64
 * arrays of one length) header records, each payload inside the buffer. */
static int
check_runs(const Py_buffer *raw, const Py_buffer *buf, const Py_buffer *st, const Py_buffer *ln,
           Py_ssize_t n)
{
    if (st->len % (Py_ssize_t)sizeof(int64_t) || ln->len != st->len) {
        PyErr_Format(PyExc_ValueError,
                     "starts and lengths must be int64 arrays of one length (%zd and %zd bytes)",
                     st->len, ln->len);
        return -1;
    }
    if (raw->len != n * HEADER) {
        PyErr_Format(PyExc_ValueError, "%zd header bytes for %zd packets of %d", raw->len, n,
                     HEADER);
        return -1;
    }
    const int64_t *starts = st->buf, *lengths = ln->buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (starts[i] < 0 || lengths[i] < 0 || starts[i] > buf->len
            || lengths[i] > buf->len - starts[i]) {
            PyErr_Format(PyExc_ValueError,
                         "payload %zd (%lld bytes from %lld) is outside the buffer of %zd bytes",
                         i, (long long)lengths[i], (long long)starts[i], buf->len);
            return -1;
        }
    }
    return 0;
}

PyDoc_STRVAR(encode_from_doc,
"encode_from(heads, buffer, starts, lengths) -> list[bytes]\n\n"
"`encode` with payload i the bytes buffer[starts[i] : starts[i] + lengths[i]]\n"
"(`starts` and `lengths`: native int64 arrays, one per header record): no\n"
"slice object per packet.");

/* ---- Gathered: a datagram whose payload stays where it is ------------------
 *
 * encode_gather's datagrams: the header (with its tag) is 64 bytes inside
 * the object and the payload is read in place from the caller's buffer, whose
 * one export (a Holding) the datagrams of a call share; dlcp.daemon._udp
 * sends one as two iovecs, so the
 * payload is copied once, by the kernel, instead of into a datagram first.
 * Its tag is computed when it is first needed (gathered_sealed): as it is
 * sent, the MAC reads the payload just before the kernel copies it, from
 * cache instead of memory.
 * To Python it is a read-only sequence of the datagram's bytes: len() is the
 * whole datagram's, indexing and slicing read it (header slices without a
 * copy of the payload), bytes() joins the two parts.
 */
static PyTypeObject GatheredType;

/* Holding: one export of a caller's buffer, kept while any datagram made
 * from it lives (each holds a reference); to Python a read-only buffer over
 * the same bytes (a payload's memoryview keeps it). */
typedef struct {
    PyObject_HEAD
    Py_buffer view;
} HoldingObject;

static void
Holding_dealloc(HoldingObject *self)
{
    if (self->view.obj != NULL)
        PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
Holding_getbuffer(HoldingObject *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)self, self->view.buf, self->view.len, 1, flags);
}

static PyBufferProcs Holding_as_buffer = {
    .bf_getbuffer = (getbufferproc)Holding_getbuffer,
};

static PyTypeObject HoldingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dlcp.wire._ghash.Holding",
    .tp_doc = PyDoc_STR("The payload buffer of an encode_gather call's datagrams (internal)"),
    .tp_basicsize = sizeof(HoldingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Holding_dealloc,
    .tp_as_buffer = &Holding_as_buffer,
};

/* A Holding of a new export of view->obj, which must be the same memory as
 * `view` (a caller's parsed argument); NULL with an exception set. */
static PyObject *
holding_of(const Py_buffer *view)
{
    HoldingObject *h = PyObject_New(HoldingObject, &HoldingType);
    if (h == NULL)
        return NULL;
    if (view->obj == NULL || PyObject_GetBuffer(view->obj, &h->view, PyBUF_SIMPLE) < 0) {
        if (view->obj == NULL)
            PyErr_SetString(PyExc_ValueError, "the payload buffer has no object");
        h->view.obj = NULL;
        Py_DECREF(h);
        return NULL;
    }
    if (h->view.buf != view->buf || h->view.len != view->len) { /* not the same memory */
        PyErr_SetString(PyExc_ValueError, "the payload buffer moved");
        Py_DECREF(h);
        return NULL;
    }
    return (PyObject *)h;
}

static void
Gathered_dealloc(GatheredObject *self)
{
    Py_XDECREF(self->owner);
    Py_XDECREF(self->mac);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int gathered_seal_many(GatheredObject **gs, int k);
#if GATHERED_SEAL_BATCH > PRP_BATCH
#error "gathered_seal_many makes at most PRP_BATCH AES blocks at once"
#endif

/* A Gathered of the HEAD header bytes at `head` (its tag to be computed under
 * `mac` when first needed) and len bytes at off of the Holding `holding`. */
static PyObject *
gathered_new(const unsigned char *head, PyObject *holding, Py_ssize_t off, Py_ssize_t len,
             MacObject *mac)
{
    GatheredObject *g = PyObject_New(GatheredObject, &GatheredType);
    if (g == NULL)
        return NULL;
    memcpy(g->head, head, HEAD);
    memset(g->head + HEAD, 0, TAG); /* until sealed */
    Py_INCREF(holding);
    g->owner = holding;
    g->payload = (const char *)((HoldingObject *)holding)->view.buf + off;
    g->len = len;
    g->mac = (PyObject *)mac;
    Py_INCREF(mac);
    g->seal_many = gathered_seal_many;
    return (PyObject *)g;
}

/* Seal k datagrams of one key at once (gathered.h): their tags, into their
 * headers (nobody has read those as a whole yet: the getters seal first). */
static int
gathered_seal_many(GatheredObject **gs, int k)
{
    if (k < 1 || k > GATHERED_SEAL_BATCH) {
        PyErr_Format(PyExc_SystemError, "%d datagrams to seal at once", k);
        return -1;
    }
    MacObject *mac = (MacObject *)gs[0]->mac;
    const unsigned char *heads[GATHERED_SEAL_BATCH], *payloads[GATHERED_SEAL_BATCH];
    Py_ssize_t plens[GATHERED_SEAL_BATCH];
    unsigned char tag[TAG * GATHERED_SEAL_BATCH];
    for (int j = 0; j < k; j++) {
        heads[j] = gs[j]->head;
        payloads[j] = (const unsigned char *)gathered_payload(gs[j]);
        plens[j] = gs[j]->len;
    }
    if (tags_of(mac, heads, payloads, plens, k, tag, 1))
        return openssl_failed();
    for (int j = 0; j < k; j++) {
        memcpy(gs[j]->head + HEAD, tag + TAG * j, TAG);
        gs[j]->mac = NULL;
    }
    for (int j = 0; j < k; j++)
        Py_DECREF(mac); /* each held a reference */
    return 0;
}

static PyObject *
Gathered_join(GatheredObject *self, PyObject *unused)
{
    (void)unused;
    if (gathered_sealed(self) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, HEADER + self->len);
    if (out == NULL)
        return NULL;
    char *d = PyBytes_AS_STRING(out);
    memcpy(d, self->head, HEADER);
    memcpy(d + HEADER, gathered_payload(self), (size_t)self->len);
    return out;
}

static Py_ssize_t
Gathered_length(GatheredObject *self)
{
    return HEADER + self->len;
}

static PyObject *
Gathered_subscript(GatheredObject *self, PyObject *key)
{
    Py_ssize_t n = HEADER + self->len;
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred())
            return NULL;
        if (i < 0)
            i += n;
        if (i < 0 || i >= n) {
            PyErr_SetString(PyExc_IndexError, "index out of range");
            return NULL;
        }
        if (i >= HEAD && gathered_sealed(self) < 0)
            return NULL;
        const unsigned char *p = i < HEADER ? self->head + i
                                            : (const unsigned char *)gathered_payload(self) + (i - HEADER);
        return PyLong_FromLong(*p);
    }
    if (PySlice_Check(key)) {
        Py_ssize_t start, stop, step;
        if (PySlice_Unpack(key, &start, &stop, &step) < 0)
            return NULL;
        Py_ssize_t k = PySlice_AdjustIndices(n, &start, &stop, step);
        if (!(step == 1 && stop <= HEAD) && gathered_sealed(self) < 0)
            return NULL; /* the slice may take tag bytes */
        if (step == 1 && stop <= HEADER) /* within the header: no join */
            return PyBytes_FromStringAndSize((const char *)self->head + start, k);
        if (step == 1 && start >= HEADER)
            return PyBytes_FromStringAndSize(gathered_payload(self) + (start - HEADER), k);
    }
    PyObject *whole = Gathered_join(self, NULL);
    if (whole == NULL)
        return NULL;
    PyObject *out = PyObject_GetItem(whole, key);
    Py_DECREF(whole);
    return out;
}

static PyObject *
Gathered_richcompare(PyObject *a, PyObject *b, int op)
{
    if (op != Py_EQ && op != Py_NE)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *x = Py_TYPE(a) == &GatheredType ? Gathered_join((GatheredObject *)a, NULL)
                                               : (Py_INCREF(a), a);
    if (x == NULL)
        return NULL;
    PyObject *y = Py_TYPE(b) == &GatheredType ? Gathered_join((GatheredObject *)b, NULL)
                                               : PyObject_Bytes(b);
    if (y == NULL) {
        Py_DECREF(x);
        PyErr_Clear();
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *r = PyObject_RichCompare(x, y, op);
    Py_DECREF(x);
    Py_DECREF(y);
    return r;
}

static PyObject *
Gathered_get_head(GatheredObject *self, void *closure)
{
    (void)closure;
    if (gathered_sealed(self) < 0)
        return NULL;
    return PyBytes_FromStringAndSize((const char *)self->head, HEADER);
}

static PyObject *
Gathered_get_payload(GatheredObject *self, void *closure)
{
    (void)closure;
    /* the owner's bytes: a Holding's (read-only) or a detached payload's own */
    const char *base = PyBytes_CheckExact(self->owner)
                           ? PyBytes_AS_STRING(self->owner)
                           : (const char *)((HoldingObject *)self->owner)->view.buf;
    PyObject *whole = PyMemoryView_FromObject(self->owner);
    if (whole == NULL)
        return NULL;
    Py_ssize_t off = self->payload - base;
    PyObject *out = PySequence_GetSlice(whole, off, off + self->len);
    Py_DECREF(whole);
    return out;
}

static PyObject *
Gathered_repr(GatheredObject *self)
{
    return PyUnicode_FromFormat("<Gathered datagram of %zd bytes>", HEADER + self->len);
}

static PyMappingMethods Gathered_mapping = {
    .mp_length = (lenfunc)Gathered_length,
    .mp_subscript = (binaryfunc)Gathered_subscript,
};

static PySequenceMethods Gathered_sequence = {
    .sq_length = (lenfunc)Gathered_length,
};

static PyMethodDef Gathered_methods[] = {
    {"__bytes__", (PyCFunction)Gathered_join, METH_NOARGS, "the datagram's bytes, joined"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Gathered_getset[] = {
    {"head", (getter)Gathered_get_head, NULL, "the 64 header bytes (tag included)", NULL},
    {"payload", (getter)Gathered_get_payload, NULL,
     "the payload: a memoryview of the buffer it lies in", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GatheredType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dlcp.wire._ghash.Gathered",
    .tp_doc = PyDoc_STR("A datagram as its header bytes and its payload in place (made by "
                        "GhashAes.encode_gather)"),
    .tp_basicsize = sizeof(GatheredObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)Gathered_dealloc,
    .tp_repr = (reprfunc)Gathered_repr,
    .tp_as_mapping = &Gathered_mapping,
    .tp_as_sequence = &Gathered_sequence,
    .tp_richcompare = Gathered_richcompare,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_methods = Gathered_methods,
    .tp_getset = Gathered_getset,
};

/* Give a Gathered its own copy of its payload: the buffer it was read from
 * may change from now on. */
static int
gathered_detach(GatheredObject *g)
{
    if (gathered_sealed(g) < 0) /* the tag of the payload as it is now */
        return -1;
    PyObject *own = PyBytes_FromStringAndSize(gathered_payload(g), g->len);
    if (own == NULL)
        return -1;
    PyObject *old = g->owner;
    g->owner = own;
    g->payload = PyBytes_AS_STRING(own);
    Py_DECREF(old);
    return 0;
}

PyDoc_STRVAR(detach_doc,
"detach(datagrams, shared_only=False) -> int\n\n"
"Give each Gathered datagram of the list its own copy of its payload, so that\n"
"it no longer reads the buffer it was made from (other items are left alone);\n"
"with shared_only, only those something besides the list holds (a queue).\n"
"Returns the payload bytes copied.");

#define DETACH_AHEAD 64 /* datagrams whose header `detach` asks for ahead */

static PyObject *
gathered_detach_list(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *list;
    int shared_only = 0;
    if (!PyArg_ParseTuple(args, "O!|p", &PyList_Type, &list, &shared_only))
        return NULL;
    Py_ssize_t copied = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(list); i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        /* A round's datagrams are looked at once more when it ends, long
         * after they were made and sent: each object's first line is far
         * away in memory, and asking for a few ahead overlaps the misses
         * (a 35,500-datagram leg took 0.40 ms, 0.30 asking 64 ahead). */
        if (i + DETACH_AHEAD < PyList_GET_SIZE(list))
            __builtin_prefetch(PyList_GET_ITEM(list, i + DETACH_AHEAD), 0, 0);
        if (Py_TYPE(o) != &GatheredType)
            continue;
        GatheredObject *g = (GatheredObject *)o;
        if (shared_only && Py_REFCNT(o) <= 1)
            continue;
        if (PyBytes_CheckExact(g->owner))
            continue; /* already its own */
        if (gathered_detach(g) < 0)
            return NULL;
        copied += g->len;
    }
    return PyLong_FromSsize_t(copied);
}

static PyMethodDef module_methods[] = {
    {"detach", gathered_detach_list, METH_VARARGS, detach_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(encode_gather_doc,
"encode_gather(heads, buffer, starts, lengths) -> list[Gathered]\n\n"
"`encode_from`, but each datagram keeps its payload in `buffer` (one export of\n"
"it, which the call's datagrams share) instead of a copy. The\n"
"tag is computed when the datagram is first sent (dlcp.daemon._udp) or read\n"
"whole (bytes(), its tag bytes, `head`, detach) and covers the payload as it is\n"
"then; the caller must not change those bytes while the datagram may be sent.");

/* encode_from (gather 0: datagram_of) and encode_gather (1: gathered_new). */
static PyObject *
encode_runs(MacObject *self, PyObject *args, int gather)
{
    Py_buffer raw, buf, st, ln;
    if (!PyArg_ParseTuple(args, "y*y*y*y*", &raw, &buf, &st, &ln))
        return NULL;
    PyObject *list = NULL, *holding = NULL;
    Py_ssize_t n = st.len / (Py_ssize_t)sizeof(int64_t);
    if (check_runs(&raw, &buf, &st, &ln, n) < 0)
        goto done;
    if (gather && (holding = holding_of(&buf)) == NULL)
        goto done;
    list = PyList_New(n);
    if (list == NULL)
        goto done;
    const unsigned char *heads = raw.buf, *src = buf.buf;
    const int64_t *starts = st.buf, *lengths = ln.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off = (Py_ssize_t)starts[i], len = (Py_ssize_t)lengths[i];
        PyObject *dg = gather ? gathered_new(heads + i * HEADER, holding, off, len, self)
                              : datagram_of(self, heads + i * HEADER, src + off, len);
        if (dg == NULL)
            goto fail;
        PyList_SET_ITEM(list, i, dg);
    }
    goto done;
fail:
    Py_CLEAR(list);
done:
    PyBuffer_Release(&raw);
    PyBuffer_Release(&buf);
    PyBuffer_Release(&st);
    PyBuffer_Release(&ln);
    Py_XDECREF(holding); /* the datagrams hold it */
    return list;
}

static PyObject *
Mac_encode_from(MacObject *self, PyObject *args)
{
    return encode_runs(self, args, 0);
}

static PyObject *
Mac_encode_gather(MacObject *self, PyObject *args)
{
    return encode_runs(self, args, 1);
}

PyDoc_STRVAR(verify_doc,
"verify(datagrams) -> bytes\n\n"
"Per datagram (at least 64 bytes each) 1 if its tag (bytes 48-64) is the tag\n"
"of its first 48 bytes and its payload (from byte 64), else 0. Every tag byte\n"
"is compared, so the time taken says nothing about where a forgery goes wrong.");

static PyObject *
Mac_verify(MacObject *self, PyObject *args)
{
    PyObject *datagrams;
    if (!PyArg_ParseTuple(args, "O", &datagrams))
        return NULL;
    Items ds;
    if (items_open(&ds, datagrams, "datagrams must be a sequence") < 0)
        return NULL;
    Py_ssize_t n = ds.n;
    PyObject *result = PyBytes_FromStringAndSize(NULL, n);
    if (result == NULL)
        goto done;
    unsigned char *ok = (unsigned char *)PyBytes_AS_STRING(result);
    /* PRP_BATCH datagrams at a time (tags_of), then the comparisons */
    for (Py_ssize_t i0 = 0; i0 < n; i0 += PRP_BATCH) {
        int k = n - i0 < PRP_BATCH ? (int)(n - i0) : PRP_BATCH, got = 0, bad = 0;
        Bytes d[PRP_BATCH];
        const unsigned char *heads[PRP_BATCH], *payloads[PRP_BATCH];
        Py_ssize_t plens[PRP_BATCH];
        unsigned char tag[TAG * PRP_BATCH];
        for (; got < k; got++) {
            Py_ssize_t i = i0 + got;
            if (items_get(&ds, i, &d[got]) < 0) {
                bad = 1;
                break;
            }
            if (d[got].len < HEADER) {
                PyErr_Format(PyExc_ValueError, "datagram %zd has %zd bytes, fewer than %d bytes",
                             i, d[got].len, HEADER);
                bytes_release(&d[got]);
                bad = 1;
                break;
            }
            heads[got] = (const unsigned char *)d[got].buf;
            payloads[got] = heads[got] + HEADER;
            plens[got] = d[got].len - HEADER;
        }
        if (!bad && tags_of(self, heads, payloads, plens, k, tag, 0) < 0) {
            openssl_failed();
            bad = 1;
        }
        for (int j = 0; j < got; j++) {
            if (!bad)
                ok[i0 + j] = CRYPTO_memcmp(tag + TAG * j, heads[j] + HEAD, TAG) == 0;
            bytes_release(&d[j]);
        }
        if (bad)
            goto fail;
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    items_close(&ds);
    return result;
}

static PyObject *
Mac_backend(MacObject *self, void *closure)
{
    (void)closure;
    return PyUnicode_FromString(self->avx512 ? "avx512" : "openssl");
}

static PyObject *
Mac_aesni(MacObject *self, void *closure)
{
    (void)closure;
    return PyBool_FromLong(self->aesni);
}

static PyGetSetDef Mac_getset[] = {
    {"backend", (getter)Mac_backend, NULL,
     "'avx512' (GHASH here, AVX-512 VPCLMULQDQ) or 'openssl' (OpenSSL's GCM)", NULL},
    {"aesni", (getter)Mac_aesni, NULL,
     "whether the tag's AES block is made here by AES-NI (with the avx512 backend, where "
     "the CPU has it and it agreed with OpenSSL at set-up), not by OpenSSL", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Mac_methods[] = {
    {"tags", (PyCFunction)Mac_tags, METH_VARARGS, tags_doc},
    {"encode", (PyCFunction)Mac_encode, METH_VARARGS, encode_doc},
    {"encode_from", (PyCFunction)Mac_encode_from, METH_VARARGS, encode_from_doc},
    {"encode_gather", (PyCFunction)Mac_encode_gather, METH_VARARGS, encode_gather_doc},
    {"verify", (PyCFunction)Mac_verify, METH_VARARGS, verify_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject MacType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dlcp.wire._ghash.GhashAes",
    .tp_doc = PyDoc_STR("GhashAes(hash_key, prp_key, avx512=True): the ghash-aes MAC of one "
                        "job's keys; GHASH by AVX-512 where the CPU has it and avx512 is true"),
    .tp_basicsize = sizeof(MacObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Mac_init,
    .tp_dealloc = (destructor)Mac_dealloc,
    .tp_methods = Mac_methods,
    .tp_getset = Mac_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dlcp.wire._ghash",
    "The ghash-aes packet MAC in C, over OpenSSL's EVP (see dlcp/wire/mac.py).", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__ghash(void)
{
    if (PyType_Ready(&MacType) < 0 || PyType_Ready(&GatheredType) < 0 ||
        PyType_Ready(&HoldingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&MacType);
    if (PyModule_AddObject(m, "GhashAes", (PyObject *)&MacType) < 0) {
        Py_DECREF(&MacType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&GatheredType);
    if (PyModule_AddObject(m, "Gathered", (PyObject *)&GatheredType) < 0) {
        Py_DECREF(&GatheredType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
