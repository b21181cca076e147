/* The outbox's packet identities in C (dlcp.daemon._keys).
 *
 * A packet's identity is its type byte (header byte 3) followed by header
 * bytes 8..35 (job to element count): 29 bytes that name the packet whatever
 * its flags, class or MAC (see dlcp/daemon/outbox.py, `_identity`). Its head
 * is the identity's first 15 bytes: the leg and (job, round, bucket, shard).
 * Python builds each with two slices and a concatenation; here each is one
 * allocation and a copy. The Python definitions in outbox.py stay the
 * reference: tests/test_outbox_keys.py checks these against them.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#define TYPE_AT 3
#define FIELDS_AT 8
#define FIELDS_END 36
#define ID_LEN (1 + FIELDS_END - FIELDS_AT) /* 29 */
#define HEAD_LEN 15

/* The identity of one datagram (bytes, or any contiguous buffer) as new bytes. */
static PyObject *
identity_of(PyObject *dg, Py_ssize_t index)
{
    const char *p;
    Py_ssize_t len;
    Py_buffer view;
    int have_view = 0;
    if (PyBytes_Check(dg)) {
        p = PyBytes_AS_STRING(dg);
        len = PyBytes_GET_SIZE(dg);
    } else {
        if (PyObject_GetBuffer(dg, &view, PyBUF_C_CONTIGUOUS) < 0)
            return NULL;
        have_view = 1;
        p = (const char *)view.buf;
        len = view.len;
    }
    PyObject *id = NULL;
    if (len < FIELDS_END) {
        PyErr_Format(PyExc_ValueError,
                     "datagram %zd is %zd bytes: shorter than the %d header bytes an identity "
                     "takes",
                     index, len, FIELDS_END);
    } else {
        id = PyBytes_FromStringAndSize(NULL, ID_LEN);
        if (id != NULL) {
            char *q = PyBytes_AS_STRING(id);
            q[0] = p[TYPE_AT];
            memcpy(q + 1, p + FIELDS_AT, FIELDS_END - FIELDS_AT);
        }
    }
    if (have_view)
        PyBuffer_Release(&view);
    return id;
}

/* ids (and heads, when heads_too) of a sequence of datagrams. */
static PyObject *
build(PyObject *arg, int heads_too)
{
    PyObject *seq = PySequence_Fast(arg, "expected a sequence of datagrams");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *ids = PyList_New(n);
    PyObject *heads = heads_too ? PyList_New(n) : NULL;
    if (ids == NULL || (heads_too && heads == NULL))
        goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *id = identity_of(items[i], i);
        if (id == NULL)
            goto fail;
        PyList_SET_ITEM(ids, i, id);
        if (heads_too) {
            PyObject *head = PyBytes_FromStringAndSize(PyBytes_AS_STRING(id), HEAD_LEN);
            if (head == NULL)
                goto fail;
            PyList_SET_ITEM(heads, i, head);
        }
    }
    Py_DECREF(seq);
    if (!heads_too)
        return ids;
    PyObject *pair = PyTuple_Pack(2, ids, heads);
    Py_DECREF(ids);
    Py_DECREF(heads);
    return pair;
fail:
    Py_DECREF(seq);
    Py_XDECREF(ids);
    Py_XDECREF(heads);
    return NULL;
}

static PyObject *
identities(PyObject *self, PyObject *arg)
{
    (void)self;
    return build(arg, 0);
}

static PyObject *
identities_heads(PyObject *self, PyObject *arg)
{
    (void)self;
    return build(arg, 1);
}

PyDoc_STRVAR(identities_doc,
             "identities(datagrams) -> list[bytes]\n\n"
             "Each datagram's identity: header byte 3, then bytes 8..35 (29 bytes).");
PyDoc_STRVAR(identities_heads_doc,
             "identities_heads(datagrams) -> (list[bytes], list[bytes])\n\n"
             "The identities and their first 15 bytes (leg, job, round, bucket, shard).");

static PyMethodDef methods[] = {
    {"identities", identities, METH_O, identities_doc},
    {"identities_heads", identities_heads, METH_O, identities_heads_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dlcp.daemon._keys",
    "The outbox's packet identities in C (see dlcp/daemon/outbox.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__keys(void)
{
    return PyModule_Create(&module);
}
