/* THC's rank-side passes in C: the rotation of a bucket's blocks, the
 * rounding of the rotated values to levels (with the error-feedback residual
 * left in place), and the decode's dequantization and inverse rotation.
 *
 * Each function does, block by block while the block is in the L1 cache,
 * what dlcp/codecs/thc.py does with whole-bucket torch passes, in the same
 * float32 operations in the same order: the Walsh-Hadamard butterflies of
 * dlcp.codecs.hadamard._fwht_butterfly_ (not its matmul form, whose sums a
 * BLAS orders), so the results are those of the Python code with the
 * butterfly transform, bit for bit (tests/test_thc_native.py). Compiled with
 * -ffp-contract=off: a fused multiply-add would round once where torch
 * rounds twice.
 *
 * The inputs are the rank's own float32 tensors (numpy views of them), never
 * bytes from the network.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define DLCP_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DLCP_CLONES
#endif

/* The orthonormal transform of one block of n (a power of two) values, in
 * place, after multiplying by the signs `sg` where given: the butterflies
 * h = 1, 2, 4, ... of _fwht_butterfly_, then the product by 1/sqrt(n)
 * rounded to float32 (torch's mul_ by a Python float). Each value takes the
 * same additions in the same order as there: the first three stages on
 * eight values in registers, the rest in loops the compiler vectorises, the
 * product by 1/sqrt(n) in the last stage's loop (after its sum is rounded). */
DLCP_CLONES static void fwht_block(float *x, const float *sg, Py_ssize_t n, float inv) {
    Py_ssize_t h = 1;
    if (n >= 8) {
        for (Py_ssize_t i = 0; i < n; i += 8) {
            float a[8];
            for (int j = 0; j < 8; j++) a[j] = sg ? x[i + j] * sg[i + j] : x[i + j];
            float b[8], c[8];
            for (int j = 0; j < 8; j += 2) b[j] = a[j] + a[j + 1], b[j + 1] = a[j] - a[j + 1];
            for (int j = 0; j < 8; j += 4) {
                c[j] = b[j] + b[j + 2], c[j + 2] = b[j] - b[j + 2];
                c[j + 1] = b[j + 1] + b[j + 3], c[j + 3] = b[j + 1] - b[j + 3];
            }
            if (n == 8) {
                for (int j = 0; j < 4; j++) {
                    x[i + j] = (c[j] + c[j + 4]) * inv;
                    x[i + j + 4] = (c[j] - c[j + 4]) * inv;
                }
            } else {
                for (int j = 0; j < 4; j++) {
                    x[i + j] = c[j] + c[j + 4];
                    x[i + j + 4] = c[j] - c[j + 4];
                }
            }
        }
        if (n == 8) return;
        h = 8;
    } else if (sg) {
        for (Py_ssize_t j = 0; j < n; j++) x[j] *= sg[j];
    }
    for (; h < n; h <<= 1) {
        int last = 2 * h == n;
        for (Py_ssize_t i = 0; i < n; i += 2 * h) {
            float *lo = x + i, *hi = x + i + h;
            if (last) {
                for (Py_ssize_t j = 0; j < h; j++) {
                    float a = lo[j], b = hi[j];
                    lo[j] = (a + b) * inv;
                    hi[j] = (a - b) * inv;
                }
            } else {
                for (Py_ssize_t j = 0; j < h; j++) {
                    float a = lo[j], b = hi[j];
                    lo[j] = a + b;
                    hi[j] = a - b;
                }
            }
        }
    }
    if (n == 1) x[0] *= inv; /* no stage to take the product */
}

static float inv_sqrt(Py_ssize_t n) { return (float)(1.0 / sqrt((double)n)); }

static int want(Py_buffer *b, Py_ssize_t itemsize, const char *what) {
    if (b->len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of items", what,
                     b->len);
        return 0;
    }
    return 1;
}

static int is_block(Py_ssize_t n) { return n >= 1 && (n & (n - 1)) == 0; }

/* max |x| of n values, NaN where one is NaN (as torch's amax of abs): on
 * the bits with the sign cleared, whose order as integers is the floats'
 * (a NaN's above infinity's), so the reduction vectorises. */
DLCP_CLONES static float abs_max(const float *restrict x, Py_ssize_t n) {
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t top = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        uint32_t b = bits[j] & 0x7fffffffu;
        top = b > top ? b : top;
    }
    if (top > 0x7f800000u) return NAN;
    float out;
    memcpy(&out, &top, sizeof out);
    return out;
}

/* The first k values of D H blk / sqrt(B) into out: the inverse rotation of
 * one block, blk overwritten (`unrotate`, `dequantize` and `encode`). */
