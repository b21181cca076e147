/* The lane stores of every codec whose wire lanes are not the accumulator's
 * dtype (dlcp.wire._bulk.store_lanes, pick): included by _bulk.c only.
 *
 * store_lanes(dest, kind, table, starts, counts, payloads, skip=0) -> None
 *
 *   For each i in order: dest[starts[i] : starts[i] + counts[i]] (in lanes)
 *   = the lanes of payloads[i][skip:], unpacked as `kind` says:
 *
 *     KIND_TABLE16  16-bit little-endian codes, each a 4-byte entry of
 *                   `table` (65536 entries): fp16 lanes into float32, the
 *                   table being numpy's own cast of every half (bit exact,
 *                   NaN payloads included)
 *     KIND_TABLE8   8-bit codes, each a 4-byte entry of `table` (256): fft's
 *                   range floats into float32
 *     KIND_U8       8-bit lanes into uint16 (THC8 data, THC4_SUM8 sums)
 *     KIND_U4       4-bit lanes packed low nibble first into uint16 (THC4 data)
 *     KIND_U10      10-bit lanes packed LSB first into uint16 (THC8_SUM10)
 *     KIND_BIT      1-bit lanes LSB first into uint16 as 0/1 (UNION)
 *     KIND_F16C     KIND_TABLE16's fp16 lanes by the CPU's F16C conversion
 *                   (vcvtph2ps; signalling NaNs kept as numpy keeps them), no
 *                   table: ValueError where the CPU lacks it.
 *                   dlcp.codecs.lanes takes it only where it gives the
 *                   table's bits for all 65536 halves (numpy's cast)
 *
 *   dest is a writable C-contiguous buffer of 4-byte (TABLE kinds) or 2-byte
 *   lanes; table is None for the other kinds. The payload of count lanes
 *   must be (count * bits + 7) / 8 bytes (`dlcp.wire.header.lane_bytes`):
 *   else LengthError, the packets before it stored (as
 *   `dlcp.codecs.lanes.store_many`, the Python definition, does); bits past
 *   the last lane are ignored, as numpy's unpacking ignores them. A run
 *   outside dest raises IndexError, a bad argument TypeError or ValueError.
 *
 * to_halves(src, dest) -> None
 *
 *   dest (2-byte lanes, writable, C-contiguous) = src (float32 lanes, as
 *   many) cast to fp16 by the CPU's F16C conversion (vcvtps2ph, rounding to
 *   nearest even), NaNs made as numpy makes them (sign, 0x7c00 plus the top
 *   ten bits of the mantissa, never an infinity) where the instruction would
 *   quiet them: numpy's astype("<f2") bit for bit, about 40 times faster here
 *   (dlcp.codecs.lanes checks that at import and uses numpy otherwise).
 *   ValueError where the CPU lacks F16C or the lengths differ.
 *
 * pack_u10(src, dest) -> None
 *
 *   THC8's sums (uint16 lanes, src) as THC8_SUM10's 10-bit lanes, LSB first,
 *   into dest ((n * 10 + 7) / 8 bytes): each four lanes a 40-bit word
 *   v0 | v1 << 10 | v2 << 20 | v3 << 30 (the last four padded with zeros)
 *   in five little-endian bytes, as `dlcp.codecs.lanes.narrow_bytes` makes
 *   them in numpy (also for values that do not fit, which its callers refuse
 *   first). ValueError where the lengths do not agree.
 *
 * pick(datagrams, index) -> Datagrams | list
 *
 *   datagrams[index[0]], datagrams[index[1]], ... (index: int64, each in
 *   range, else IndexError): for a Datagrams another Datagrams over the same
 *   buffers (no object a datagram), for a list or tuple a list. What a drain
 *   from several senders is reordered with, and what a run's stored packets
 *   are taken with when some of them are not (duplicates, bad ones).
 */
#ifndef DLCP_LANE_STORE_H
#define DLCP_LANE_STORE_H

