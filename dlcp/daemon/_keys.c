/* The outbox's packet identities in C (dlcp.daemon._keys).
 *
 * A packet's identity is its type byte (header byte 3) followed by header
 * bytes 8..35 (job to element count): 29 bytes that name the packet whatever
 * its flags, class or MAC (see dlcp/daemon/packet_keys.py, `_identity`). Its head
 * is the identity's first 15 bytes: the leg and (job, round, bucket, shard).
 * Python builds each with two slices and a concatenation; here each is one
 * allocation and a copy. `shard_keys` reads what queueing a batch takes (type,
 * flags and barrier key of each packet, and whether a packet may be there
 * twice). `unqueue` does a sent batch's bookkeeping (identities out of the
 * pending set, packets per shard, the queue popped) in one call. The
 * Python definitions in packet_keys.py stay the reference: tests/test_outbox_keys.py
 * checks these against them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../wire/gathered.h"

#define TYPE_AT 3
#define FLAGS_AT 4
#define FIELDS_AT 8
#define FIELDS_END 36
#define ID_LEN (1 + FIELDS_END - FIELDS_AT) /* 29 */
#define HEAD_LEN 15
#define DATA 1
#define RESULT 2

/* The bytes of datagram `index` (bytes, or any contiguous buffer: then `view`
 * holds it until PyBuffer_Release, and *have_view says so), or NULL with an
 * exception set when it is shorter than the header fields an identity takes. */