static void unrotate_block(float *blk, const float *sg, Py_ssize_t B, float inv, float *out,
                           Py_ssize_t k) {
    fwht_block(blk, NULL, B, inv);
    for (Py_ssize_t j = 0; j < k; j++) out[j] = blk[j] * sg[j];
}

/* The levels q of values lo..lo+B-1 as 4-bit lanes, two a byte low nibble
 * first (`quantize` and `encode`). */
static void pack_nibbles(uint8_t *lanes, const uint8_t *q, Py_ssize_t lo, Py_ssize_t B) {
    for (Py_ssize_t j = 0; j < B; j++) {
        Py_ssize_t i = lo + j;
        if (i & 1)
            lanes[i >> 1] |= (uint8_t)(q[j] << 4);
        else
            lanes[i >> 1] = q[j];
    }
}

/* Whether `bits` and `levels` are THC's (8 or 4 bits, 2**bits - 1 levels);
 * a ValueError set where not. */
static int lanes_ok(int bits, int levels) {
    if (bits != 8 && bits != 4) {
        PyErr_Format(PyExc_ValueError, "THC lanes are 8 or 4 bits, not %d", bits);
        return 0;
    }
    if (levels != (1 << bits) - 1) {
        PyErr_Format(PyExc_ValueError, "%d levels for %d bits", levels, bits);
        return 0;
    }
    return 1;
}

/* Whether n values' noise and their `bits`-bit lanes fit (n below 2**32,
 * `len` bytes of lanes); a ValueError set where not. */
static int room_ok(Py_ssize_t n, int bits, Py_ssize_t len) {
    if (n > (Py_ssize_t)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%zd values: the noise counts to 2**32", n);
        return 0;
    }
    if (len < (bits == 8 ? n : (n + 1) / 2)) {
        PyErr_Format(PyExc_ValueError, "lanes of %zd bytes for %zd values of %d bits", len, n,
                     bits);
        return 0;
    }
    return 1;
}

/* rotate(a, signs, block_max): a (blocks x B float32, B = len(signs))
 * becomes H(D a)/sqrt(B) block by block; block_max[b] = max |a| of block b
 * after the rotation (NaN where the block holds a NaN, as torch's amax). */
static PyObject *rotate(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer a, d, m;
    if (!PyArg_ParseTuple(args, "w*y*w*", &a, &d, &m)) return NULL;
    PyObject *ret = NULL;
    if (!want(&a, 4, "a") || !want(&d, 4, "signs") || !want(&m, 4, "block_max")) goto done;
    Py_ssize_t B = d.len / 4;
    if (!is_block(B) || (a.len / 4) % B) {
        PyErr_Format(PyExc_ValueError, "%zd values are not whole blocks of %zd (a power of two)",
                     a.len / 4, B);
        goto done;
    }
    Py_ssize_t blocks = a.len / 4 / B;
    if (m.len / 4 != blocks) {
        PyErr_Format(PyExc_ValueError, "block_max holds %zd values for %zd blocks", m.len / 4,
                     blocks);
        goto done;
    }
    float *x = (float *)a.buf, *mx = (float *)m.buf;
    const float *sg = (const float *)d.buf;
    float inv = inv_sqrt(B);
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        float *blk = x + b * B;
        fwht_block(blk, sg, B, inv);
        mx[b] = abs_max(blk, B);
    }
    Py_END_ALLOW_THREADS;
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&a);
    PyBuffer_Release(&d);
    PyBuffer_Release(&m);
    return ret;
}

/* The rounding noise of value i: 24 bits of a keyed hash of i as a float in
 * [0, 1): two rounds of the lowbias32 mix (Wellons), the key added before
 * the first and xored before the second. dlcp.codecs.thc_noise._uniform_ is its
 * numpy form. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

static inline float noise(uint32_t i, uint32_t k0, uint32_t k1) {
    uint32_t h = mix32(mix32(i + k0) ^ k1);
    return (float)(h >> 8) * (1.0f / 16777216.0f);
}

/* One block of `quantize` (its docstring below), whose first value is value
 * `first` of the bucket: levels into q (a byte each), the residual's rotated
 * form into y with `keep`; returns how many |v| exceeded s. t + u is at
 * least 0 (the clamp's sum is +0 or more), so its floor is its truncation,
 * a conversion the compiler vectorises. */