#include "f16c.h" /* HAVE_F16C_BUILD, have_f16c() */

enum { KIND_TABLE16, KIND_TABLE8, KIND_U8, KIND_U4, KIND_U10, KIND_BIT, KIND_F16C, N_KINDS };

static const int kind_bits[N_KINDS] = {16, 8, 8, 4, 10, 1, 16};
static const int kind_width[N_KINDS] = {4, 4, 2, 2, 2, 2, 4};
static const Py_ssize_t kind_table[N_KINDS] = {65536, 256, 0, 0, 0, 0, 0};

#if HAVE_F16C_BUILD
/* Eight halves to float32 by vcvtph2ps, as numpy casts them: the
 * instruction quiets a signalling NaN (sets bit 22), numpy's cast keeps its
 * bits (sign, all-ones exponent, the mantissa shifted), so that bit is
 * cleared again in the lanes that held one (exponent all ones, quiet bit
 * clear, mantissa not zero). */
__attribute__((target("avx,f16c"))) static inline void
eight_halves(float *out, __m128i h)
{
    __m256 f = _mm256_cvtph_ps(h);
    __m128i nan_exp = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x7e00)),
                                      _mm_set1_epi16(0x7c00));
    __m128i payload = _mm_cmpeq_epi16(_mm_and_si128(h, _mm_set1_epi16(0x01ff)),
                                      _mm_setzero_si128());
    __m128i snan = _mm_andnot_si128(payload, nan_exp);
    _mm256_storeu_ps(out, f);
    if (_mm_movemask_epi8(snan)) {
        uint16_t flags[8];
        _mm_storeu_si128((__m128i *)(void *)flags, snan);
        for (int k = 0; k < 8; k++)
            if (flags[k]) {
                uint32_t v;
                memcpy(&v, out + k, 4);
                v &= ~(uint32_t)0x00400000;
                memcpy(out + k, &v, 4);
            }
    }
}

/* c fp16 lanes to float32, eight at a time; the last ones through a
 * zero-padded copy (the same conversion, never a read past src). */
__attribute__((target("avx,f16c"))) static void
halves_f16c(char *to, const unsigned char *src, Py_ssize_t c)
{
    Py_ssize_t j = 0;
    for (; j + 8 <= c; j += 8)
        eight_halves((float *)(void *)(to + 4 * j),
                     _mm_loadu_si128((const __m128i *)(const void *)(src + 2 * j)));
    if (j < c) {
        unsigned char pad[16] = {0};
        float out[8];
        memcpy(pad, src + 2 * j, (size_t)(c - j) * 2);
        eight_halves(out, _mm_loadu_si128((const __m128i *)(void *)pad));
        memcpy(to + 4 * j, out, (size_t)(c - j) * 4);
    }
}

/* numpy's fp16 of a float32 NaN (npy_floatbits_to_halfbits). */
static inline uint16_t
numpy_nan_half(uint32_t f)
{
    uint16_t ret = (uint16_t)(0x7c00u + ((f & 0x007fffffu) >> 13));
    if (ret == 0x7c00u)
        ret++;
    return (uint16_t)(((f & 0x80000000u) >> 16) + ret);
}

/* Eight float32 to fp16 at `out`, NaNs as numpy makes them. */
__attribute__((target("avx,f16c"))) static inline void
eight_floats(uint16_t *out, __m256 f)
{
    __m128i h = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)(void *)out, h);
    int nan = _mm256_movemask_ps(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
    if (nan) {
        uint32_t bits[8];
        _mm256_storeu_ps((float *)(void *)bits, f);
        for (int k = 0; k < 8; k++)
            if (nan & (1 << k))
                out[k] = numpy_nan_half(bits[k]);
    }
}

