/* dlcp.wire._bulk: the per-datagram byte moves of the receive path, one call
 * for a whole batch (no Python object or interpreter step per datagram).
 *
 * heads(datagrams, size) -> (bytearray, bytes)
 *
 *   The first `size` bytes of each datagram (a list or tuple of byte buffers)
 *   back to back, zeros for one shorter than `size`, and the length of each as
 *   native int64s: what `dlcp.wire.batch.decode_batch` reads its header fields
 *   and lengths from.
 *
 * copy_runs(dest, itemsize, starts, counts, payloads, skip=0) -> None
 *
 *   dest      a writable C-contiguous buffer (an accumulator row: fp32 or u16)
 *   itemsize  bytes per lane of dest (the wire lanes have the same width)
 *   starts    int64 buffer: the first lane of each payload in dest
 *   counts    int64 buffer: the lanes each payload holds
 *   payloads  a list or tuple of byte buffers
 *   skip      bytes of each payload before its lanes (a datagram's header)
 *
 * For each i in order: dest[starts[i] : starts[i] + counts[i]] (in lanes) =
 * payloads[i][skip:]. This is what `dlcp.codecs.lanes.store_many` does with one
 * memoryview assignment per packet in Python; here the loop and its checks are
 * in C. A payload whose length (less skip) is not counts[i] * itemsize stops the copy with
 * LengthError (the ones before it are stored, as in Python); a run outside
 * dest raises IndexError, a bad argument TypeError/ValueError.
 *
 * add_runs(dest, own, starts, counts, payloads, skip=0) -> None
 *
 *   copy_runs for float32 lanes (itemsize 4) where each lane stored is
 *   own[lane] + the payload's lane: a shard's sum of this node's lanes (`own`,
 *   as long as dest) and one other sender's, made as the packets arrive. The
 *   same checks and errors as copy_runs; `own` may be `dest` itself.
 *
 * field_checks(heads, lengths, tables, magic, version, bad_flags, summed_flag,
 *              max_priority, max_payload) -> bytes | None
 *
 *   The header checks of `dlcp.wire.batch._field_reasons` in one pass: per
 *   64-byte header record the index of the first check it fails (255: none),
 *   or None when every record passes. The tables and constants are Python's.
 *
 * checked_heads(datagrams, tables, magic, version, bad_flags, summed_flag,
 *               max_priority, max_payload) -> (bytearray, bytes | None, int)
 *
 *   heads(datagrams, 64)[0] and field_checks of its records in one pass (a
 *   receive drain's decode), and the job (a header's bytes 8-11) that every
 *   record names when all pass every check and name one job; else -1.
 *
 * run_starts(heads, src, mask, data_mask, lanes, type_at, data_type) -> bytes
 *
 *   Where the runs of `dlcp.core.engine.Engine.receive_many` start: record i
 *   (of the 64-byte header records `heads`, sources `src`, int64) starts one
 *   unless it and record i - 1 are both of a lane-carrying type (lanes[type]
 *   nonzero; the type byte at type_at), come from one source and agree on
 *   every bit of `mask` (64 bytes), and, for a record of type data_type, on
 *   every bit of `data_mask` too. The starts as native int64s (record 0
 *   always), one compare of eight 64-bit words a record.
 *
 * run_index(heads, per, split, total, base, slots, start_sub, received)
 *     -> (bytes, int, bytes | None)
 *
 *   The records of a run (64-byte headers of data or result packets) to
 *   store, as `ShardAggregator.on_data_many` (split 1) and
 *   `ResultCollector.on_results_many` find them: record k's lanes
 *   (offset, count) are slot i * split + within / step - base of `slots`
 *   (i = offset / per, within = offset - i * per, step = ceil(per / split))
 *   when within is a multiple of step, offset lies before the packet's end
 *   (min((i + 1) * per, total)) and count is min(step, end - offset); else
 *   it is bad. A good one is stored unless its slot is set in `received`
 *   (bytes, one a slot) or taken earlier in the run. Returns four native
 *   int64 arrays back to back, one entry per record stored (its index, its
 *   slot, offset - start_sub, count), how many were bad, and a byte per
 *   record (1: bad), None when none was.
 *
 * mark_data(heads, take, local, received, block_max, droppable, classes,
 *           layers, droppable_bit) -> None
 *
 *   The stored records `take` (int64) of a data run noted in their slots
 *   `local` (int64) of a sender's row: received set, block_max (float32) the
 *   aux field's bits, droppable (bytes, or None: left alone) set where the
 *   flags have droppable_bit, classes (bytes) lowered to the priority, layers
 *   (uint16) the layer field.
 *
 * mark_results(heads, take, local, received, contributors, block_max, per)
 *
 *   The same for a result run: received[local] set; of packet offset / per,
 *   contributors (int64) the contributors field and block_max (float32) the
 *   param field's bits.
 *
 * Segment
 *
 *   A datagram inside a receive buffer, read in place (dlcp/wire/segment.h):
 *   dlcp.daemon._udp makes them; Python cannot.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <emmintrin.h>

#include "bytes_of.h"
#include "datagrams.h"

static PyObject *LengthError;

static int
int64_buffer(PyObject *obj, Py_buffer *view, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (view->itemsize != 8 || view->format == NULL ||
        (strcmp(view->format, "q") != 0 && strcmp(view->format, "l") != 0 &&
         strcmp(view->format, "<q") != 0 && strcmp(view->format, "<l") != 0 &&
         strcmp(view->format, "=q") != 0 && strcmp(view->format, "=l") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int64 buffer", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* The first `size` bytes of item i of `it` into `to` (zeros if it is shorter)
 * and its length into *length; -1 with an exception set. */
static int
copy_head(Items *it, Py_ssize_t i, char *to, Py_ssize_t size, int64_t *length)
{
    Bytes b;
    if (items_get(it, i, &b) < 0)
        return -1;
    *length = b.len;
    if (b.len >= size)
        memcpy(to, b.buf, (size_t)size);
    else
        memset(to, 0, (size_t)size);
    bytes_release(&b);
    return 0;
}