static const char *
header_of(PyObject *dg, Py_ssize_t index, Py_buffer *view, int *have_view)
{
    const char *p;
    Py_ssize_t len;
    *have_view = 0;
    if (PyBytes_Check(dg)) {
        p = PyBytes_AS_STRING(dg);
        len = PyBytes_GET_SIZE(dg);
    } else if (is_gathered(dg)) { /* the header is held in the object */
        p = (const char *)((GatheredObject *)dg)->head;
        len = GATHERED_HEADER;
    } else {
        if (PyObject_GetBuffer(dg, view, PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        *have_view = 1;
        p = (const char *)view->buf;
        len = view->len;
    }
    if (len < FIELDS_END) {
        PyErr_Format(PyExc_ValueError,
                     "datagram %zd is %zd bytes: shorter than the %d header bytes an identity "
                     "takes",
                     index, len, FIELDS_END);
        if (*have_view)
            PyBuffer_Release(view);
        *have_view = 0;
        return NULL;
    }
    return p;
}

static inline void
fill_identity(char *q, const char *p)
{
    q[0] = p[TYPE_AT];
    memcpy(q + 1, p + FIELDS_AT, FIELDS_END - FIELDS_AT);
}

/* Item i of `seq` (from PySequence_Fast), read afresh each time: code that a
 * buffer export, a key comparison or popleft runs may have changed the list. */
static PyObject *
item_at(PyObject *seq, Py_ssize_t i)
{
    if (i >= PySequence_Fast_GET_SIZE(seq)) {
        PyErr_SetString(PyExc_RuntimeError, "the datagrams changed during the call");
        return NULL;
    }
    return PySequence_Fast_ITEMS(seq)[i];
}

/* The identity of datagram `index` of `seq` as new bytes. */
static PyObject *
identity_of(PyObject *seq, Py_ssize_t index)
{
    PyObject *dg = item_at(seq, index);
    if (dg == NULL)
        return NULL;
    Py_buffer view;
    int have_view;
    const char *p = header_of(dg, index, &view, &have_view);
    if (p == NULL)
        return NULL;
    PyObject *id = PyBytes_FromStringAndSize(NULL, ID_LEN);
    if (id != NULL)
        fill_identity(PyBytes_AS_STRING(id), p);
    if (have_view)
        PyBuffer_Release(&view);
    return id;
}

enum extra { IDS_ONLY, WITH_HEADS };

/* ids of a sequence of datagrams, and with them their heads (a list). */
static PyObject *
build(PyObject *arg, enum extra extra)
{
    PyObject *seq = PySequence_Fast(arg, "expected a sequence of datagrams");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *ids = PyList_New(n);
    PyObject *more = NULL;
    if (extra == WITH_HEADS)
        more = PyList_New(n);
    if (ids == NULL || (extra != IDS_ONLY && more == NULL))
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = identity_of(seq, i);
        if (id == NULL)
            goto fail;
        PyList_SET_ITEM(ids, i, id);
        if (extra == WITH_HEADS) {
            PyObject *head = PyBytes_FromStringAndSize(PyBytes_AS_STRING(id), HEAD_LEN);
            if (head == NULL)
                goto fail;
            PyList_SET_ITEM(more, i, head);
        }
    }
    Py_DECREF(seq);
    if (extra == IDS_ONLY)
        return ids;
    PyObject *pair = PyTuple_Pack(2, ids, more);
    Py_DECREF(ids);
    Py_DECREF(more);
    return pair;
fail:
    Py_DECREF(seq);
    Py_XDECREF(ids);
    Py_XDECREF(more);
    return NULL;
}

static PyObject *
identities(PyObject *self, PyObject *arg)
{
    (void)self;
    return build(arg, IDS_ONLY);
}

static PyObject *
identities_heads(PyObject *self, PyObject *arg)
{
    (void)self;
    return build(arg, WITH_HEADS);
}


/* The big-endian u32 at p. */
static inline uint32_t
be32(const char *p)
{
    const unsigned char *u = (const unsigned char *)p;
    return (uint32_t)u[0] << 24 | (uint32_t)u[1] << 16 | (uint32_t)u[2] << 8 | u[3];
}

#define OFFSET_AT 28
#define DISTINCT_MAX 64

/* shard_keys(datagrams) -> (heads, bkeys, distinct): what `Outbox.push_many`
 * needs to queue a batch without the identity of each packet. */
static PyObject *
shard_keys(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *seq = PySequence_Fast(arg, "expected a sequence of datagrams");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *heads = PyBytes_FromStringAndSize(NULL, 2 * n);
    PyObject *bkeys = PyList_New(n);
    PyObject *distinct = PyList_New(0);
    PyObject *key = NULL; /* the previous DATA/RESULT packet's barrier key */
    uint32_t offset = 0;  /* and its offset */
    int ordered = 1;
    if (heads == NULL || bkeys == NULL || distinct == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dg = item_at(seq, i);
        if (dg == NULL)
            goto fail;
        Py_buffer view;
        int have_view;
        const char *p = header_of(dg, i, &view, &have_view);
        if (p == NULL)
            goto fail;
        char *tf = PyBytes_AS_STRING(heads) + 2 * i;
        tf[0] = p[TYPE_AT];
        tf[1] = p[FLAGS_AT];
        PyObject *item = Py_None;
        int failed = 0;
        if (p[TYPE_AT] == DATA || p[TYPE_AT] == RESULT) {
            char head[HEAD_LEN];
            head[0] = p[TYPE_AT];
            memcpy(head + 1, p + FIELDS_AT, HEAD_LEN - 1);
            uint32_t off = be32(p + OFFSET_AT);
            if (key != NULL && memcmp(PyBytes_AS_STRING(key), head, HEAD_LEN) == 0) {
                if (off <= offset)
                    ordered = 0; /* not increasing: maybe the same packet again */
            } else {
                Py_XDECREF(key);
                key = PyBytes_FromStringAndSize(head, HEAD_LEN);
                if (key == NULL) {
                    failed = 1;
                } else if (ordered) {
                    /* a shard met before, after another: its packets are not one
                     * run (and past DISTINCT_MAX shards the caller takes the long way) */
                    int seen = PySequence_Contains(distinct, key);
                    if (seen < 0)
                        failed = 1;
                    else if (seen || PyList_GET_SIZE(distinct) >= DISTINCT_MAX)
                        ordered = 0;
                    else if (PyList_Append(distinct, key) < 0)
                        failed = 1;
                }
            }
            offset = off;
            if (!failed)
                item = key;
        }
        if (have_view)
            PyBuffer_Release(&view);
        if (failed)
            goto fail;
        Py_INCREF(item);
        PyList_SET_ITEM(bkeys, i, item);
    }
    Py_DECREF(seq);
    Py_XDECREF(key);
    if (!ordered) {
        Py_DECREF(distinct);
        distinct = Py_NewRef(Py_None);
    }
    PyObject *out = PyTuple_Pack(3, heads, bkeys, distinct);
    Py_DECREF(heads);
    Py_DECREF(bkeys);
    Py_DECREF(distinct);
    return out;
fail:
    Py_DECREF(seq);
    Py_XDECREF(key);
    Py_XDECREF(heads);
    Py_XDECREF(bkeys);
    Py_XDECREF(distinct);
    return NULL;
}

/* A shard and leg among a sent batch's DATA/RESULT packets: its barrier key
 * (the identity's head) and how many of them it had. */
typedef struct {
    char key[HEAD_LEN];
    Py_ssize_t count;
    int watched; /* its identities are in the pending set (see `unqueue`) */
} Shard;

/* The shards of a batch, counted. A batch is nearly always one shard, and
 * seldom more than a few: those are found by comparing keys one by one. Past
 * LINEAR_SHARDS of them (a batch could hold up to one shard a packet) an open
 * addressing table of their indices takes over. */
#define LINEAR_SHARDS 8

typedef struct {
    Shard local[LINEAR_SHARDS];
    Shard *shards;
    Py_ssize_t n;
    Py_ssize_t last; /* the shard the previous packet counted for, or -1 */
    Py_ssize_t *table; /* NULL until more than LINEAR_SHARDS shards */
    size_t mask;
    PyObject *watched; /* a set of barrier keys, or NULL: every shard is */
} Shards;

static size_t
key_hash(const char *key)
{
    uint64_t a, b;
    memcpy(&a, key, 8);
    memcpy(&b, key + HEAD_LEN - 8, 8);
    uint64_t h = a * 0x9E3779B97F4A7C15ULL ^ (b + 0x632BE59BD9B4E019ULL) * 0xC2B2AE3D27D4EB4FULL;
    return (size_t)(h ^ (h >> 31));
}

static void
table_insert(Shards *s, Py_ssize_t index)
{
    size_t i = key_hash(s->shards[index].key) & s->mask;
    while (s->table[i] >= 0)
        i = (i + 1) & s->mask;
    s->table[i] = index;
}

/* Whether shard `key` is in s->watched (always, without that set); -1 with
 * an exception set on error. */
static int
is_watched(Shards *s, const char *key)
{
    if (s->watched == NULL)
        return 1;
    if (PySet_GET_SIZE(s->watched) == 0)
        return 0;
    PyObject *k = PyBytes_FromStringAndSize(key, HEAD_LEN);
    if (k == NULL)
        return -1;
    int r = PySet_Contains(s->watched, k);
    Py_DECREF(k);
    return r;
}

/* Count one packet for shard `key` among at most `cap` shards; its index, or
 * -1 (with an exception set) when the table cannot be made. */
static Py_ssize_t
shards_count(Shards *s, const char *key, Py_ssize_t cap)
{
    if (s->last >= 0 && memcmp(s->shards[s->last].key, key, HEAD_LEN) == 0) {
        s->shards[s->last].count++;
        return s->last;
    }
    if (s->table == NULL) {
        for (Py_ssize_t j = 0; j < s->n; j++) {
            if (memcmp(s->shards[j].key, key, HEAD_LEN) == 0) {
                s->shards[j].count++;
                s->last = j;
                return j;
            }
        }
        if (s->n == LINEAR_SHARDS) {
            size_t size = 16;
            while (size < 2 * (size_t)cap)
                size <<= 1;
            s->shards = PyMem_Malloc((size_t)cap * sizeof(Shard));
            s->table = PyMem_Malloc(size * sizeof(Py_ssize_t));
            if (s->shards == NULL || s->table == NULL) {
                PyErr_NoMemory();
                return -1;
            }
            memcpy(s->shards, s->local, sizeof s->local);
            memset(s->table, 0xff, size * sizeof(Py_ssize_t)); /* all -1: empty */
            s->mask = size - 1;
            for (Py_ssize_t j = 0; j < s->n; j++)
                table_insert(s, j);
        }
    } else {
        size_t i = key_hash(key) & s->mask;
        for (Py_ssize_t j; (j = s->table[i]) >= 0; i = (i + 1) & s->mask) {
            if (memcmp(s->shards[j].key, key, HEAD_LEN) == 0) {
                s->shards[j].count++;
                s->last = j;
                return j;
            }
        }
    }
    int watched = is_watched(s, key);
    if (watched < 0)
        return -1;
    Shard *new = &s->shards[s->n];
    memcpy(new->key, key, HEAD_LEN);
    new->count = 1;
    new->watched = watched;
    s->last = s->n++;
    if (s->table != NULL)
        table_insert(s, s->last);
    return s->last;
}

/* Remove the identity of the datagram at `p` from `pending`. (A reused key
 * object, refilled per datagram, saved only about 15 % of this call's time and
 * needs CPython's deprecated cached-hash field: not worth it.) */
static int
discard(PyObject *pending, const char *p)
{
    PyObject *id = PyBytes_FromStringAndSize(NULL, ID_LEN);
    if (id == NULL)
        return -1;
    fill_identity(PyBytes_AS_STRING(id), p);
    int r = PySet_Discard(pending, id);
    Py_DECREF(id);
    return r < 0 ? -1 : 0;
}

/* -- Fifo: a send queue (outbox.Peer.queues) ------------------------------
 *
 * The part of collections.deque the outbox uses (append, extend, popleft,
 * len, q[i], del q[i], iteration, clear), over one array with a head index.
 * What it adds is for the C calls here: `take` reads a batch off its array,
 * and `unqueue` pops a sent batch by moving the head, where a deque's batch
 * cost an iterator step and a popleft call per datagram. */
typedef struct {
    PyObject_HEAD
    PyObject **items; /* items[head .. tail) are queued */
    Py_ssize_t head, tail, cap;
} FifoObject;

static PyTypeObject FifoType;

#define Fifo_Check(o) (Py_TYPE(o) == &FifoType)
#define FIFO_LEN(f) ((f)->tail - (f)->head)

/* Room for `more` items after tail: the queued ones moved to the front, or
 * the array grown. 0, or -1 with an exception set. */
static int
fifo_reserve(FifoObject *f, Py_ssize_t more)
{
    Py_ssize_t n = FIFO_LEN(f);
    if (f->tail + more <= f->cap)
        return 0;
    if (n + more <= f->cap / 2) { /* half empty or more: the queued ones to the front */
        memmove(f->items, f->items + f->head, (size_t)n * sizeof(PyObject *));
        f->head = 0;
        f->tail = n;
        if (f->tail + more <= f->cap)
            return 0;
    }
    Py_ssize_t cap = f->cap ? f->cap : 16;
    while (cap < n + more)
        cap *= 2;
    PyObject **items = PyMem_Malloc((size_t)cap * sizeof(PyObject *));
    if (items == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (n)
        memcpy(items, f->items + f->head, (size_t)n * sizeof(PyObject *));
    PyMem_Free(f->items);
    f->items = items;
    f->cap = cap;
    f->head = 0;
    f->tail = n;
    return 0;
}

/* Drop the first `n` items (n <= len). */
static void
fifo_drop(FifoObject *f, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = f->items[f->head];
        f->head++; /* moved first: a destructor that looks at the queue sees it gone */
        Py_DECREF(o);
    }
    if (f->head == f->tail)
        f->head = f->tail = 0;
}

static PyObject *Fifo_extend(FifoObject *f, PyObject *iterable);

static PyObject *
Fifo_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *iterable = NULL;
    static char *kwlist[] = {"iterable", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:Fifo", kwlist, &iterable))
        return NULL;
    FifoObject *f = (FifoObject *)type->tp_alloc(type, 0);
    if (f == NULL)
        return NULL;
    if (iterable != NULL) {
        PyObject *r = Fifo_extend(f, iterable);
        if (r == NULL) {
            Py_DECREF(f);
            return NULL;
        }
        Py_DECREF(r);
    }
    return (PyObject *)f;
}

static int
Fifo_traverse(FifoObject *f, visitproc visit, void *arg)
{
    for (Py_ssize_t i = f->head; i < f->tail; i++)
        Py_VISIT(f->items[i]);
    return 0;
}

static int
Fifo_clear(FifoObject *f)
{
    while (f->head < f->tail) {
        PyObject *o = f->items[--f->tail];
        Py_DECREF(o);
    }
    f->head = f->tail = 0;
    return 0;
}

static void
Fifo_dealloc(FifoObject *f)
{
    PyObject_GC_UnTrack(f);
    Fifo_clear(f);
    PyMem_Free(f->items);
    Py_TYPE(f)->tp_free((PyObject *)f);
}

static PyObject *
Fifo_append(FifoObject *f, PyObject *x)
{
    if (fifo_reserve(f, 1) < 0)
        return NULL;
    Py_INCREF(x);
    f->items[f->tail++] = x;
    Py_RETURN_NONE;
}

static PyObject *
Fifo_extend(FifoObject *f, PyObject *iterable)
{
    if ((PyObject *)f == iterable) {
        PyErr_SetString(PyExc_ValueError, "a Fifo cannot extend itself");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(iterable, "extend() takes an iterable");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (fifo_reserve(f, n) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject **src = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_INCREF(src[i]);
        f->items[f->tail++] = src[i];
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

static PyObject *
Fifo_popleft(FifoObject *f, PyObject *Py_UNUSED(ignored))
{
    if (f->head == f->tail) {
        PyErr_SetString(PyExc_IndexError, "pop from an empty Fifo");
        return NULL;
    }
    PyObject *o = f->items[f->head++]; /* the queue's reference, now the caller's */
    if (f->head == f->tail)
        f->head = f->tail = 0;
    return o;
}

static PyObject *
Fifo_clear_method(FifoObject *f, PyObject *Py_UNUSED(ignored))
{
    Fifo_clear(f);
    Py_RETURN_NONE;
}

static Py_ssize_t
Fifo_length(FifoObject *f)
{
    return FIFO_LEN(f);
}

static PyObject *
Fifo_item(FifoObject *f, Py_ssize_t i)
{
    if (i < 0 || i >= FIFO_LEN(f)) {
        PyErr_SetString(PyExc_IndexError, "Fifo index out of range");
        return NULL;
    }
    PyObject *o = f->items[f->head + i];
    Py_INCREF(o);
    return o;
}

/* del q[i] (the only assignment: q[i] = x is refused) */
static int
Fifo_ass_item(FifoObject *f, Py_ssize_t i, PyObject *v)
{
    if (v != NULL) {
        PyErr_SetString(PyExc_TypeError, "a Fifo's items cannot be replaced");
        return -1;
    }
    if (i < 0 || i >= FIFO_LEN(f)) {
        PyErr_SetString(PyExc_IndexError, "Fifo index out of range");
        return -1;
    }
    PyObject *o = f->items[f->head + i];
    memmove(f->items + f->head + i, f->items + f->head + i + 1,
            (size_t)(FIFO_LEN(f) - i - 1) * sizeof(PyObject *));
    f->tail--;
    if (f->head == f->tail)
        f->head = f->tail = 0;
    Py_DECREF(o);
    return 0;
}

/* An iterator over a snapshot (a list of the items now): the outbox iterates
 * a queue only to read it, never while it changes it. */
static PyObject *
Fifo_iter(FifoObject *f)
{
    Py_ssize_t n = FIFO_LEN(f);
    PyObject *list = PyList_New(n);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = f->items[f->head + i];
        Py_INCREF(o);
        PyList_SET_ITEM(list, i, o);
    }
    PyObject *it = PyObject_GetIter(list);
    Py_DECREF(list);
    return it;
}

static PyObject *
Fifo_repr(FifoObject *f)
{
    return PyUnicode_FromFormat("Fifo(<%zd items>)", FIFO_LEN(f));
}

static PySequenceMethods Fifo_as_sequence = {
    .sq_length = (lenfunc)Fifo_length,
    .sq_item = (ssizeargfunc)Fifo_item,
    .sq_ass_item = (ssizeobjargproc)Fifo_ass_item,
};

static PyMethodDef Fifo_methods[] = {
    {"append", (PyCFunction)Fifo_append, METH_O, "Queue x at the tail."},
    {"extend", (PyCFunction)Fifo_extend, METH_O, "Queue each item of an iterable at the tail."},
    {"popleft", (PyCFunction)Fifo_popleft, METH_NOARGS, "Take the item at the head."},
    {"clear", (PyCFunction)Fifo_clear_method, METH_NOARGS, "Drop every item."},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Fifo_doc,
"Fifo(iterable=()) -> a send queue\n\n"
"collections.deque's append, extend, popleft, clear, len, q[i], del q[i] and\n"
"iteration (over the items as they were when it began), over one array: take\n"
"and unqueue read and pop a batch of it without a step per item in Python.");

static PyTypeObject FifoType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "dlcp.daemon._keys.Fifo",
    .tp_basicsize = sizeof(FifoObject),
    .tp_dealloc = (destructor)Fifo_dealloc,
    .tp_repr = (reprfunc)Fifo_repr,
    .tp_as_sequence = &Fifo_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = Fifo_doc,
    .tp_traverse = (traverseproc)Fifo_traverse,
    .tp_clear = (inquiry)Fifo_clear,
    .tp_iter = (getiterfunc)Fifo_iter,
    .tp_methods = Fifo_methods,
    .tp_new = Fifo_new,
};

static PyObject *
unqueue(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs < 3 || nargs > 5) {
        PyErr_Format(PyExc_TypeError, "unqueue() takes 3 to 5 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *pending = args[0];
    PyObject *popleft = nargs >= 4 && args[3] != Py_None ? args[3] : NULL;
    PyObject *watched = nargs == 5 && args[4] != Py_None ? args[4] : NULL;
    if (!PySet_Check(pending)) {
        PyErr_Format(PyExc_TypeError, "pending must be a set, not %.100s",
                     Py_TYPE(pending)->tp_name);
        return NULL;
    }
    if (watched != NULL && !PyAnySet_Check(watched)) {
        PyErr_Format(PyExc_TypeError, "watched must be a set, not %.100s",
                     Py_TYPE(watched)->tp_name);
        return NULL;
    }
    Py_ssize_t n = PyNumber_AsSsize_t(args[2], NULL); /* clipped: out of range below */
    if (n == -1 && PyErr_Occurred())
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "expected a sequence of datagrams");
    if (seq == NULL)
        return NULL;
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = NULL;
    Shards s = {.n = 0, .last = -1, .table = NULL, .watched = watched};
    s.shards = s.local;
    if (n < 0 || n > len) {
        PyErr_Format(PyExc_ValueError, "%zd datagrams left the queue, of a batch of %zd", n,
                     len);
        goto done;
    }
    /* every datagram is checked before the set changes: bad input leaves it */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dg = item_at(seq, i);
        if (dg == NULL)
            goto done;
        if (PyBytes_Check(dg) && PyBytes_GET_SIZE(dg) >= FIELDS_END)
            continue;
        Py_buffer view;
        int have_view;
        if (header_of(dg, i, &view, &have_view) == NULL)
            goto done;
        if (have_view)
            PyBuffer_Release(&view);
    }
    /* Backwards: a shard first met here is met at its last packet, so the
     * shards come in reverse order of their last packets. */
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        PyObject *dg = item_at(seq, i);
        if (dg == NULL)
            goto done;
        Py_buffer view;
        int have_view;
        const char *p = header_of(dg, i, &view, &have_view);
        if (p == NULL)
            goto done;
        int failed = 0, tracked = 1;
        if (p[TYPE_AT] == DATA || p[TYPE_AT] == RESULT) {
            char key[HEAD_LEN];
            key[0] = p[TYPE_AT];
            memcpy(key + 1, p + FIELDS_AT, HEAD_LEN - 1);
            Py_ssize_t j = shards_count(&s, key, n);
            failed = j < 0;
            tracked = !failed && s.shards[j].watched;
        }
        if (!failed && tracked)
            failed = discard(pending, p);
        if (have_view)
            PyBuffer_Release(&view);
        if (failed)
            goto done;
    }
    /* A Python loop of popleft calls cost about as much again as all the rest:
     * the interpreter's loop, not the deque. A Fifo is popped at once. */
    if (popleft != NULL && Fifo_Check(popleft)) {
        FifoObject *f = (FifoObject *)popleft;
        if (FIFO_LEN(f) < n) {
            PyErr_Format(PyExc_RuntimeError, "%zd datagrams left a queue of %zd", n,
                         FIFO_LEN(f));
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *mine = item_at(seq, i);
            if (mine == NULL)
                goto done;
            if (f->items[f->head + i] != mine) {
                PyErr_Format(PyExc_RuntimeError,
                             "datagram %zd popped off the queue is not the batch's", i);
                goto done;
            }
        }
        fifo_drop(f, n);
    }
    else if (popleft != NULL) {
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *dg = PyObject_CallNoArgs(popleft);
            if (dg == NULL)
                goto done;
            Py_DECREF(dg); /* compared by address only */
            PyObject *mine = item_at(seq, i);
            if (mine == NULL)
                goto done;
            if (dg != mine) {
                PyErr_Format(PyExc_RuntimeError,
                             "datagram %zd popped off the queue is not the batch's", i);
                goto done;
            }
        }
    }
    out = PyList_New(s.n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < s.n; j++) {
        Shard *shard = &s.shards[s.n - 1 - j];
        PyObject *pair = Py_BuildValue("(y#n)", shard->key, (Py_ssize_t)HEAD_LEN, shard->count);
        if (pair == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, j, pair);
    }
