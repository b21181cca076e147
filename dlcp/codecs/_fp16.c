/* The fp16 codec's encode in C: one pass over the bucket instead of torch's
 * five (the residual added, the cast, each packet's max |value|, the halves
 * widened back, the new residual).
 *
 * encode(x, r, wire, r_out, per_packet, block_max) -> overflowed
 *   v = x + r (x where r is None), float32 as torch adds;
 *   wire = v cast to fp16 (the CPU's F16C, round to nearest even: torch's
 *   cast, NaN payloads included);
 *   block_max[p] = max |v| over packet p (NaN where it holds a NaN);
 *   r_out (where given) = v - float(wire), 0 where that is not finite;
 *   returns how many finite v became an infinite half.
 * What dlcp/codecs/fp.py does with torch (`FloatCodec._encode`), bit for bit in
 * the lanes and the residual (tests/test_fp16_native.py); the maxima are the
 * same values (an all-zero packet's max is +0 here, +0 or -0 in torch).
 * `available()` says whether this CPU has F16C and AVX; without them the
 * codec stays on torch.
 *
 * The inputs are the rank's own float32 tensors, never bytes from the
 * network.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "../wire/f16c.h" /* HAVE_F16C_BUILD, have_f16c() */

#if HAVE_F16C_BUILD
typedef struct {
    long long overflowed;
    int nan;
    float top;
} Tally;

/* One value (a packet's tail): the vector loop's work, one lane wide. */
__attribute__((target("avx,f16c"))) static inline void one(const float *x, const float *r,
                                                          uint16_t *w, float *ro, Py_ssize_t i,
                                                          Tally *t) {
    float v = r ? x[i] + r[i] : x[i];
    uint16_t h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    w[i] = h;
    float back = _cvtsh_ss(h);
    float a = fabsf(v);
    t->nan |= isnan(v);
    t->top = a > t->top ? a : t->top;
    t->overflowed += isinf(back) && a < INFINITY;
    if (ro) {
        float d = v - back;
        ro[i] = isfinite(d) ? d : 0.0f;
    }
}

__attribute__((target("avx,f16c"))) static long long encode_f16c(
    const float *x, const float *r, uint16_t *w, float *ro, Py_ssize_t n, Py_ssize_t per,
    float *block_max) {
    const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
    const __m256 zero = _mm256_setzero_ps();
    long long overflowed = 0;
    for (Py_ssize_t lo = 0, p = 0; lo < n; lo += per, p++) {
        Py_ssize_t hi = lo + per < n ? lo + per : n;
        __m256 top = zero, nan = zero;
        Py_ssize_t i = lo;
        for (; i + 8 <= hi; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            if (r) v = _mm256_add_ps(v, _mm256_loadu_ps(r + i));
            __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128((__m128i *)(void *)(w + i), h);
            __m256 back = _mm256_cvtph_ps(h);
            __m256 a = _mm256_andnot_ps(sign, v);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            top = _mm256_max_ps(a, top); /* a NaN in a: top kept (counted in nan) */
            __m256 over = _mm256_and_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, back), inf, _CMP_EQ_OQ),
                                        _mm256_cmp_ps(a, inf, _CMP_LT_OQ));
            overflowed += __builtin_popcount((unsigned)_mm256_movemask_ps(over));
            if (ro) {
                __m256 d = _mm256_sub_ps(v, back);
                __m256 finite = _mm256_cmp_ps(_mm256_sub_ps(d, d), zero, _CMP_EQ_OQ);
                _mm256_storeu_ps(ro + i, _mm256_and_ps(d, finite));
            }
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, top);
        Tally t = {0, _mm256_movemask_ps(nan) != 0, 0.0f};
        for (int k = 0; k < 8; k++) t.top = lanes[k] > t.top ? lanes[k] : t.top;
        for (; i < hi; i++) one(x, r, w, ro, i, &t);
        overflowed += t.overflowed;
        block_max[p] = t.nan ? NAN : t.top;
    }
    return overflowed;
}
#endif

static int floats(Py_buffer *b, const char *what) {
    if (b->len % 4) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of float32", what,
                     b->len);
        return 0;
    }
    return 1;
}

static PyObject *encode(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *ro_obj, *r_obj;
    Py_buffer x, w, m, r = {0}, ro = {0};
    Py_ssize_t per;
    if (!PyArg_ParseTuple(args, "y*Ow*Onw*", &x, &r_obj, &w, &ro_obj, &per, &m)) return NULL;
    PyObject *ret = NULL;
    int have_r = 0, have_ro = 0;
    if (r_obj != Py_None) {
        if (PyObject_GetBuffer(r_obj, &r, PyBUF_SIMPLE) < 0) goto done;
        have_r = 1;
    }
    if (ro_obj != Py_None) {
        if (PyObject_GetBuffer(ro_obj, &ro, PyBUF_WRITABLE) < 0) goto done;
        have_ro = 1;
    }
    if (!have_f16c()) {
        PyErr_SetString(PyExc_RuntimeError, "this CPU has no F16C: the fp16 encode runs in torch");
        goto done;
    }
    if (!floats(&x, "x") || !floats(&m, "block_max") || (have_r && !floats(&r, "residual")) ||
        (have_ro && !floats(&ro, "r_out")))
        goto done;
    Py_ssize_t n = x.len / 4;
    if (per < 1) {
        PyErr_Format(PyExc_ValueError, "%zd values a packet", per);
        goto done;
    }
    Py_ssize_t packets = n ? (n + per - 1) / per : 0;
    if (w.len != 2 * n || m.len / 4 != packets || (have_r && r.len != x.len) ||
        (have_ro && ro.len != x.len)) {
        PyErr_Format(PyExc_ValueError,
                     "sizes: %zd values, %zd wire bytes, %zd maxima for %zd packets", n, w.len,
                     m.len / 4, packets);
        goto done;
    }
#if HAVE_F16C_BUILD
    long long over;
    Py_BEGIN_ALLOW_THREADS;
    over = encode_f16c((const float *)x.buf, have_r ? (const float *)r.buf : NULL,
                       (uint16_t *)w.buf, have_ro ? (float *)ro.buf : NULL, n, per,
                       (float *)m.buf);
    Py_END_ALLOW_THREADS;
    ret = PyLong_FromLongLong(over);
#endif
done:
    PyBuffer_Release(&x);
    PyBuffer_Release(&w);
    PyBuffer_Release(&m);
    if (have_r) PyBuffer_Release(&r);
    if (have_ro) PyBuffer_Release(&ro);
    return ret;
}

static PyObject *available(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(have_f16c());
}

static PyMethodDef methods[] = {
    {"encode", encode, METH_VARARGS,
     "encode(x, r, wire, r_out, per_packet, block_max) -> overflowed"},
    {"available", available, METH_NOARGS, "whether this CPU has F16C and AVX"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fp16", NULL, -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__fp16(void) { return PyModule_Create(&module); }