static PyObject *
heads(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *datagrams;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "On", &datagrams, &size))
        return NULL;
    if (size < 0 || size > 65536) {
        PyErr_SetString(PyExc_ValueError, "size must be 0 to 65536");
        return NULL;
    }
    Items it;
    if (items_open(&it, datagrams, "datagrams must be a list, tuple or Datagrams") < 0)
        return NULL;
    Py_ssize_t n = it.n;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * size);
    PyObject *lens = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL || lens == NULL)
        goto fail;
    char *o = PyByteArray_AS_STRING(out);
    int64_t *len = (int64_t *)PyBytes_AS_STRING(lens);
    for (Py_ssize_t i = 0; i < n; i++)
        if (copy_head(&it, i, o + i * size, size, &len[i]) < 0)
            goto fail;
    items_close(&it);
    return Py_BuildValue("(NN)", out, lens);
fail:
    Py_XDECREF(out);
    Py_XDECREF(lens);
    items_close(&it);
    return NULL;
}

/* dest[k] = own[k] + payload lane k for k in [from, to), one lane at a time
 * (the payload may be unaligned). */
static void
add_lanes(float *dest, const float *own, const char *payload, Py_ssize_t from, Py_ssize_t to)
{
    for (Py_ssize_t k = from; k < to; k++) {
        float b;
        memcpy(&b, payload + k * 4, sizeof b);
        dest[k] = own[k] + b;
    }
}

/* Runs at least this long, and runs that follow one another (see `Lines`),
 * are written with non-temporal stores: a run's
 * destination (a rank's result lanes, tens of megabytes a round) is not read
 * again before the round ends, so caching it only evicts what is, and a
 * normal store first reads each cache line it writes from memory. */
#define STREAM_MIN 4096

/* own[k] + payload[k] into dest[k], float32 lanes; the payload may be unaligned. */
static void
add_f32(float *dest, const float *own, const char *payload, Py_ssize_t n)
{
    typedef float v8f __attribute__((vector_size(32)));
    Py_ssize_t k = 0;
    for (; k + 8 <= n; k += 8) {
        v8f a, b;
        memcpy(&a, own + k, sizeof a);
        memcpy(&b, payload + k * 4, sizeof b);
        a += b;
        memcpy(dest + k, &a, sizeof a);
    }
    add_lanes(dest, own, payload, k, n);
}

/* Short runs that follow one another in dest (a shard's packets, a few
 * hundred lanes each at a 1500-byte MTU) are written as one stream: each whole
 * 64-byte line of dest with one non-temporal store, the bytes of a line a run
 * leaves unfinished held here until the next run finishes it (or written with
 * normal stores when it does not continue there). Runs of STREAM_MIN bytes or
 * more that do not follow one another take the same path. The bytes stored are
 * those of memcpy and add_f32 (the same IEEE additions): only the order in
 * which lines reach memory differs, never what a later run reads (a run that
 * does not start where the held bytes end has them written first; one that
 * does reads past them). At 1500 bytes a packet this made a batch's copies
 * about 1.5x and its sums about 1.2x as fast as normal stores did. */
typedef struct {
    char *line; /* the 64-byte-aligned line of dest the held bytes belong to, or NULL */
    char *end;  /* where they end: line < end < line + 64 (they start at line) */
    int streamed;
    char buf[64] __attribute__((aligned(64)));
} Lines;

/* Write out the held bytes with normal stores. */
static void
lines_flush(Lines *w)
{
    if (w->line != NULL)
        memcpy(w->line, w->buf, (size_t)(w->end - w->line));
    w->line = NULL;
}

/* `n` bytes of the run's output from byte `at` on (a multiple of 4 for
 * adds: dest is on the lane grid when this is used) into `to`. */
static inline void
produce(char *to, const char *src, const float *own, Py_ssize_t at, Py_ssize_t n)
{
    if (own == NULL) {
        memcpy(to, src + at, (size_t)n);
        return;
    }
    for (Py_ssize_t k = 0; k < n; k += 4) {
        float a, b;
        memcpy(&a, (const char *)own + at + k, 4);
        memcpy(&b, src + at + k, 4);
        a += b;
        memcpy(to + k, &a, 4);
    }
}

/* One whole line: 64 bytes of output from byte `at` on to the aligned `to`. */
static inline void
stream_line(char *to, const char *src, const float *own, Py_ssize_t at)
{
    __m128i v[4];
    if (own == NULL) {
        for (int j = 0; j < 4; j++)
            v[j] = _mm_loadu_si128((const __m128i *)(src + at + 16 * j));
    } else {
        for (int j = 0; j < 4; j++)
            v[j] = _mm_castps_si128(
                _mm_add_ps(_mm_loadu_ps((const float *)((const char *)own + at + 16 * j)),
                           _mm_loadu_ps((const float *)(src + at + 16 * j))));
    }
    for (int j = 0; j < 4; j++)
        _mm_stream_si128((__m128i *)(to + 16 * j), v[j]);
}

/* Write the run of `n` bytes at `dst` (its output: `src`'s bytes, or with
 * `own` (the same offsets as dst within own's buffer) their float sums). */
static void
lines_run(Lines *w, char *dst, const char *src, const float *own, Py_ssize_t n)
{
    Py_ssize_t at = 0;
    if (w->line != NULL && dst == w->end) { /* it goes on where the held bytes end */
        Py_ssize_t room = (w->line + 64) - w->end, k = n < room ? n : room;
        produce(w->buf + (w->end - w->line), src, own, 0, k);
        w->end += k;
        at = k;
        if (w->end == w->line + 64) {
            for (int j = 0; j < 4; j++)
                _mm_stream_si128((__m128i *)(w->line + 16 * j),
                                 _mm_load_si128((const __m128i *)(w->buf + 16 * j)));
            w->streamed = 1;
            w->line = NULL;
        }
        if (at == n)
            return;
    } else {
        lines_flush(w);
        Py_ssize_t head = (Py_ssize_t)((64 - ((uintptr_t)dst & 63)) & 63);
        if (head > n)
            head = n;
        produce(dst, src, own, 0, head); /* up to the first whole line: normal stores */
        at = head;
    }
    for (; n - at >= 64; at += 64) {
        stream_line(dst + at, src, own, at);
        w->streamed = 1;
    }
    if (at < n) { /* the start of a line: held for the next run */
        w->line = dst + at;
        w->end = dst + n;
        produce(w->buf, src, own, at, n - at);
    }
}