__attribute__((target("avx,f16c"))) static void
floats_to_halves(uint16_t *out, const float *in, Py_ssize_t n)
{
    Py_ssize_t j = 0;
    for (; j + 8 <= n; j += 8)
        eight_floats(out + j, _mm256_loadu_ps(in + j));
    if (j < n) {
        float pad[8] = {0};
        uint16_t h[8];
        memcpy(pad, in + j, (size_t)(n - j) * 4);
        eight_floats(h, _mm256_loadu_ps(pad));
        memcpy(out + j, h, (size_t)(n - j) * 2);
    }
}
#endif

/* c lanes of `src` (its bytes checked) unpacked into `to` (dest's lanes). */
static void
unpack_lanes(int kind, char *to, const unsigned char *src, Py_ssize_t c, const uint32_t *table)
{
    uint16_t *o16 = (uint16_t *)(void *)to;
    switch (kind) {
    case KIND_TABLE16:
        for (Py_ssize_t j = 0; j < c; j++) {
            uint32_t v = table[(uint32_t)src[2 * j] | ((uint32_t)src[2 * j + 1] << 8)];
            memcpy(to + 4 * j, &v, 4);
        }
        break;
    case KIND_TABLE8:
        for (Py_ssize_t j = 0; j < c; j++)
            memcpy(to + 4 * j, &table[src[j]], 4);
        break;
    case KIND_U8:
        for (Py_ssize_t j = 0; j < c; j++) {
            uint16_t v = src[j];
            memcpy(o16 + j, &v, 2);
        }
        break;
    case KIND_U4:
        for (Py_ssize_t j = 0; j < c; j++) {
            uint16_t v = (uint16_t)((src[j >> 1] >> ((j & 1) * 4)) & 0x0F);
            memcpy(o16 + j, &v, 2);
        }
        break;
    case KIND_U10: {
        Py_ssize_t j = 0;
        for (; j + 4 <= c; j += 4) { /* four lanes in five bytes */
            const unsigned char *b = src + (j / 4) * 5;
            uint64_t w = (uint64_t)b[0] | ((uint64_t)b[1] << 8) | ((uint64_t)b[2] << 16) |
                         ((uint64_t)b[3] << 24) | ((uint64_t)b[4] << 32);
            for (int k = 0; k < 4; k++) {
                uint16_t v = (uint16_t)((w >> (10 * k)) & 0x3FF);
                memcpy(o16 + j + k, &v, 2);
            }
        }
        for (; j < c; j++) { /* the last lanes: their bits only (the bytes were checked) */
            Py_ssize_t bit = j * 10;
            /* a lane starts on an even bit: it spans two bytes, both within */
            uint32_t w = (uint32_t)src[bit >> 3] | ((uint32_t)src[(bit >> 3) + 1] << 8);
            uint16_t v = (uint16_t)((w >> (bit & 7)) & 0x3FF);
            memcpy(o16 + j, &v, 2);
        }
        break;
    }
    case KIND_BIT: {
        /* a byte's eight lanes at once (a table of their 16 bytes), then the
         * last lanes one by one */
        static uint16_t spread[256][8];
        static int spread_made;
        if (!spread_made) {
            for (int b = 0; b < 256; b++)
                for (int k = 0; k < 8; k++)
                    spread[b][k] = (uint16_t)((b >> k) & 1);
            spread_made = 1;
        }
        Py_ssize_t j = 0;
        for (; j + 8 <= c; j += 8)
            memcpy(o16 + j, spread[src[j >> 3]], 16);
        for (; j < c; j++) {
            uint16_t v = (uint16_t)((src[j >> 3] >> (j & 7)) & 1);
            memcpy(o16 + j, &v, 2);
        }
        break;
    }
    case KIND_F16C:
#if HAVE_F16C_BUILD
        halves_f16c(to, src, c);
#endif
        break;
    }
}