DLCP_CLONES static long long quantize_block(float *restrict y, uint32_t first, uint32_t k0,
                                           uint32_t k1, Py_ssize_t B, float s, float L,
                                           uint8_t *restrict q, int keep) {
    float two_s = 2.0f * s;
    float k = (1.0f / two_s) * L;
    float m = two_s / L;
    float ns = -s;
    int saturated = 0;
    for (Py_ssize_t j = 0; j < B; j++) {
        float v = y[j];
        float a = v < 0.0f ? -v : v;
        saturated += a > s ? 1 : 0;
        float c = v < ns ? ns : v;
        c = c > s ? s : c;
        float t = (c + s) * k;
        float f = (float)(int32_t)(t + noise(first + (uint32_t)j, k0, k1));
        f = f > L ? L : f;
        q[j] = (uint8_t)(int32_t)f;
        float own = f * m;
        own = own - s;
        float r = v - own;
        y[j] = keep ? r : v;
    }
    return saturated;
}

/* uniforms(out, key): out[i] = the rounding noise of value i (`noise`), for
 * the Python form's tests and for torch's passes where they run. */
static PyObject *uniforms(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer o;
    unsigned long long key;
    if (!PyArg_ParseTuple(args, "w*K", &o, &key)) return NULL;
    if (!want(&o, 4, "out")) {
        PyBuffer_Release(&o);
        return NULL;
    }
    float *ov = (float *)o.buf;
    Py_ssize_t n = o.len / 4;
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t i = 0; i < n; i++) ov[i] = noise((uint32_t)i, k0, k1);
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&o);
    Py_RETURN_NONE;
}

/* quantize(y, scales, key, levels, bits, lanes, keep) -> saturated.
 *
 * Per block b of B = len(y) / len(scales) values (one scale: the whole
 * bucket one block of scales), with s = scales[b] and u the noise of the
 * value's place in the bucket under `key` (`noise`):
 *   t = (clamp(v, -s, s) + s) * (reciprocal(2 s) * L);  q = clamp(floor(t + u), 0, L)
 * (`float / tensor` in torch is the reciprocal times the float); q goes
 * into `lanes` (a byte a value for 8 bits, two a byte low nibble first for
 * 4); with `keep` the residual's rotated form is left in y:
 *   v - (q * (2 s / L) - s).
 * Returns how many |v| exceeded their scale. */
static PyObject *quantize(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer y, sc, out;
    unsigned long long key;
    int levels, bits, keep;
    if (!PyArg_ParseTuple(args, "w*y*Kiiw*p", &y, &sc, &key, &levels, &bits, &out, &keep))
        return NULL;
    PyObject *ret = NULL;
    if (!want(&y, 4, "y") || !want(&sc, 4, "scales")) goto done;
    Py_ssize_t n = y.len / 4, ns = sc.len / 4;
    if (!lanes_ok(bits, levels)) goto done;
    if (ns < 1 || n % ns) {
        PyErr_Format(PyExc_ValueError, "%zd scales for %zd values", ns, n);
        goto done;
    }
    if (!room_ok(n, bits, out.len)) goto done;
    Py_ssize_t B = n / ns;
    float *yv = (float *)y.buf;
    const float *sv = (const float *)sc.buf;
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    uint8_t *lanes = (uint8_t *)out.buf;
    uint8_t *tmp = NULL;
    if (bits == 4 && !(tmp = PyMem_Malloc(B))) {
        PyErr_NoMemory();
        goto done;
    }
    float L = (float)levels;
    long long saturated = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t b = 0; b < ns; b++) {
        Py_ssize_t lo = b * B;
        uint8_t *q = bits == 8 ? lanes + lo : tmp;
        saturated += quantize_block(yv + lo, (uint32_t)lo, k0, k1, B, sv[b], L, q, keep);
        if (bits == 4) pack_nibbles(lanes, q, lo, B);
    }
    Py_END_ALLOW_THREADS;
    PyMem_Free(tmp);
    ret = PyLong_FromLongLong(saturated);
done:
    PyBuffer_Release(&y);
    PyBuffer_Release(&sc);
    PyBuffer_Release(&out);
    return ret;
}

/* unrotate(y, signs, out): out (float32, at most len(y) values) = the first
 * len(out) values of D H y / sqrt(B), block by block; y is overwritten. */
static PyObject *unrotate(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer y, d, out;
    if (!PyArg_ParseTuple(args, "w*y*w*", &y, &d, &out)) return NULL;
    PyObject *ret = NULL;
    if (!want(&y, 4, "y") || !want(&d, 4, "signs") || !want(&out, 4, "out")) goto done;
    Py_ssize_t B = d.len / 4, n = y.len / 4, numel = out.len / 4;
    if (!is_block(B) || n % B) {
        PyErr_Format(PyExc_ValueError, "%zd values are not whole blocks of %zd (a power of two)",
                     n, B);
        goto done;
    }
    if (numel > n) {
        PyErr_Format(PyExc_ValueError, "out holds %zd values, more than the %zd rotated", numel,
                     n);
        goto done;
    }
    float *yv = (float *)y.buf, *ov = (float *)out.buf;
    const float *sg = (const float *)d.buf;
    float inv = inv_sqrt(B);
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t lo = 0; lo < numel; lo += B)
        unrotate_block(yv + lo, sg, B, inv, ov + lo, numel - lo < B ? numel - lo : B);
    Py_END_ALLOW_THREADS;
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&y);
    PyBuffer_Release(&d);
    PyBuffer_Release(&out);
    return ret;
}