done:
    Py_DECREF(seq);
    if (s.shards != s.local)
        PyMem_Free(s.shards);
    PyMem_Free(s.table);
    return out;
}

PyDoc_STRVAR(identities_doc,
             "identities(datagrams) -> list[bytes]\n\n"
             "Each datagram's identity: header byte 3, then bytes 8..35 (29 bytes).");
PyDoc_STRVAR(identities_heads_doc,
             "identities_heads(datagrams) -> (list[bytes], list[bytes])\n\n"
             "The identities and their first 15 bytes (leg, job, round, bucket, shard).");
PyDoc_STRVAR(unqueue_doc,
             "unqueue(pending, datagrams, n, popleft=None, watched=None) -> list[tuple[bytes, int]]\n\n"
             "The first n datagrams left the queue: discard their identities from the\n"
             "set pending (of DATA/RESULT packets, only those of the shards and legs\n"
             "whose barrier keys are in the set watched, when given), take them off\n"
             "the queue the batch heads (popleft: its popleft, called n times, or a\n"
             "Fifo, popped at once), and return (barrier key, packets) for each shard\n"
             "and leg of the DATA/RESULT packets among them, in the order of its last\n"
             "packet.");
PyDoc_STRVAR(shard_keys_doc,
             "shard_keys(datagrams) -> (bytes, list[bytes | None], list[bytes] | None)\n\n"
             "Each datagram's type and flags bytes (two a datagram); its barrier key\n"
             "(15 bytes: leg, job, round, bucket, shard) if it is a DATA/RESULT packet,\n"
             "else None, one object for each run of one key; and the distinct keys in\n"
             "order of first appearance, or None when a key's packets are not one run\n"
             "of increasing offsets (so two may be the same packet) or there are more\n"
             "than 64 keys.");

