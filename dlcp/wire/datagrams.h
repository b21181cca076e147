/* Many datagrams inside receive buffers as one object
 * (dlcp.wire._bulk.Datagrams), and the C loops' way of reading either that or
 * a list of bytes-like objects.
 *
 * A receive drain is thousands of datagrams in a few dozen GRO buffers. A
 * Segment object apiece (segment.h), made by the split and freed after the
 * drain, and the lists that held them cost about as much as the MAC check
 * of a 1500-byte datagram. A Datagrams holds where each datagram lies (its
 * bytes' address and length, and which of its `owners` holds them) in three
 * arrays; dlcp/daemon/_udp.c makes one per buffer, `_bulk.join` one per
 * drain, and the C loops (headers, MAC, lanes) read its arrays (Items). In
 * Python it is a sequence: an item is a Segment made when asked for, a slice
 * (step 1) another Datagrams sharing the arrays.
 *
 * dlcp/wire/_bulk.c defines the type; the others find it by importing
 * dlcp.wire._bulk and share this layout.
 */
#ifndef DLCP_DATAGRAMS_H
#define DLCP_DATAGRAMS_H

#include <Python.h>

#include "bytes_of.h"
#include "imported_type.h"

typedef struct {
    PyObject_HEAD
    PyObject *owners;  /* a list of the objects the bytes lie in (bytes objects) */
    PyObject *base;    /* a slice: the Datagrams whose arrays these point into; else NULL */
    const char **buf;  /* datagram i: len[i] bytes at buf[i], within owners[owner[i]] */
    Py_ssize_t *len;
    Py_ssize_t *owner;
    Py_ssize_t n;
} DatagramsObject;

/* The Datagrams type of dlcp.wire._bulk, or NULL (not built), looked up at
 * the first call. Sets no exception. */
static PyTypeObject *datagrams_type_cache;
static int datagrams_type_looked;

static inline PyTypeObject *
datagrams_type(void)
{
    if (!datagrams_type_looked) {
        datagrams_type_looked = 1;
        datagrams_type_cache =
            imported_type("dlcp.wire._bulk", "Datagrams", (Py_ssize_t)sizeof(DatagramsObject));
    }
    return datagrams_type_cache;
}

/* A new Datagrams of `n` datagrams with arrays of its own, for the caller to
 * fill, whose bytes lie in `owners` (a list: a new reference is taken); NULL
 * with an exception set. `type` is datagrams_type(). */
static inline DatagramsObject *
datagrams_new(PyTypeObject *type, Py_ssize_t n, PyObject *owners)
{
    DatagramsObject *d = PyObject_New(DatagramsObject, type);
    if (d == NULL)
        return NULL;
    d->owners = NULL;
    d->base = NULL;
    d->buf = NULL;
    d->n = 0;
    size_t m = n > 0 ? (size_t)n : 1;
    void *block = PyMem_Malloc(m * (sizeof(char *) + 2 * sizeof(Py_ssize_t)));
    if (block == NULL) {
        Py_DECREF(d);
        PyErr_NoMemory();
        return NULL;
    }
    d->buf = (const char **)block;
    d->len = (Py_ssize_t *)(d->buf + m);
    d->owner = d->len + m;
    d->n = n;
    Py_INCREF(owners);
    d->owners = owners;
    return d;
}

/* The datagrams a C loop reads: a Datagrams' arrays, or the items of a list
 * or tuple (bytes_get each). */
typedef struct {
    PyObject *seq;              /* PySequence_Fast's list or tuple; NULL for a Datagrams */
    const DatagramsObject *dg;  /* the Datagrams (the caller's argument holds it) */
    Py_ssize_t n;
} Items;

/* 0 with `it` open on `obj`; -1 with an exception (TypeError: `message`). */
static inline int
items_open(Items *it, PyObject *obj, const char *message)
{
    PyTypeObject *t = datagrams_type();
    if (t != NULL && Py_TYPE(obj) == t) {
        it->seq = NULL;
        it->dg = (const DatagramsObject *)obj;
        it->n = it->dg->n;
        return 0;
    }
    it->dg = NULL;
    it->seq = PySequence_Fast(obj, message);
    if (it->seq == NULL)
        return -1;
    it->n = PySequence_Fast_GET_SIZE(it->seq);
    return 0;
}

/* Datagram i's bytes into b (bytes_release after); 0, or -1 with an exception. */
static inline int
items_get(const Items *it, Py_ssize_t i, Bytes *b)
{
    if (it->dg != NULL) {
        b->held = 0;
        b->buf = it->dg->buf[i];
        b->len = it->dg->len[i];
        return 0;
    }
    return bytes_get(PySequence_Fast_GET_ITEM(it->seq, i), b);
}

static inline void
items_close(Items *it)
{
    Py_CLEAR(it->seq);
}

#endif
