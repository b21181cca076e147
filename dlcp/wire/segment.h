/* A datagram inside a receive buffer (dlcp.wire._bulk.Segment): `len` bytes
 * at `buf`, within `owner`, the bytes object that one recvmsg filled (a GRO
 * super-datagram), which it holds.
 *
 * A Datagrams (datagrams.h) makes one when Python code asks for one of its
 * datagrams (the first of a run, a control packet); the C loops of the
 * receive path read a Datagrams' arrays and never need one, and read a
 * Segment's bytes in place (dlcp/wire/bytes_of.h) where they meet one. In
 * Python it is a read-only bytes-like object (the buffer protocol, `len`,
 * indexing and slicing as a memoryview's, == by content, `obj` the owner).
 * A memoryview slice cost a slice object, a view and their deallocation:
 * about 110 ns; this is one small object.
 *
 * dlcp/wire/_bulk.c defines the type; the others find it by importing
 * dlcp.wire._bulk and share this layout.
 */
#ifndef DLCP_SEGMENT_H
#define DLCP_SEGMENT_H

#include <Python.h>

#include "imported_type.h"

typedef struct {
    PyObject_HEAD
    PyObject *owner;  /* a bytes object: never resized or freed while held */
    const char *buf;  /* within owner */
    Py_ssize_t len;
} SegmentObject;

/* The Segment type of dlcp.wire._bulk, or NULL (not built: then no datagram
 * is one), looked up at the first call. Sets no exception. */
static PyTypeObject *segment_type_cache;
static int segment_type_looked;

static inline PyTypeObject *
segment_type(void)
{
    if (!segment_type_looked) {
        segment_type_looked = 1;
        segment_type_cache =
            imported_type("dlcp.wire._bulk", "Segment", (Py_ssize_t)sizeof(SegmentObject));
    }
    return segment_type_cache;
}

/* A new segment of owner (a bytes object): len bytes at buf; NULL with an
 * exception set. `type` is segment_type(). */
static inline PyObject *
segment_new(PyTypeObject *type, PyObject *owner, const char *buf, Py_ssize_t len)
{
    SegmentObject *s = PyObject_New(SegmentObject, type);
    if (s == NULL)
        return NULL;
    Py_INCREF(owner);
    s->owner = owner;
    s->buf = buf;
    s->len = len;
    return (PyObject *)s;
}

#endif