PyDoc_STRVAR(take_doc,
"take(queue, nbytes, count) -> (list, sizes)\n\n"
"The batch at the head of `queue` (an iterable of datagrams: a deque, or a\n"
"Fifo, read in place): as many as fit in `nbytes` bytes, at least one and at\n"
"most `count`, and their running byte sums (an int64 memoryview).\n"
"packet_keys._py_take is the definition.");

static PyObject *
take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "take() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t nbytes = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (nbytes == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t count = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (count == -1 && PyErr_Occurred())
        return NULL;
    if (count < 1) {
        PyErr_SetString(PyExc_ValueError, "count must be at least 1");
        return NULL;
    }
    Py_ssize_t len = PyObject_Length(args[0]);
    if (len < 0)
        return NULL;
    if (len == 0) {
        PyErr_SetString(PyExc_IndexError, "take from an empty queue");
        return NULL;
    }
    Py_ssize_t cap = len < count ? len : count;
    PyObject *head = PyList_New(0), *sizes = NULL, *it = NULL, *raw = NULL;
    if (head == NULL)
        return NULL;
    raw = PyBytes_FromStringAndSize(NULL, cap * (Py_ssize_t)sizeof(int64_t));
    /* a Fifo's array is read as it is; any other queue through an iterator */
    FifoObject *fifo = Fifo_Check(args[0]) ? (FifoObject *)args[0] : NULL;
    if (fifo == NULL)
        it = PyObject_GetIter(args[0]);
    if (raw == NULL || (fifo == NULL && it == NULL))
        goto fail;
    int64_t *sum = (int64_t *)PyBytes_AS_STRING(raw), total = 0;
    Py_ssize_t k = 0;
    while (k < cap) {
        PyObject *dg;
        if (fifo != NULL) {
            if (k >= FIFO_LEN(fifo))
                break;
            dg = fifo->items[fifo->head + k];
            Py_INCREF(dg);
        }
        else if ((dg = PyIter_Next(it)) == NULL) {
            if (PyErr_Occurred())
                goto fail;
            break; /* shorter than its length said */
        }
        Py_ssize_t n = PyBytes_CheckExact(dg) ? PyBytes_GET_SIZE(dg) : PyObject_Length(dg);
        if (n < 0 || (k > 0 && total + n > nbytes)) {
            Py_DECREF(dg);
            if (n < 0)
                goto fail;
            break;
        }
        int r = PyList_Append(head, dg);
        Py_DECREF(dg);
        if (r < 0)
            goto fail;
        total += n;
        sum[k++] = total;
    }
    Py_CLEAR(it);
    if (_PyBytes_Resize(&raw, k * (Py_ssize_t)sizeof(int64_t)) < 0)
        goto fail;
    PyObject *view = PyMemoryView_FromObject(raw);
    Py_CLEAR(raw);
    if (view == NULL)
        goto fail;
    sizes = PyObject_CallMethod(view, "cast", "s", "q");
    Py_DECREF(view);
    if (sizes == NULL)
        goto fail;
    return Py_BuildValue("(NN)", head, sizes);