/* dequantize(total, counts, scales, levels, signs, out): the decode of summed
 * levels. Per block b (counts and scales: one value, or one a block),
 *   y = (total / max(c, 1)) * (2 s / L) - s, 0 where c <= 0,
 * then out = the first len(out) values of D H y / sqrt(B); total is
 * overwritten. */
static PyObject *dequantize(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer t, c, sc, d, out;
    int levels;
    if (!PyArg_ParseTuple(args, "w*y*y*iy*w*", &t, &c, &sc, &levels, &d, &out)) return NULL;
    PyObject *ret = NULL;
    if (!want(&t, 4, "total") || !want(&c, 4, "counts") || !want(&sc, 4, "scales") ||
        !want(&d, 4, "signs") || !want(&out, 4, "out"))
        goto done;
    Py_ssize_t B = d.len / 4, n = t.len / 4, numel = out.len / 4;
    Py_ssize_t nc = c.len / 4, ns = sc.len / 4;
    if (!is_block(B) || n % B) {
        PyErr_Format(PyExc_ValueError, "%zd values are not whole blocks of %zd (a power of two)",
                     n, B);
        goto done;
    }
    Py_ssize_t blocks = n / B;
    if ((nc != 1 && nc != blocks) || (ns != 1 && ns != blocks)) {
        PyErr_Format(PyExc_ValueError, "%zd counts and %zd scales for %zd blocks", nc, ns, blocks);
        goto done;
    }
    if (numel > n || levels < 1) {
        PyErr_Format(PyExc_ValueError, "out of %zd values for %zd lanes, %d levels", numel, n,
                     levels);
        goto done;
    }
    float *tv = (float *)t.buf, *ov = (float *)out.buf;
    const float *cv = (const float *)c.buf, *sv = (const float *)sc.buf;
    const float *sg = (const float *)d.buf;
    float L = (float)levels, inv = inv_sqrt(B);
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t b = 0; b * B < numel; b++) {
        float cb = cv[nc == 1 ? 0 : b], s = sv[ns == 1 ? 0 : b];
        float div = cb < 1.0f ? 1.0f : cb;
        float m = (2.0f * s) / L;
        float *blk = tv + b * B;
        int none = !(cb > 0.0f);
        for (Py_ssize_t j = 0; j < B; j++) {
            float mean = blk[j] / div;
            float v = mean * m;
            v = v - s;
            blk[j] = none ? 0.0f : v;
        }
        Py_ssize_t lo = b * B;
        unrotate_block(blk, sg, B, inv, ov + lo, numel - lo < B ? numel - lo : B);
    }
    Py_END_ALLOW_THREADS;
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&t);
    PyBuffer_Release(&c);
    PyBuffer_Release(&sc);
    PyBuffer_Release(&d);
    PyBuffer_Release(&out);
    return ret;
}

/* encode(v, residual, signs, scales, key, levels, bits, lanes, residual_out,
 *        block_max) -> saturated.
 *
 * The whole encode of a bucket given its scales, a block at a time while the
 * block is in the L1 cache: a = v + residual (v alone where residual is None;
 * zeros past len(v) in the last block) rotated as `rotate` does, its max |a|
 * into block_max, rounded to levels as `quantize` does (one scale, or one a
 * block), and, where residual_out is given (len(v) values), the residual's
 * rotated form rotated back into it as `unrotate` does: the same float32
 * operations in the same order as those passes over the whole bucket, so
 * the same lanes, maxima and residual bit for bit, with one pass over
 * memory instead of four. Returns how many rotated values exceeded their
 * scale; a NaN leaves its block's max NaN (the caller refuses the encode). */
