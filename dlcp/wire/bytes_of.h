/* The bytes of a datagram without a buffer export where that is safe.
 *
 * The receive path hands the C loops its datagrams (a Datagrams, read from
 * its arrays: datagrams.h; a list of memoryviews where that is not built,
 * of Segments or bytes in tests and the engine's other callers) and reads
 * each three times: headers, MAC, lanes. A PyObject_GetBuffer and
 * PyBuffer_Release pair per datagram and pass was a few percent of a daemon
 * at 1500 bytes a packet. Within one C
 * call that runs no Python code, a bytes object's bytes, and those of a
 * memoryview that is not released and is C-contiguous, stay where they are
 * while the caller holds a reference (the list does): they are read in
 * place, and so are those of a Segment (segment.h), which holds its bytes
 * object. Anything else goes through the buffer protocol as before.
 */
#ifndef DLCP_BYTES_OF_H
#define DLCP_BYTES_OF_H

#include <Python.h>

#include "segment.h"

/* 1 with *buf and *len set for a bytes object, a Segment (segment.h) or a
 * live C-contiguous memoryview; 0 for anything else (the caller takes a
 * buffer view). */
static inline int
bytes_of(PyObject *obj, const char **buf, Py_ssize_t *len)
{
    PyTypeObject *t = Py_TYPE(obj);
    if (t == &PyBytes_Type) {
        *buf = PyBytes_AS_STRING(obj);
        *len = PyBytes_GET_SIZE(obj);
        return 1;
    }
    if (t == segment_type()) {
        const SegmentObject *s = (const SegmentObject *)obj;
        *buf = s->buf;
        *len = s->len;
        return 1;
    }
    if (PyMemoryView_Check(obj)) {
        const PyMemoryViewObject *mv = (const PyMemoryViewObject *)obj;
        if ((mv->flags & _Py_MEMORYVIEW_RELEASED) || !(mv->flags & _Py_MEMORYVIEW_C))
            return 0;
        *buf = (const char *)mv->view.buf;
        *len = mv->view.len;
        return 1;
    }
    return 0;
}

/* The bytes of any buffer: in place (bytes_of) or through a buffer view,
 * released by bytes_release. */
typedef struct {
    const char *buf;
    Py_ssize_t len;
    int held; /* view is a buffer view to release */
    Py_buffer view;
} Bytes;

static inline int
bytes_get(PyObject *obj, Bytes *b)
{
    b->held = 0;
    if (bytes_of(obj, &b->buf, &b->len))
        return 0;
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_SIMPLE) < 0)
        return -1;
    b->held = 1;
    b->buf = (const char *)b->view.buf;
    b->len = b->view.len;
    return 0;
}

static inline void
bytes_release(Bytes *b)
{
    if (b->held)
        PyBuffer_Release(&b->view);
    b->held = 0;
}

#endif