fail:
    Py_XDECREF(it);
    Py_XDECREF(raw);
    Py_DECREF(head);
    return NULL;
}

PyDoc_STRVAR(clamped_classes_doc,
"clamped_classes(priorities, n) -> (list, bool)\n\n"
"The priorities (ints) each clamped into 0 .. n - 1: the same list where all\n"
"are in range already, else a new one; and whether they are all one class.\n"
"packet_keys._py_clamped_classes is the definition.");

static PyObject *
clamped_classes(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "clamped_classes() takes 2 arguments (%zd given)", nargs);
        return NULL;
    }
    if (!PyList_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "priorities must be a list");
        return NULL;
    }
    Py_ssize_t nc = PyNumber_AsSsize_t(args[1], PyExc_OverflowError);
    if (nc == -1 && PyErr_Occurred())
        return NULL;
    if (nc < 1) {
        PyErr_SetString(PyExc_ValueError, "n must be 1 or more");
        return NULL;
    }
    PyObject *list = args[0];
    Py_ssize_t n = PyList_GET_SIZE(list);
    long lo = 0, hi = 0, first = 0;
    int uniform = 1;
    PyObject *first_obj = n ? PyList_GET_ITEM(list, 0) : NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        if (i > 0 && o == first_obj) /* the same int object: the same class */
            continue;
        long c = PyLong_AsLong(o);
        if (c == -1 && PyErr_Occurred())
            return NULL;
        if (i == 0) {
            lo = hi = first = c;
        } else {
            if (c != first)
                uniform = 0;
            if (c < lo)
                lo = c;
            if (c > hi)
                hi = c;
        }
    }
    if (lo >= 0 && hi < nc)
        return Py_BuildValue("(OO)", list, uniform ? Py_True : Py_False);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        long c = PyLong_AsLong(PyList_GET_ITEM(list, i));
        if (c == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        PyObject *v = PyLong_FromLong(c < 0 ? 0 : (c >= nc ? (long)nc - 1 : c));
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return Py_BuildValue("(NO)", out, uniform ? Py_True : Py_False);
}