static PyObject *
store_lanes(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dest_obj, *table_obj, *starts_obj, *counts_obj, *payloads;
    int kind;
    Py_ssize_t skip = 0;
    if (!PyArg_ParseTuple(args, "OiOOOO|n", &dest_obj, &kind, &table_obj, &starts_obj,
                          &counts_obj, &payloads, &skip))
        return NULL;
    if (kind < 0 || kind >= N_KINDS) {
        PyErr_Format(PyExc_ValueError, "no lane kind %d", kind);
        return NULL;
    }
    if (skip < 0) {
        PyErr_SetString(PyExc_ValueError, "skip must not be negative");
        return NULL;
    }
    if (kind == KIND_F16C && !have_f16c()) {
        PyErr_SetString(PyExc_ValueError, "no F16C conversion on this CPU or build");
        return NULL;
    }
    const Py_ssize_t width = kind_width[kind], bits = kind_bits[kind];
    Items it;
    if (items_open(&it, payloads, "payloads must be a list, tuple or Datagrams") < 0)
        return NULL;
    Py_buffer dest, table = {0}, starts, counts;
    int have_dest = 0, have_table = 0, have_starts = 0, have_counts = 0;
    PyObject *ret = NULL;
    if (PyObject_GetBuffer(dest_obj, &dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_dest = 1;
    if (kind_table[kind]) {
        if (table_obj == Py_None) {
            PyErr_SetString(PyExc_ValueError, "this kind of lanes needs a table");
            goto done;
        }
        if (PyObject_GetBuffer(table_obj, &table, PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        have_table = 1;
        if (table.len != kind_table[kind] * 4 || ((uintptr_t)table.buf & 3) != 0) {
            PyErr_Format(PyExc_ValueError, "the table needs %zd aligned 4-byte entries, not %zd bytes",
                         kind_table[kind], table.len);
            goto done;
        }
    } else if (table_obj != Py_None) {
        PyErr_SetString(PyExc_ValueError, "this kind of lanes takes no table");
        goto done;
    }
    if (int64_buffer(starts_obj, &starts, "starts") < 0)
        goto done;
    have_starts = 1;
    if (int64_buffer(counts_obj, &counts, "counts") < 0)
        goto done;
    have_counts = 1;
    Py_ssize_t n = it.n;
    if (starts.len / 8 != n || counts.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%zd payloads but %zd starts and %zd counts", n,
                     starts.len / 8, counts.len / 8);
        goto done;
    }
    if (dest.len % width) {
        PyErr_Format(PyExc_ValueError, "dest of %zd bytes is not of %zd-byte lanes", dest.len,
                     width);
        goto done;
    }
    const int64_t *start = starts.buf, *count = counts.buf;
    const int64_t lanes = dest.len / width;
    for (Py_ssize_t i = 0; i < n; i++) {
        Bytes p;
        if (items_get(&it, i, &p) < 0)
            goto done;
        int64_t s = start[i], c = count[i];
        Py_ssize_t plen = p.len - skip;
        if (c < 0 || c > PY_SSIZE_T_MAX / 16 || plen < 0 || plen != (c * bits + 7) / 8) {
            PyErr_Format(LengthError, "%zd bytes for %lld lanes", plen, (long long)c);
            bytes_release(&p);
            goto done;
        }
        if (s < 0 || s > lanes - c) {
            PyErr_Format(PyExc_IndexError, "lanes %lld..%lld outside %lld", (long long)s,
                         (long long)(s + c), (long long)lanes);
            bytes_release(&p);
            goto done;
        }
        unpack_lanes(kind, (char *)dest.buf + s * width, (const unsigned char *)p.buf + skip,
                     (Py_ssize_t)c, have_table ? (const uint32_t *)table.buf : NULL);
        bytes_release(&p);
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    if (have_counts)
        PyBuffer_Release(&counts);
    if (have_starts)
        PyBuffer_Release(&starts);
    if (have_table)
        PyBuffer_Release(&table);
    if (have_dest)
        PyBuffer_Release(&dest);
    items_close(&it);
    return ret;
}

static PyObject *
to_halves(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *src_obj, *dest_obj;
    if (!PyArg_ParseTuple(args, "OO", &src_obj, &dest_obj))
        return NULL;
    if (!have_f16c()) {
        PyErr_SetString(PyExc_ValueError, "no F16C conversion on this CPU or build");
        return NULL;
    }
    Py_buffer src, dest;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(dest_obj, &dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *ret = NULL;
    if (src.len % 4 || dest.len != src.len / 2) {
        PyErr_Format(PyExc_ValueError, "%zd bytes of float32 into %zd bytes of fp16", src.len,
                     dest.len);
        goto done;
    }
#if HAVE_F16C_BUILD
    Py_BEGIN_ALLOW_THREADS
    floats_to_halves((uint16_t *)dest.buf, (const float *)src.buf, src.len / 4);
    Py_END_ALLOW_THREADS
#endif
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&dest);
    PyBuffer_Release(&src);
    return ret;
}

static PyObject *
pack_u10(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *src_obj, *dest_obj;
    if (!PyArg_ParseTuple(args, "OO", &src_obj, &dest_obj))
        return NULL;
    Py_buffer src, dest;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(dest_obj, &dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *ret = NULL;
    Py_ssize_t n = src.len / 2;
    if (src.len % 2 || n > PY_SSIZE_T_MAX / 10 || dest.len != (n * 10 + 7) / 8) {
        PyErr_Format(PyExc_ValueError, "%zd bytes of uint16 into %zd bytes of 10-bit lanes",
                     src.len, dest.len);
        goto done;
    }
    const unsigned char *in = src.buf;
    unsigned char *out = dest.buf;
    for (Py_ssize_t g = 0; g * 4 < n; g++) {
        uint64_t w = 0;
        for (int k = 0; k < 4; k++) {
            Py_ssize_t j = g * 4 + k;
            if (j < n) {
                uint16_t v;
                memcpy(&v, in + 2 * j, 2);
                w |= (uint64_t)v << (10 * k);
            }
        }
        Py_ssize_t at = g * 5, room = dest.len - at;
        for (int b = 0; b < 5 && b < room; b++)
            out[at + b] = (unsigned char)(w >> (8 * b));
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&dest);
    PyBuffer_Release(&src);
    return ret;
}

/* (DatagramsType: defined by _bulk.c above the include) */
static PyObject *
pick(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *seq, *index_obj;
    if (!PyArg_ParseTuple(args, "OO", &seq, &index_obj))
        return NULL;
    Py_buffer index;
    if (int64_buffer(index_obj, &index, "index") < 0)
        return NULL;
    const int64_t *at = index.buf;
    Py_ssize_t k = index.len / 8;
    PyObject *ret = NULL;
    if (Py_TYPE(seq) == &DatagramsType) {
        const DatagramsObject *d = (const DatagramsObject *)seq;
        for (Py_ssize_t j = 0; j < k; j++)
            if (at[j] < 0 || at[j] >= d->n) {
                PyErr_Format(PyExc_IndexError, "index %lld of %zd datagrams", (long long)at[j],
                             d->n);
                goto done;
            }
        DatagramsObject *out = datagrams_new(&DatagramsType, k, d->owners);
        if (out == NULL)
            goto done;
        for (Py_ssize_t j = 0; j < k; j++) {
            out->buf[j] = d->buf[at[j]];
            out->len[j] = d->len[at[j]];
            out->owner[j] = d->owner[at[j]];
        }
        ret = (PyObject *)out;
        goto done;
    }
    if (!PyList_Check(seq) && !PyTuple_Check(seq)) {
        PyErr_SetString(PyExc_TypeError, "datagrams must be a Datagrams, list or tuple");
        goto done;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = 0; j < k; j++)
        if (at[j] < 0 || at[j] >= n) {
            PyErr_Format(PyExc_IndexError, "index %lld of %zd datagrams", (long long)at[j], n);
            goto done;
        }
    ret = PyList_New(k);
    if (ret == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *v = items[at[j]];
        Py_INCREF(v);
        PyList_SET_ITEM(ret, j, v);
    }
done:
    PyBuffer_Release(&index);
    return ret;
}

#endif
