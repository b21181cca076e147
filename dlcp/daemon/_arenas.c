/* Keep CPython's freed object arenas for reuse (dlcp.daemon._arenas).
 *
 * CPython's small-object allocator (pymalloc) takes memory from the kernel an
 * arena (1 MiB) at a time with mmap and gives an arena back with munmap as
 * soon as every object in it is freed. A daemon round makes and drops
 * hundreds of thousands of small objects (datagrams, views, lists): arenas
 * come and go every round, and each new one faults its pages in, zeroed by
 * the kernel, again (at MTU 1500 about 4,000 page faults a round a daemon,
 * where glibc's malloc, tuned in dlcp/daemon/memory.py, faults none).
 *
 * `keep(n)` wraps the arena allocator: up to n freed arenas are kept mapped
 * and handed out again before a new one is mapped; past n they go back to the
 * kernel as before. Arenas made before the call are freed through the same
 * wrapper, which is safe because a kept arena is only ever handed out again
 * for an arena of its own size, and one that is let go is given to the
 * allocator that was there before (the one that made it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    void *ptr;
    size_t size;
} Arena;

static PyObjectArenaAllocator previous;
static int installed;
static Arena *kept;
static Py_ssize_t n_kept, limit;
static unsigned long long reused, returned;

static void *
arena_alloc(void *ctx, size_t size)
{
    (void)ctx;
    for (Py_ssize_t i = n_kept - 1; i >= 0; i--) {
        if (kept[i].size == size) {
            void *p = kept[i].ptr;
            kept[i] = kept[--n_kept];
            reused++;
            return p;
        }
    }
    return previous.alloc(previous.ctx, size);
}

static void
arena_free(void *ctx, void *ptr, size_t size)
{
    (void)ctx;
    if (n_kept < limit) {
        kept[n_kept].ptr = ptr;
        kept[n_kept].size = size;
        n_kept++;
        return;
    }
    returned++;
    previous.free(previous.ctx, ptr, size);
}

static PyObject *
keep(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_ssize_t n = PyNumber_AsSsize_t(arg, PyExc_OverflowError);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n < 0 || n > 1 << 20) {
        PyErr_Format(PyExc_ValueError, "keep() takes 0..%d arenas, not %zd", 1 << 20, n);
        return NULL;
    }
    /* the arenas kept past the new limit go back now */
    while (n_kept > n) {
        n_kept--;
        returned++;
        previous.free(previous.ctx, kept[n_kept].ptr, kept[n_kept].size);
    }
    Arena *grown = PyMem_RawRealloc(kept, (size_t)(n > 0 ? n : 1) * sizeof(Arena));
    if (grown == NULL)
        return PyErr_NoMemory();
    kept = grown;
    limit = n;
    if (!installed) {
        PyObject_GetArenaAllocator(&previous);
        PyObjectArenaAllocator mine = {NULL, arena_alloc, arena_free};
        PyObject_SetArenaAllocator(&mine);
        installed = 1;
    }
    Py_RETURN_NONE;
}

static PyObject *
stats(PyObject *self, PyObject *unused)
{
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:n,s:n,s:K,s:K}", "kept", n_kept, "limit", limit, "reused", reused,
                         "returned", returned);
}

PyDoc_STRVAR(keep_doc, "keep(n) -> None\n\n"
                       "Keep up to n freed object arenas mapped for reuse (0: none; the\n"
                       "ones kept past n are given back now).");
PyDoc_STRVAR(stats_doc, "stats() -> dict\n\n"
                        "kept: arenas kept now; limit: n; reused: arenas handed out again;\n"
                        "returned: arenas given back to the kernel past the limit.");

static PyMethodDef methods[] = {
    {"keep", keep, METH_O, keep_doc},
    {"stats", stats, METH_NOARGS, stats_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dlcp.daemon._arenas",
    "Keep CPython's freed object arenas for reuse (see dlcp/daemon/memory.py).", -1, methods,
};

PyMODINIT_FUNC
PyInit__arenas(void)
{
    return PyModule_Create(&module);
}