PyDoc_STRVAR(by_class_doc,
"by_class(datagrams, classes, drop, n) -> (list[list | None], int)\n\n"
"The datagrams of each class 0 .. n - 1 in their order (None for a class\n"
"with none; each class an int in 0 .. n - 1, one per datagram), and the\n"
"highest class below n - 1 of those whose `drop` byte (one per datagram) is\n"
"0, or -1 when there is none. packet_keys._py_by_class is the definition.");

static PyObject *
by_class(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "by_class() takes 4 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t nc = PyNumber_AsSsize_t(args[3], PyExc_OverflowError);
    if (nc == -1 && PyErr_Occurred())
        return NULL;
    if (nc < 1 || nc > 256) {
        PyErr_SetString(PyExc_ValueError, "n must be 1 to 256");
        return NULL;
    }
    if (!PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "drop must be bytes");
        return NULL;
    }
    PyObject *dgs = PySequence_Fast(args[0], "datagrams must be a sequence");
    if (dgs == NULL)
        return NULL;
    PyObject *cls = PySequence_Fast(args[1], "classes must be a sequence");
    PyObject *out = NULL, *lists = NULL;
    if (cls == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dgs);
    if (PySequence_Fast_GET_SIZE(cls) != n || PyBytes_GET_SIZE(args[2]) != n) {
        PyErr_Format(PyExc_ValueError, "%zd datagrams, %zd classes and %zd drop bytes", n,
                     PySequence_Fast_GET_SIZE(cls), PyBytes_GET_SIZE(args[2]));
        goto done;
    }
    const unsigned char *drop = (const unsigned char *)PyBytes_AS_STRING(args[2]);
    lists = PyList_New(nc);
    if (lists == NULL)
        goto done;
    for (Py_ssize_t c = 0; c < nc; c++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(lists, c, Py_None);
    }
    long trail = -1;
    PyObject **items = PySequence_Fast_ITEMS(dgs), **cs = PySequence_Fast_ITEMS(cls);
    for (Py_ssize_t i = 0; i < n; i++) {
        long c = PyLong_AsLong(cs[i]);
        if (c == -1 && PyErr_Occurred())
            goto fail;
        if (c < 0 || c >= nc) {
            PyErr_Format(PyExc_ValueError, "class %ld of datagram %zd is not in 0..%zd", c, i,
                         nc - 1);
            goto fail;
        }
        PyObject *l = PyList_GET_ITEM(lists, c);
        if (l == Py_None) {
            l = PyList_New(0);
            if (l == NULL)
                goto fail;
            PyList_SET_ITEM(lists, c, l);
            Py_DECREF(Py_None);
        }
        if (PyList_Append(l, items[i]) < 0)
            goto fail;
        if (!drop[i] && c < nc - 1 && c > trail)
            trail = c;
    }
    out = Py_BuildValue("(Ol)", lists, trail);