/* copy_runs (own == NULL) and add_runs: the same arguments, checks and order. */
static PyObject *
move_runs(PyObject *dest_obj, PyObject *own_obj, Py_ssize_t itemsize, PyObject *starts_obj,
          PyObject *counts_obj, PyObject *payloads, Py_ssize_t skip)
{
    if (itemsize <= 0 || itemsize > 8) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be 1 to 8");
        return NULL;
    }
    if (skip < 0) {
        PyErr_SetString(PyExc_ValueError, "skip must not be negative");
        return NULL;
    }
    Items it;
    if (items_open(&it, payloads, "payloads must be a list, tuple or Datagrams") < 0)
        return NULL;
    Py_buffer dest, own = {0}, starts, counts;
    if (PyObject_GetBuffer(dest_obj, &dest, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        items_close(&it);
        return NULL;
    }
    if (own_obj != NULL && PyObject_GetBuffer(own_obj, &own, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&dest);
        items_close(&it);
        return NULL;
    }
    if (int64_buffer(starts_obj, &starts, "starts") < 0) {
        if (own_obj != NULL)
            PyBuffer_Release(&own);
        PyBuffer_Release(&dest);
        items_close(&it);
        return NULL;
    }
    if (int64_buffer(counts_obj, &counts, "counts") < 0) {
        PyBuffer_Release(&starts);
        if (own_obj != NULL)
            PyBuffer_Release(&own);
        PyBuffer_Release(&dest);
        items_close(&it);
        return NULL;
    }
    Py_ssize_t n = it.n;
    PyObject *ret = NULL;
    Lines lines = {.line = NULL, .end = NULL, .streamed = 0};
    if (starts.len / 8 != n || counts.len / 8 != n) {
        PyErr_Format(PyExc_ValueError, "%zd payloads but %zd starts and %zd counts", n,
                     starts.len / 8, counts.len / 8);
        goto done;
    }
    if (own_obj != NULL && own.len != dest.len) {
        PyErr_Format(PyExc_ValueError, "own has %zd bytes, dest %zd", own.len, dest.len);
        goto done;
    }
    const int64_t *start = starts.buf, *count = counts.buf;
    const int64_t lanes = dest.len / itemsize;
    char *out = dest.buf;
    /* adds go through the lines only where a line holds whole lanes (dest on
     * the 4-byte grid, as numpy's arrays are); copies always may */
    const int on_grid = own_obj == NULL || ((uintptr_t)out & 3) == 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Bytes p;
        if (items_get(&it, i, &p) < 0)
            goto done;
        int64_t s = start[i], c = count[i];
        Py_ssize_t plen = p.len - skip;
        if (c < 0 || c > PY_SSIZE_T_MAX / itemsize || plen != c * itemsize) {
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
        const char *src = p.buf + skip;
        char *to = out + s * itemsize;
        if (on_grid && (plen >= STREAM_MIN || (lines.line != NULL && to == lines.end) ||
                        (i + 1 < n && start[i + 1] == s + c))) {
            lines_run(&lines, to, src, own_obj == NULL ? NULL : (const float *)own.buf + s, plen);
        } else {
            lines_flush(&lines);
            if (own_obj == NULL)
                memcpy(to, src, (size_t)plen);
            else
                add_f32((float *)to, (const float *)own.buf + s, src, (Py_ssize_t)c);
        }
        bytes_release(&p);
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    lines_flush(&lines); /* also after an error: the runs before it are stored */
    if (lines.streamed)
        _mm_sfence(); /* the streaming stores are seen before what follows */
    PyBuffer_Release(&counts);
    PyBuffer_Release(&starts);
    if (own_obj != NULL)
        PyBuffer_Release(&own);
    PyBuffer_Release(&dest);
    items_close(&it);
    return ret;
}

static PyObject *
copy_runs(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dest, *starts, *counts, *payloads;
    Py_ssize_t itemsize, skip = 0;
    if (!PyArg_ParseTuple(args, "OnOOO|n", &dest, &itemsize, &starts, &counts, &payloads, &skip))
        return NULL;
    return move_runs(dest, NULL, itemsize, starts, counts, payloads, skip);
}

static PyObject *
add_runs(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *dest, *own, *starts, *counts, *payloads;
    Py_ssize_t skip = 0;
    if (!PyArg_ParseTuple(args, "OOOOO|n", &dest, &own, &starts, &counts, &payloads, &skip))
        return NULL;
    return move_runs(dest, own, 4, starts, counts, payloads, skip);
}

/* The header checks of `dlcp.wire.batch._field_reasons`, in its order, one pass
 * over the header records (64 bytes each, fields big endian at their wire
 * offsets). The tables (256 bytes each, by type byte or codec byte) and the
 * constants come from Python, which keeps the definitions; this only walks. */
enum {
    T_TYPE_OK, T_CODEC_OK, T_LANES, T_DATA, T_RESULT, T_TYPE_BITS, T_TYPE_ROUND,
    T_DATA_BITS, T_SUM_BITS, N_TABLES
};
#define HEAD_SIZE 64
#define NO_CHECK 255

/* where a header record's fields start (dlcp.wire.batch.HEADER_DTYPE; big endian) */
#define AT_VERSION 2
#define AT_TYPE 3
#define AT_FLAGS 4
#define AT_PRIORITY 5
#define AT_CODEC 6
#define AT_RESERVED 7
#define AT_JOB 8
#define AT_LAYER 22
#define AT_CONTRIBUTORS 26
#define AT_OFFSET 28
#define AT_COUNT 32
#define AT_TOTAL 36
#define AT_PARAM 40
#define AT_AUX 44

static uint32_t
be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static uint16_t
be16(const unsigned char *p)
{
    return (uint16_t)((p[0] << 8) | p[1]);
}

/* The index of the first check a header fails (the row of _CHECK_REASONS), or
 * NO_CHECK. */
static unsigned char
first_failed(const unsigned char *h, int64_t length, const unsigned char *t, long magic,
             long version, long bad_flags, long summed_flag, long max_priority,
             long long max_payload)
{
    if (length < HEAD_SIZE)
        return 0;
    unsigned ptype = h[AT_TYPE], flags = h[AT_FLAGS], codec = h[AT_CODEC];
    if (be16(h) != magic)
        return 1;
    if (h[AT_VERSION] != version)
        return 2;
    if (!t[T_TYPE_OK * 256 + ptype])
        return 3;
    if (flags & bad_flags)
        return 4;
    if (!t[T_CODEC_OK * 256 + codec])
        return 5;
    if (h[AT_RESERVED] != 0)
        return 6;
    if (h[AT_PRIORITY] > max_priority)
        return 7;
    int lanes = t[T_LANES * 256 + ptype];
    int64_t count = be32(h + AT_COUNT), offset = be32(h + AT_OFFSET), total = be32(h + AT_TOTAL);
    if (lanes && count == 0)
        return 8;
    if (lanes && offset + count > total)
        return 9;
    if (t[T_DATA * 256 + ptype] && be16(h + AT_CONTRIBUTORS) == 0)
        return 10;
    int64_t plen = length - HEAD_SIZE;
    if (plen > max_payload)
        return 11;
    int64_t bits;
    if (lanes) {
        int summed = t[T_RESULT * 256 + ptype] || (flags & summed_flag);
        bits = t[(summed ? T_SUM_BITS : T_DATA_BITS) * 256 + codec];
    } else {
        bits = t[T_TYPE_BITS * 256 + ptype];
    }
    if ((count * bits + t[T_TYPE_ROUND * 256 + ptype]) / 8 != plen)
        return 12;
    if (((be32(h + AT_PARAM) >> 23) & 0xFF) == 0xFF) /* param is not finite */
        return 13;
    return NO_CHECK;
}

/* The check tables (N_TABLES rows of 256 bytes, batch._CHECK_TABLES) as a
 * buffer in *view; -1 with an exception set. */
static int
tables_buffer(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len != N_TABLES * 256) {
        PyErr_Format(PyExc_ValueError, "tables must be %d bytes, not %zd", N_TABLES * 256,
                     view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *
field_checks(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *heads_obj, *lengths_obj, *tables_obj;
    long magic, version, bad_flags, summed_flag, max_priority;
    long long max_payload;
    if (!PyArg_ParseTuple(args, "OOOlllllL", &heads_obj, &lengths_obj, &tables_obj, &magic,
                          &version, &bad_flags, &summed_flag, &max_priority, &max_payload))
        return NULL;
    Py_buffer heads, lengths, tables;
    if (PyObject_GetBuffer(heads_obj, &heads, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (int64_buffer(lengths_obj, &lengths, "lengths") < 0) {
        PyBuffer_Release(&heads);
        return NULL;
    }
    if (tables_buffer(tables_obj, &tables) < 0) {
        PyBuffer_Release(&heads);
        PyBuffer_Release(&lengths);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = lengths.len / 8;
    if (heads.len != n * HEAD_SIZE) {
        PyErr_Format(PyExc_ValueError, "%zd header bytes for %zd lengths of %d-byte headers",
                     heads.len, n, HEAD_SIZE);
        goto done;
    }
    const unsigned char *h = heads.buf, *t = tables.buf;
    const int64_t *len = lengths.buf;
    Py_ssize_t i = 0;
    for (; i < n; i++) /* the usual batch passes: no result to build */
        if (first_failed(h + i * HEAD_SIZE, len[i], t, magic, version, bad_flags, summed_flag,
                         max_priority, max_payload) != NO_CHECK)
            break;
    if (i == n) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, n);
    if (result == NULL)
        goto done;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(result);
    memset(out, NO_CHECK, (size_t)i);
    for (; i < n; i++)
        out[i] = first_failed(h + i * HEAD_SIZE, len[i], t, magic, version, bad_flags,
                              summed_flag, max_priority, max_payload);
done:
    PyBuffer_Release(&heads);
    PyBuffer_Release(&lengths);
    PyBuffer_Release(&tables);
    return result;
}

/* heads() and field_checks() of a drain in one pass, and the job all its
 * records name when each passes every check (-1: not so). */
static PyObject *
checked_heads(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *datagrams, *tables_obj;
    long magic, version, bad_flags, summed_flag, max_priority;
    long long max_payload;
    if (!PyArg_ParseTuple(args, "OOlllllL", &datagrams, &tables_obj, &magic, &version,
                          &bad_flags, &summed_flag, &max_priority, &max_payload))
        return NULL;
    Py_buffer tables;
    if (tables_buffer(tables_obj, &tables) < 0)
        return NULL;
    Items it;
    if (items_open(&it, datagrams, "datagrams must be a list, tuple or Datagrams") < 0) {
        PyBuffer_Release(&tables);
        return NULL;
    }
    const unsigned char *t = tables.buf;
    Py_ssize_t n = it.n;
    PyObject *out = PyByteArray_FromStringAndSize(NULL, n * HEAD_SIZE);
    PyObject *first = NULL;
    unsigned char *fail = NULL; /* per record: the first check failed (once one has) */
    if (out == NULL)
        goto error;
    unsigned char *o = (unsigned char *)PyByteArray_AS_STRING(out);
    long long job = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char *h = o + i * HEAD_SIZE;
        int64_t length;
        if (copy_head(&it, i, (char *)h, HEAD_SIZE, &length) < 0)
            goto error;
        unsigned char f = first_failed(h, length, t, magic, version, bad_flags, summed_flag,
                                       max_priority, max_payload);
        if (f != NO_CHECK && first == NULL) {
            first = PyBytes_FromStringAndSize(NULL, n);
            if (first == NULL)
                goto error;
            fail = (unsigned char *)PyBytes_AS_STRING(first);
            memset(fail, NO_CHECK, (size_t)i);
        }
        if (fail != NULL)
            fail[i] = f;
        else if (i == 0)
            job = be32(h + AT_JOB);
        else if (job >= 0 && be32(h + AT_JOB) != (uint32_t)job)
            job = -2; /* more than one job: -1 below */
    }
    items_close(&it);
    PyBuffer_Release(&tables);
    if (first != NULL || job < 0)
        job = -1;
    return Py_BuildValue("(NNL)", out, first != NULL ? first : Py_NewRef(Py_None), job);
error:
    Py_XDECREF(out);
    Py_XDECREF(first);
    items_close(&it);
    PyBuffer_Release(&tables);
    return NULL;
}

static PyObject *
run_starts(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *heads_obj, *src_obj;
    Py_buffer mask, data_mask, lanes;
    int type_at, data_type;
    if (!PyArg_ParseTuple(args, "OOy*y*y*ii", &heads_obj, &src_obj, &mask, &data_mask, &lanes,
                          &type_at, &data_type))
        return NULL;
    Py_buffer heads = {0}, src = {0};
    PyObject *result = NULL;
    if (mask.len != HEAD_SIZE || data_mask.len != HEAD_SIZE || lanes.len != 256 || type_at < 0 ||
        type_at >= HEAD_SIZE) {
        PyErr_Format(PyExc_ValueError, "masks must be %d bytes, lanes 256, type_at a header byte",
                     HEAD_SIZE);
        goto done;
    }
    if (PyObject_GetBuffer(heads_obj, &heads, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (int64_buffer(src_obj, &src, "src") < 0)
        goto done;
    Py_ssize_t n = src.len / 8;
    if (heads.len != n * HEAD_SIZE) {
        PyErr_Format(PyExc_ValueError, "%zd header bytes for %zd sources of %d-byte headers",
                     heads.len, n, HEAD_SIZE);
        goto done;
    }
    result = PyBytes_FromStringAndSize(NULL, (n ? n : 1) * 8);
    if (result == NULL)
        goto done;
    uint64_t m[HEAD_SIZE / 8], dm[HEAD_SIZE / 8];
    memcpy(m, mask.buf, HEAD_SIZE);
    memcpy(dm, data_mask.buf, HEAD_SIZE);
    const unsigned char *h = heads.buf, *lt = lanes.buf;
    const int64_t *sr = src.buf;
    int64_t *out = (int64_t *)PyBytes_AS_STRING(result);
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const unsigned char *b = h + i * HEAD_SIZE;
        int same = 0;
        if (i > 0 && lt[b[type_at]] && lt[b[type_at - HEAD_SIZE]] && sr[i] == sr[i - 1]) {
            uint64_t w[HEAD_SIZE / 8], v[HEAD_SIZE / 8], diff = 0, ddiff = 0;
            memcpy(w, b, HEAD_SIZE);
            memcpy(v, b - HEAD_SIZE, HEAD_SIZE);
            for (int j = 0; j < HEAD_SIZE / 8; j++) {
                diff |= (w[j] ^ v[j]) & m[j];
                ddiff |= (w[j] ^ v[j]) & dm[j];
            }
            same = diff == 0 && (b[type_at] != data_type || ddiff == 0);
        }
        if (!same)
            out[k++] = i;
    }
    if (_PyBytes_Resize(&result, k * 8) < 0)
        result = NULL;
done:
    PyBuffer_Release(&mask);
    PyBuffer_Release(&data_mask);
    PyBuffer_Release(&lanes);
    if (heads.obj != NULL)
        PyBuffer_Release(&heads);
    if (src.obj != NULL)
        PyBuffer_Release(&src);
    return result;
}

/* ---- a run's slots (ShardAggregator / ResultCollector) ------------------- */

/* A writable C-contiguous buffer of `itemsize`-byte items. */
static int
items_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        return -1;
    if (view->len % itemsize != 0) {
        PyErr_Format(PyExc_TypeError, "%s must hold %zd-byte items", what, itemsize);
        PyBuffer_Release(view);
        view->obj = NULL;
        return -1;
    }
    return 0;
}

static void
release_all(Py_buffer *views, int n)
{
    for (int i = 0; i < n; i++)
        if (views[i].obj != NULL)
            PyBuffer_Release(&views[i]);
}

static PyObject *
run_index(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *heads_obj, *received_obj;
    long long per, split, total, base, slots, start_sub;
    if (!PyArg_ParseTuple(args, "OLLLLLLO", &heads_obj, &per, &split, &total, &base, &slots,
                          &start_sub, &received_obj))
        return NULL;
    if (per < 1 || split < 1 || slots < 0) {
        PyErr_SetString(PyExc_ValueError, "per and split must be positive, slots not negative");
        return NULL;
    }
    Py_buffer v[2] = {{0}, {0}};
    PyObject *idx = NULL, *bad = NULL, *result = NULL;
    unsigned char *seen = NULL;
    if (PyObject_GetBuffer(heads_obj, &v[0], PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (PyObject_GetBuffer(received_obj, &v[1], PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    if (v[0].len % HEAD_SIZE != 0 || v[1].len != slots) {
        PyErr_Format(PyExc_ValueError, "%zd header bytes, %zd received flags for %lld slots",
                     v[0].len, v[1].len, slots);
        goto done;
    }
    Py_ssize_t n = v[0].len / HEAD_SIZE, m = 0, n_bad = 0;
    idx = PyBytes_FromStringAndSize(NULL, (n ? n : 1) * 4 * 8);
    if (idx == NULL)
        goto done;
    int64_t *take = (int64_t *)PyBytes_AS_STRING(idx), *loc = take + n, *sta = take + 2 * n,
            *cnt = take + 3 * n;
    const unsigned char *h = v[0].buf, *received = v[1].buf;
    const int64_t step = (per + split - 1) / split;
    int64_t last = -1; /* the last good slot: while they increase, none repeats */
    for (Py_ssize_t k = 0; k < n; k++) {
        const unsigned char *b = h + k * HEAD_SIZE;
        int64_t offset = be32(b + AT_OFFSET), count = be32(b + AT_COUNT);
        int64_t i = offset / per, within = offset - i * per;
        int64_t local = i * split + within / step - base;
        int64_t end = (i + 1) * per < total ? (i + 1) * per : total;
        int64_t want = end - offset < step ? end - offset : step;
        if (slots == 0 || local < 0 || local >= slots || within % step != 0 || offset >= end ||
            count != want) {
            if (bad == NULL) {
                bad = PyBytes_FromStringAndSize(NULL, n);
                if (bad == NULL)
                    goto done;
                memset(PyBytes_AS_STRING(bad), 0, (size_t)n);
            }
            PyBytes_AS_STRING(bad)[k] = 1;
            n_bad++;
            continue;
        }
        if (seen == NULL && local <= last) { /* a slot may repeat: note those taken */
            seen = calloc((size_t)slots, 1);
            if (seen == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            for (Py_ssize_t j = 0; j < m; j++)
                seen[loc[j]] = 1;
        }
        last = local;
        if (received[local] || (seen != NULL && seen[local]))
            continue; /* a duplicate */
        if (seen != NULL)
            seen[local] = 1;
        take[m] = k;
        loc[m] = local;
        sta[m] = offset - start_sub;
        cnt[m] = count;
        m++;
    }
    /* the four arrays back to back, m each */
    memmove(take + m, loc, (size_t)m * 8);
    memmove(take + 2 * m, sta, (size_t)m * 8);
    memmove(take + 3 * m, cnt, (size_t)m * 8);
    if (_PyBytes_Resize(&idx, m * 4 * 8) < 0)
        goto done; /* idx is NULL */
    result = Py_BuildValue("(OnO)", idx, n_bad, bad != NULL ? bad : Py_None);
done:
    free(seen);
    Py_XDECREF(idx);
    Py_XDECREF(bad);
    release_all(v, 2);
    return result;
}

/* Checks shared by the mark functions: take and local of one length, every
 * take a record, every local a slot of `slots`. */
static int
check_marks(const Py_buffer *take, const Py_buffer *local, Py_ssize_t records,
            Py_ssize_t slots)
{
    if (take->len != local->len) {
        PyErr_SetString(PyExc_ValueError, "take and local differ in length");
        return -1;
    }
    const int64_t *t = take->buf, *l = local->buf;
    for (Py_ssize_t j = 0; j < take->len / 8; j++)
        if (t[j] < 0 || t[j] >= records || l[j] < 0 || l[j] >= slots) {
            PyErr_Format(PyExc_IndexError, "record %lld or slot %lld out of range",
                         (long long)t[j], (long long)l[j]);
            return -1;
        }
    return 0;
}

static PyObject *
mark_data(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[8];
    int droppable_bit;
    if (!PyArg_ParseTuple(args, "OOOOOOOOi", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6],
                          &o[7], &droppable_bit))
        return NULL;
    /* heads, take, local, received, block_max, droppable|None, classes, layers */
    Py_buffer v[8] = {{0}};
    PyObject *result = NULL;
    if (PyObject_GetBuffer(o[0], &v[0], PyBUF_C_CONTIGUOUS) < 0 ||
        int64_buffer(o[1], &v[1], "take") < 0 || int64_buffer(o[2], &v[2], "local") < 0 ||
        items_buffer(o[3], &v[3], 1, "received") < 0 ||
        items_buffer(o[4], &v[4], 4, "block_max") < 0 ||
        (o[5] != Py_None && items_buffer(o[5], &v[5], 1, "droppable") < 0) ||
        items_buffer(o[6], &v[6], 1, "classes") < 0 || items_buffer(o[7], &v[7], 2, "layers") < 0)
        goto done;
    Py_ssize_t slots = v[3].len;
    if (v[4].len != slots * 4 || (v[5].obj != NULL && v[5].len != slots) || v[6].len != slots ||
        v[7].len != slots * 2) {
        PyErr_SetString(PyExc_ValueError, "received, block_max, droppable, classes and layers "
                                          "must have one item a slot");
        goto done;
    }
    if (check_marks(&v[1], &v[2], v[0].len / HEAD_SIZE, slots) < 0)
        goto done;
    const unsigned char *h = v[0].buf;
    const int64_t *take = v[1].buf, *local = v[2].buf;
    unsigned char *received = v[3].buf, *droppable = v[5].buf, *classes = v[6].buf;
    unsigned char *block_max = v[4].buf;
    uint16_t *layers = v[7].buf;
    for (Py_ssize_t j = 0; j < v[1].len / 8; j++) {
        const unsigned char *b = h + take[j] * HEAD_SIZE;
        int64_t l = local[j];
        received[l] = 1;
        uint32_t aux = be32(b + AT_AUX); /* the block max's float32 bits */
        memcpy(block_max + 4 * l, &aux, 4);
        if (droppable != NULL && (b[AT_FLAGS] & droppable_bit))
            droppable[l] = 1;
        if (b[AT_PRIORITY] < classes[l])
            classes[l] = b[AT_PRIORITY];
        layers[l] = be16(b + AT_LAYER);
    }
    result = Py_NewRef(Py_None);
done:
    release_all(v, 8);
    return result;
}

static PyObject *
mark_results(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *o[6];
    long long per;
    if (!PyArg_ParseTuple(args, "OOOOOOL", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &per))
        return NULL;
    /* heads, take, local, received, contributors (int64), block_max (float32) */
    Py_buffer v[6] = {{0}};
    PyObject *result = NULL;
    if (per < 1) {
        PyErr_SetString(PyExc_ValueError, "per must be positive");
        return NULL;
    }
    if (PyObject_GetBuffer(o[0], &v[0], PyBUF_C_CONTIGUOUS) < 0 ||
        int64_buffer(o[1], &v[1], "take") < 0 || int64_buffer(o[2], &v[2], "local") < 0 ||
        items_buffer(o[3], &v[3], 1, "received") < 0 ||
        items_buffer(o[4], &v[4], 8, "contributors") < 0 ||
        items_buffer(o[5], &v[5], 4, "block_max") < 0)
        goto done;
    if (v[4].len / 8 != v[5].len / 4) {
        PyErr_SetString(PyExc_ValueError, "contributors and block_max differ in length");
        goto done;
    }
    if (check_marks(&v[1], &v[2], v[0].len / HEAD_SIZE, v[3].len) < 0)
        goto done;
    const unsigned char *h = v[0].buf;
    const int64_t *take = v[1].buf, *local = v[2].buf;
    unsigned char *received = v[3].buf, *block_max = v[5].buf;
    int64_t *contributors = v[4].buf, packets = v[4].len / 8;
    for (Py_ssize_t j = 0; j < v[1].len / 8; j++) { /* all checked before any is written */
        int64_t i = be32(h + take[j] * HEAD_SIZE + AT_OFFSET) / per;
        if (i >= packets) {
            PyErr_Format(PyExc_IndexError, "packet %lld of %lld", (long long)i,
                         (long long)packets);
            goto done;
        }
    }
    for (Py_ssize_t j = 0; j < v[1].len / 8; j++) {
        const unsigned char *b = h + take[j] * HEAD_SIZE;
        int64_t i = be32(b + AT_OFFSET) / per;
        received[local[j]] = 1;
        contributors[i] = be16(b + AT_CONTRIBUTORS);
        uint32_t param = be32(b + AT_PARAM); /* the block max's float32 bits */
        memcpy(block_max + 4 * i, &param, 4);
    }
    result = Py_NewRef(Py_None);
done:
    release_all(v, 6);
    return result;
}

/* ---- Segment (segment.h) ------------------------------------------------ */

static void
Segment_dealloc(SegmentObject *self)
{
    Py_XDECREF(self->owner);
    PyObject_Free(self);
}

static int
Segment_getbuffer(SegmentObject *self, Py_buffer *view, int flags)
{
    return PyBuffer_FillInfo(view, (PyObject *)self, (void *)self->buf, self->len, 1, flags);
}

static Py_ssize_t
Segment_length(SegmentObject *self)
{
    return self->len;
}

/* Indexing, slicing and comparison as a memoryview of the bytes: made only
 * for the few datagrams Python code reads itself. */
static PyObject *
Segment_subscript(SegmentObject *self, PyObject *key)
{
    PyObject *mv = PyMemoryView_FromObject((PyObject *)self);
    if (mv == NULL)
        return NULL;
    PyObject *r = PyObject_GetItem(mv, key);
    Py_DECREF(mv);
    return r;
}

static PyObject *
Segment_richcompare(PyObject *self, PyObject *other, int op)
{
    if (op != Py_EQ && op != Py_NE)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *mv = PyMemoryView_FromObject(self);
    if (mv == NULL)
        return NULL;
    PyObject *r = PyObject_RichCompare(mv, other, op);
    Py_DECREF(mv);
    return r;
}

static PyObject *
Segment_repr(SegmentObject *self)
{
    return PyUnicode_FromFormat("<dlcp Segment of %zd bytes>", self->len);
}

static PyBufferProcs Segment_as_buffer = {(getbufferproc)Segment_getbuffer, NULL};
static PyMappingMethods Segment_mapping = {(lenfunc)Segment_length,
                                           (binaryfunc)Segment_subscript, NULL};
static PySequenceMethods Segment_sequence = {(lenfunc)Segment_length};
static PyMemberDef Segment_members[] = {
    {"obj", T_OBJECT, offsetof(SegmentObject, owner), READONLY,
     "the receive buffer (bytes) the datagram lies in"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SegmentType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dlcp.wire._bulk.Segment",
    .tp_basicsize = sizeof(SegmentObject),
    .tp_dealloc = (destructor)Segment_dealloc,
    .tp_repr = (reprfunc)Segment_repr,
    .tp_as_sequence = &Segment_sequence,
    .tp_as_mapping = &Segment_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_as_buffer = &Segment_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A datagram inside a receive buffer: read-only bytes, read in place by dlcp's C loops.",
    .tp_richcompare = Segment_richcompare,
    .tp_members = Segment_members,
};

/* ---- Datagrams (datagrams.h) ---------------------------------------------- */

static PyTypeObject DatagramsType;

static void
Datagrams_dealloc(DatagramsObject *self)
{
    if (self->base != NULL)
        Py_DECREF(self->base);
    else
        PyMem_Free((void *)self->buf); /* the block of the three arrays */
    Py_XDECREF(self->owners);
    PyObject_Free(self);
}

static Py_ssize_t
Datagrams_length(DatagramsObject *self)
{
    return self->n;
}

/* Datagram i as a Segment (i in range). */
static PyObject *
Datagrams_segment(DatagramsObject *self, Py_ssize_t i)
{
    PyObject *owner = PyList_GET_ITEM(self->owners, self->owner[i]);
    return segment_new(&SegmentType, owner, self->buf[i], self->len[i]);
}

static PyObject *
Datagrams_item(DatagramsObject *self, Py_ssize_t i)
{
    if (i < 0 || i >= self->n) {
        PyErr_SetString(PyExc_IndexError, "Datagrams index out of range");
        return NULL;
    }
    return Datagrams_segment(self, i);
}

/* datagrams[a:b]: another Datagrams over the same arrays (no copy). */
static PyObject *
Datagrams_slice(DatagramsObject *self, Py_ssize_t a, Py_ssize_t b)
{
    DatagramsObject *d = PyObject_New(DatagramsObject, &DatagramsType);
    if (d == NULL)
        return NULL;
    DatagramsObject *root = self->base != NULL ? (DatagramsObject *)self->base : self;
    Py_INCREF(root);
    d->base = (PyObject *)root;
    Py_INCREF(self->owners);
    d->owners = self->owners;
    d->buf = self->buf + a;
    d->len = self->len + a;
    d->owner = self->owner + a;
    d->n = b - a;
    return (PyObject *)d;
}

static PyObject *
Datagrams_subscript(DatagramsObject *self, PyObject *key)
{
    if (PyIndex_Check(key)) {
        Py_ssize_t i = PyNumber_AsSsize_t(key, PyExc_IndexError);
        if (i == -1 && PyErr_Occurred())
            return NULL;
        if (i < 0)
            i += self->n;
        return Datagrams_item(self, i);
    }
    if (!PySlice_Check(key)) {
        PyErr_Format(PyExc_TypeError, "Datagrams indices must be integers or slices, not %.200s",
                     Py_TYPE(key)->tp_name);
        return NULL;
    }
    Py_ssize_t start, stop, step;
    if (PySlice_Unpack(key, &start, &stop, &step) < 0)
        return NULL;
    Py_ssize_t k = PySlice_AdjustIndices(self->n, &start, &stop, step);
    if (step == 1)
        return Datagrams_slice(self, start, start + k);
    PyObject *out = PyList_New(k); /* another step: a list of Segments */
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = 0, i = start; j < k; j++, i += step) {
        PyObject *v = Datagrams_segment(self, i);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, j, v);
    }
    return out;
}

static PyObject *
Datagrams_repr(DatagramsObject *self)
{
    return PyUnicode_FromFormat("<dlcp Datagrams: %zd>", self->n);
}

static PySequenceMethods Datagrams_sequence = {
    .sq_length = (lenfunc)Datagrams_length,
    .sq_item = (ssizeargfunc)Datagrams_item,
};
static PyMappingMethods Datagrams_mapping = {(lenfunc)Datagrams_length,
                                             (binaryfunc)Datagrams_subscript, NULL};

static PyTypeObject DatagramsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dlcp.wire._bulk.Datagrams",
    .tp_basicsize = sizeof(DatagramsObject),
    .tp_dealloc = (destructor)Datagrams_dealloc,
    .tp_repr = (reprfunc)Datagrams_repr,
    .tp_as_sequence = &Datagrams_sequence,
    .tp_as_mapping = &Datagrams_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Datagrams inside receive buffers: a sequence of Segments made when asked "
              "for, read in place by dlcp's C loops (made by dlcp.daemon._udp and join).",
};

/* join(parts): one Datagrams of the parts' datagrams, in order. */
static PyObject *
join(PyObject *self, PyObject *parts)
{
    (void)self;
    if (!PyList_Check(parts)) {
        PyErr_SetString(PyExc_TypeError, "parts must be a list of Datagrams");
        return NULL;
    }
    Py_ssize_t k = PyList_GET_SIZE(parts), n = 0, n_owners = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        PyObject *p = PyList_GET_ITEM(parts, j);
        if (Py_TYPE(p) != &DatagramsType) {
            PyErr_Format(PyExc_TypeError, "part %zd is a %.200s, not Datagrams", j,
                         Py_TYPE(p)->tp_name);
            return NULL;
        }
        n += ((DatagramsObject *)p)->n;
        n_owners += PyList_GET_SIZE(((DatagramsObject *)p)->owners);
    }
    PyObject *owners = PyList_New(n_owners);
    if (owners == NULL)
        return NULL;
    DatagramsObject *d = datagrams_new(&DatagramsType, n, owners);
    Py_DECREF(owners);
    if (d == NULL)
        return NULL;
    Py_ssize_t at = 0, base = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        const DatagramsObject *p = (const DatagramsObject *)PyList_GET_ITEM(parts, j);
        Py_ssize_t m = PyList_GET_SIZE(p->owners);
        for (Py_ssize_t o = 0; o < m; o++) {
            PyObject *v = PyList_GET_ITEM(p->owners, o);
            Py_INCREF(v);
            PyList_SET_ITEM(owners, base + o, v);
        }
        memcpy(d->buf + at, p->buf, (size_t)p->n * sizeof *d->buf);
        memcpy(d->len + at, p->len, (size_t)p->n * sizeof *d->len);
        for (Py_ssize_t i = 0; i < p->n; i++)
            d->owner[at + i] = p->owner[i] + base;
        at += p->n;
        base += m;
    }
    return (PyObject *)d;
}

#include "lane_store.h" /* store_lanes, pick */

static PyMethodDef methods[] = {
    {"store_lanes", store_lanes, METH_VARARGS,
     "store_lanes(dest, kind, table, starts, counts, payloads, skip=0): each payload's "
     "lanes (less its first skip bytes) unpacked as kind says (fp16 or fft codes through "
     "table, 8-, 4-, 10- or 1-bit lanes) into dest at its start lane, in order"},
    {"to_halves", to_halves, METH_VARARGS,
     "to_halves(src, dest): float32 lanes cast to fp16 into dest by the CPU's F16C "
     "conversion, NaNs as numpy makes them (ValueError without F16C)"},
    {"pack_u10", pack_u10, METH_VARARGS,
     "pack_u10(src, dest): uint16 lanes as 10-bit lanes, LSB first, four in five bytes "
     "(THC8_SUM10's result lanes)"},
    {"pick", pick, METH_VARARGS,
     "pick(datagrams, index) -> Datagrams | list: the datagrams at the int64 positions "
     "index, a Datagrams of a Datagrams (no object a datagram)"},
    {"join", join, METH_O,
     "join(parts) -> Datagrams: the datagrams of a list of Datagrams, in order"},
    {"heads", heads, METH_VARARGS,
     "heads(datagrams, size) -> (bytearray, bytes): the first size bytes of each "
     "datagram back to back (zeros for a shorter one) and their lengths as int64s"},
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(dest, itemsize, starts, counts, payloads, skip=0): each payload "
     "(less its first skip bytes) into dest at its start lane, in order"},
    {"add_runs", add_runs, METH_VARARGS,
     "add_runs(dest, own, starts, counts, payloads, skip=0): copy_runs of float32 "
     "lanes, each stored as own[lane] + payload lane (own: float32, dest's length)"},
    {"field_checks", field_checks, METH_VARARGS,
     "field_checks(heads, lengths, tables, magic, version, bad_flags, summed_flag, "
     "max_priority, max_payload) -> bytes | None: per header record the index of the "
     "first check of dlcp.wire.batch._field_reasons it fails (255: none); None when "
     "all pass"},
    {"checked_heads", checked_heads, METH_VARARGS,
     "checked_heads(datagrams, tables, magic, version, bad_flags, summed_flag, "
     "max_priority, max_payload) -> (bytearray, bytes | None, int): heads(datagrams, "
     "64)[0] and field_checks of its records in one pass, and the job every record names "
     "when all pass and name one (-1: not so)"},
    {"run_starts", run_starts, METH_VARARGS,
     "run_starts(heads, src, mask, data_mask, lanes, type_at, data_type) -> bytes: the "
     "int64 indices of the header records that start a run of Engine.receive_many"},
    {"run_index", run_index, METH_VARARGS,
     "run_index(heads, per, split, total, base, slots, start_sub, received) -> "
     "(bytes, int, bytes | None): the records of a run to store (take, local slot, "
     "start lane less start_sub, count: int64 arrays back to back), how many are not "
     "of the slots, and which (None: none)"},
    {"mark_data", mark_data, METH_VARARGS,
     "mark_data(heads, take, local, received, block_max, droppable, classes, layers, "
     "droppable_bit): a data run's stored packets noted in a sender's row"},
    {"mark_results", mark_results, METH_VARARGS,
     "mark_results(heads, take, local, received, contributors, block_max, per): a "
     "result run's stored packets noted"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_bulk", "Per-datagram byte moves of dlcp's receive path in C.", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__bulk(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    LengthError = PyErr_NewException("dlcp.wire._bulk.LengthError", PyExc_ValueError, NULL);
    if (LengthError == NULL || PyModule_AddObject(m, "LengthError", LengthError) < 0) {
        Py_XDECREF(LengthError);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(LengthError);
    if (PyType_Ready(&SegmentType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&SegmentType);
    if (PyModule_AddObject(m, "Segment", (PyObject *)&SegmentType) < 0) {
        Py_DECREF(&SegmentType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyType_Ready(&DatagramsType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&DatagramsType);
    if (PyModule_AddObject(m, "Datagrams", (PyObject *)&DatagramsType) < 0) {
        Py_DECREF(&DatagramsType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
