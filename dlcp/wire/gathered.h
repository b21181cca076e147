/* A datagram in two parts (dlcp.wire._ghash.Gathered): its 64-byte header,
 * held in the object itself, and its payload, `len` bytes at `payload` in
 * memory that `owner` keeps alive without copying: a Holding (one export of
 * the caller's buffer, shared by all the datagrams of one encode_gather
 * call), or once detached a bytes object of the datagram's own. One
 * allocation a datagram and no buffer export of its own: a datagram used to
 * be two objects (itself and a bytes header) and an export apiece.
 *
 * dlcp/wire/_ghash.c defines the type (its encode_gather makes them);
 * dlcp/daemon/_udp.c sends one as two iovecs, dlcp/daemon/_keys.c reads its
 * header. They find the type object by importing dlcp.wire._ghash and share
 * this layout.
 */
#ifndef DLCP_GATHERED_H
#define DLCP_GATHERED_H

#include <Python.h>

#include "imported_type.h"

typedef struct GatheredObject GatheredObject;

#define GATHERED_HEADER 64

struct GatheredObject {
    PyObject_HEAD
    PyObject *owner;     /* keeps the payload's memory: a Holding or a bytes object */
    const char *payload; /* the payload: len bytes, inside owner's memory */
    Py_ssize_t len;
    /* Until the datagram is sealed, its tag (header bytes 48..64) is not yet
     * computed: `mac` is the key that will (a reference) and `seal_many` writes it,
     * just before the payload is first read as a whole (sent, joined, copied),
     * so that the kernel's copy of a payload read from memory by the MAC finds
     * it in cache. Sealed: mac is NULL. The other header bytes are set from
     * the start. */
    PyObject *mac;
    /* seal gs[0 .. k - 1] (1 <= k <= GATHERED_SEAL_BATCH), all unsealed and
     * of one key, together (their tags' AES blocks made at once): 0, or -1
     * with an exception set */
    int (*seal_many)(GatheredObject **gs, int k);
    unsigned char head[GATHERED_HEADER]; /* the header, its tag once sealed */
};

#define GATHERED_SEAL_BATCH 8

/* Ask for the first kilobyte of the `len` bytes at `p`, to be hashed next,
 * unless they follow at `end` (where the bytes hashed now end): payloads
 * sealed to be sent in class order lie anywhere in their bucket, where the
 * hardware's prefetch, which follows a stream, does not look, and the hash's
 * own (mul_run) starts a kilobyte in. */
static inline void
gathered_prefetch(const char *end, const char *p, Py_ssize_t len)
{
    if (p == end)
        return;
    for (Py_ssize_t b = 0; b < len && b < 1024; b += 64)
        __builtin_prefetch(p + b, 0, 3);
}

static inline const char *
gathered_payload(const GatheredObject *g)
{
    return g->payload;
}

/* Compute the tag if it is not yet: 0, or -1 with an exception set. */
static inline int
gathered_sealed(GatheredObject *g)
{
    return g->mac == NULL ? 0 : g->seal_many(&g, 1);
}

/* The Gathered type of dlcp.wire._ghash, or NULL (not built: then no datagram
 * is one), looked up at the first call. Sets no exception. */
static PyTypeObject *gathered_type_cache;
static int gathered_type_looked;

static inline PyTypeObject *
gathered_type(void)
{
    if (!gathered_type_looked) {
        gathered_type_looked = 1;
        gathered_type_cache =
            imported_type("dlcp.wire._ghash", "Gathered", (Py_ssize_t)sizeof(GatheredObject));
    }
    return gathered_type_cache;
}

static inline int
is_gathered(PyObject *obj)
{
    PyTypeObject *t = Py_TYPE(obj);
    if (t == &PyBytes_Type)
        return 0;
    PyTypeObject *g = gathered_type();
    return g != NULL && t == g;
}

/* Seal the unsealed Gathered datagram at list[j] together with those that
 * follow it (up to GATHERED_SEAL_BATCH in all) while they are unsealed
 * Gathered datagrams of its key: what a sender is about to send. 0, or -1
 * with an exception set. */
static inline int
gathered_seal_ahead(PyObject *list, Py_ssize_t j)
{
    GatheredObject *g = (GatheredObject *)PyList_GET_ITEM(list, j);
    if (g->mac == NULL)
        return 0;
    GatheredObject *gs[GATHERED_SEAL_BATCH];
    int k = 0;
    gs[k++] = g;
    for (Py_ssize_t i = j + 1; k < GATHERED_SEAL_BATCH && i < PyList_GET_SIZE(list); i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        if (Py_TYPE(o) != Py_TYPE(g) || ((GatheredObject *)o)->mac != g->mac)
            break;
        gs[k++] = (GatheredObject *)o;
    }
    /* the first payload of the group after this one, asked for while these
     * are hashed (seal_many asks for each next one within a group) */
    if (j + k < PyList_GET_SIZE(list)) {
        PyObject *o = PyList_GET_ITEM(list, j + k);
        const GatheredObject *last = gs[k - 1];
        if (Py_TYPE(o) == Py_TYPE(g) && ((GatheredObject *)o)->mac != NULL) {
            const GatheredObject *next = (const GatheredObject *)o;
            gathered_prefetch(last->payload + last->len, next->payload, next->len);
        }
    }
    return g->seal_many(gs, k);
}

#endif