fail:
    Py_XDECREF(lists);
done:
    Py_DECREF(dgs);
    Py_XDECREF(cls);
    return out;
}

PyDoc_STRVAR(by_path_doc,
"by_path(datagrams, paths, n) -> (groups, indices, offsets, increasing)\n\n"
"A multi-path batch cut by path (`paths`: one int in 0 .. n - 1 a datagram):\n"
"for each path 0 .. n - 1, the list of its datagrams in their order, the\n"
"list of their places in the batch, the bytes of their offset fields\n"
"(header bytes 28..31, four a datagram) and whether those offsets strictly\n"
"increase; four Nones for a path with none. packet_keys._py_by_path is the\n"
"definition.");

#define OFFSET_AT 28

static PyObject *
by_path(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "by_path() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    Py_ssize_t np_ = PyNumber_AsSsize_t(args[2], PyExc_OverflowError);
    if (np_ == -1 && PyErr_Occurred())
        return NULL;
    if (np_ < 1 || np_ > 256) {
        PyErr_SetString(PyExc_ValueError, "n must be 1 to 256");
        return NULL;
    }
    PyObject *dgs = PySequence_Fast(args[0], "datagrams must be a sequence");
    if (dgs == NULL)
        return NULL;
    PyObject *pth = PySequence_Fast(args[1], "paths must be a sequence");
    PyObject *out = NULL, *groups = NULL, *indices = NULL, *offsets = NULL, *increasing = NULL;
    Py_ssize_t *counts = NULL, *fill = NULL;
    unsigned char *which = NULL;
    if (pth == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(dgs);
    if (PySequence_Fast_GET_SIZE(pth) != n) {
        PyErr_Format(PyExc_ValueError, "%zd datagrams but %zd paths", n,
                     PySequence_Fast_GET_SIZE(pth));
        goto done;
    }
    counts = PyMem_Calloc((size_t)np_, sizeof *counts);
    fill = PyMem_Calloc((size_t)np_, sizeof *fill);
    which = PyMem_Malloc(n > 0 ? (size_t)n : 1);
    if (counts == NULL || fill == NULL || which == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* first pass: each datagram's path, checked, and each path's count */
    PyObject **ps = PySequence_Fast_ITEMS(pth);
    for (Py_ssize_t i = 0; i < n; i++) {
        long p = PyLong_AsLong(ps[i]);
        if (p == -1 && PyErr_Occurred())
            goto done;
        if (p < 0 || p >= np_) {
            PyErr_Format(PyExc_ValueError, "path %ld of datagram %zd is not in 0..%zd", p, i,
                         np_ - 1);
            goto done;
        }
        which[i] = (unsigned char)p;
        counts[p]++;
    }
    groups = PyList_New(np_);
    indices = PyList_New(np_);
    offsets = PyList_New(np_);
    increasing = PyList_New(np_);
    if (groups == NULL || indices == NULL || offsets == NULL || increasing == NULL)
        goto fail;
    for (Py_ssize_t p = 0; p < np_; p++) {
        PyObject *g = Py_None, *x = Py_None, *o = Py_None;
        if (counts[p]) {
            g = PyList_New(counts[p]);
            x = PyList_New(counts[p]);
            o = PyBytes_FromStringAndSize(NULL, 4 * counts[p]);
            if (g == NULL || x == NULL || o == NULL) {
                Py_XDECREF(g);
                Py_XDECREF(x);
                Py_XDECREF(o);
                goto fail;
            }
        } else {
            Py_INCREF(g);
            Py_INCREF(x);
            Py_INCREF(o);
        }
        PyList_SET_ITEM(groups, p, g);
        PyList_SET_ITEM(indices, p, x);
        PyList_SET_ITEM(offsets, p, o);
        Py_INCREF(Py_None);
        PyList_SET_ITEM(increasing, p, Py_None);
    }
    /* second pass: each datagram into its path's lists; its offset read from
     * its header (a buffer export may run code: the list is read afresh) */
    uint32_t *last = PyMem_Calloc((size_t)np_, sizeof *last);
    unsigned char *ordered = PyMem_Malloc((size_t)np_);
    if (last == NULL || ordered == NULL) {
        PyMem_Free(last);
        PyMem_Free(ordered);
        PyErr_NoMemory();
        goto fail;
    }
    memset(ordered, 1, (size_t)np_);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *dg = item_at(dgs, i);
        if (dg == NULL)
            goto fail2;
        Py_INCREF(dg); /* ours while its buffer is read: that may run code */
        Py_buffer view;
        int have_view;
        const char *h = header_of(dg, i, &view, &have_view);
        if (h == NULL) {
            Py_DECREF(dg);
            goto fail2;
        }
        const unsigned char *u = (const unsigned char *)h + OFFSET_AT;
        uint32_t off = ((uint32_t)u[0] << 24) | ((uint32_t)u[1] << 16) | ((uint32_t)u[2] << 8) |
                       (uint32_t)u[3];
        unsigned p = which[i];
        Py_ssize_t k = fill[p];
        if (k >= counts[p]) { /* cannot happen: the counts came from `which` */
            if (have_view)
                PyBuffer_Release(&view);
            Py_DECREF(dg);
            PyErr_SetString(PyExc_RuntimeError, "by_path: a path's count overflowed");
            goto fail2;
        }
        memcpy(PyBytes_AS_STRING(PyList_GET_ITEM(offsets, p)) + 4 * k, u, 4);
        if (have_view)
            PyBuffer_Release(&view);
        if (k > 0 && off <= last[p])
            ordered[p] = 0;
        last[p] = off;
        PyObject *idx = PyLong_FromSsize_t(i);
        if (idx == NULL) {
            Py_DECREF(dg);
            goto fail2;
        }
        PyList_SET_ITEM(PyList_GET_ITEM(groups, p), k, dg);
        PyList_SET_ITEM(PyList_GET_ITEM(indices, p), k, idx);
        fill[p] = k + 1;
    }
    for (Py_ssize_t p = 0; p < np_; p++) {
        if (counts[p]) {
            PyObject *b = ordered[p] ? Py_True : Py_False;
            Py_INCREF(b);
            PyObject *old = PyList_GET_ITEM(increasing, p);
            PyList_SET_ITEM(increasing, p, b);
            Py_DECREF(old);
        }
    }
    PyMem_Free(last);
    PyMem_Free(ordered);
    out = PyTuple_Pack(4, groups, indices, offsets, increasing);
    goto fail;
fail2:
    PyMem_Free(last);
    PyMem_Free(ordered);
    /* lists not wholly filled hold NULLs, which their freeing skips */
fail:
    Py_XDECREF(groups);
    Py_XDECREF(indices);
    Py_XDECREF(offsets);
    Py_XDECREF(increasing);
done:
    PyMem_Free(counts);
    PyMem_Free(fill);
    PyMem_Free(which);
    Py_DECREF(dgs);
    Py_XDECREF(pth);
    return out;
}

static PyMethodDef methods[] = {
    {"by_path", (PyCFunction)(void (*)(void))by_path, METH_FASTCALL, by_path_doc},
    {"by_class", (PyCFunction)(void (*)(void))by_class, METH_FASTCALL, by_class_doc},
    {"clamped_classes", (PyCFunction)(void (*)(void))clamped_classes, METH_FASTCALL,
     clamped_classes_doc},
    {"identities", identities, METH_O, identities_doc},
    {"identities_heads", identities_heads, METH_O, identities_heads_doc},
    {"shard_keys", shard_keys, METH_O, shard_keys_doc},
    {"unqueue", (PyCFunction)(void (*)(void))unqueue, METH_FASTCALL, unqueue_doc},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL, take_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dlcp.daemon._keys",
    "The outbox's packet identities in C (see dlcp/daemon/packet_keys.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__keys(void)
{
    if (PyType_Ready(&FifoType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&FifoType);
    if (PyModule_AddObject(m, "Fifo", (PyObject *)&FifoType) < 0) {
        Py_DECREF(&FifoType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