static PyObject *encode(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer v, r = {0}, d, sc, out, ro = {0}, m;
    PyObject *r_obj, *ro_obj;
    unsigned long long key;
    int levels, bits;
    if (!PyArg_ParseTuple(args, "y*Oy*y*Kiiw*Ow*", &v, &r_obj, &d, &sc, &key, &levels, &bits,
                          &out, &ro_obj, &m))
        return NULL;
    PyObject *ret = NULL;
    float *blk = NULL;
    int have_r = r_obj != Py_None, have_ro = ro_obj != Py_None;
    if (have_r && PyObject_GetBuffer(r_obj, &r, PyBUF_SIMPLE) < 0) {
        have_r = 0;
        goto done;
    }
    if (have_ro && PyObject_GetBuffer(ro_obj, &ro, PyBUF_WRITABLE) < 0) {
        have_ro = 0;
        goto done;
    }
    if (!want(&v, 4, "v") || !want(&d, 4, "signs") || !want(&sc, 4, "scales") ||
        !want(&m, 4, "block_max"))
        goto done;
    Py_ssize_t numel = v.len / 4, B = d.len / 4, blocks = m.len / 4, ns = sc.len / 4;
    if (!is_block(B) || blocks != (numel + B - 1) / B) {
        PyErr_Format(PyExc_ValueError, "%zd values are not %zd blocks of %zd (a power of two)",
                     numel, blocks, B);
        goto done;
    }
    if ((have_r && r.len != v.len) || (have_ro && ro.len != v.len)) {
        PyErr_SetString(PyExc_ValueError, "residual and residual_out hold len(v) values");
        goto done;
    }
    if (!lanes_ok(bits, levels)) goto done;
    if (ns != 1 && ns != blocks) {
        PyErr_Format(PyExc_ValueError, "%zd scales for %zd blocks", ns, blocks);
        goto done;
    }
    if (!room_ok(blocks * B, bits, out.len)) goto done;
    /* the block, then its levels where they are not the lanes (4 bits) */
    if (!(blk = PyMem_Malloc((size_t)B * (sizeof(float) + 1)))) {
        PyErr_NoMemory();
        goto done;
    }
    const float *vv = (const float *)v.buf, *rv = have_r ? (const float *)r.buf : NULL;
    float *rov = have_ro ? (float *)ro.buf : NULL, *mx = (float *)m.buf;
    const float *sg = (const float *)d.buf, *sv = (const float *)sc.buf;
    uint8_t *lanes = (uint8_t *)out.buf, *tmp = (uint8_t *)(blk + B);
    uint32_t k0 = (uint32_t)key, k1 = (uint32_t)(key >> 32);
    float L = (float)levels, inv = inv_sqrt(B);
    long long saturated = 0;
    Py_BEGIN_ALLOW_THREADS;
    for (Py_ssize_t b = 0; b < blocks; b++) {
        Py_ssize_t lo = b * B, k = numel - lo < B ? numel - lo : B;
        if (rv)
            for (Py_ssize_t j = 0; j < k; j++) blk[j] = vv[lo + j] + rv[lo + j];
        else
            memcpy(blk, vv + lo, (size_t)k * sizeof(float));
        for (Py_ssize_t j = k; j < B; j++) blk[j] = 0.0f;
        fwht_block(blk, sg, B, inv);
        mx[b] = abs_max(blk, B);
        uint8_t *q = bits == 8 ? lanes + lo : tmp;
        saturated += quantize_block(blk, (uint32_t)lo, k0, k1, B, sv[ns == 1 ? 0 : b], L, q,
                                    rov != NULL);
        if (bits == 4) pack_nibbles(lanes, q, lo, B);
        if (rov) unrotate_block(blk, sg, B, inv, rov + lo, k);
    }
    Py_END_ALLOW_THREADS;
    ret = PyLong_FromLongLong(saturated);
done:
    PyMem_Free(blk);
    PyBuffer_Release(&v);
    if (have_r) PyBuffer_Release(&r);
    PyBuffer_Release(&d);
    PyBuffer_Release(&sc);
    PyBuffer_Release(&out);
    if (have_ro) PyBuffer_Release(&ro);
    PyBuffer_Release(&m);
    return ret;
}

static PyMethodDef methods[] = {
    {"rotate", rotate, METH_VARARGS, "rotate(a, signs, block_max): blocks rotated in place"},
    {"encode", encode, METH_VARARGS,
     "encode(v, residual, signs, scales, key, levels, bits, lanes, residual_out, block_max) "
     "-> saturated: the encode in one pass"},
    {"quantize", quantize, METH_VARARGS,
     "quantize(y, scales, key, levels, bits, lanes, keep) -> saturated"},
    {"uniforms", uniforms, METH_VARARGS, "uniforms(out, key): the rounding noise"},
    {"unrotate", unrotate, METH_VARARGS, "unrotate(y, signs, out): the inverse rotation"},
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(total, counts, scales, levels, signs, out): the decode"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_thc", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__thc(void) { return PyModule_Create(&module); }
