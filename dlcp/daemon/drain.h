/* One poll's drain as one object (recv_drain, drain_buffers in _udp.c): every
 * datagram of the buffers taken in one Datagrams, in arrival order, and per
 * datagram its source (an index into the drain's distinct sources), the job
 * its header names (-1: shorter than a header), its type byte (0: shorter
 * than a header) and its length. `NetworkIn._receive` then looks up jobs,
 * nodes and peers once per source and job of the drain (dlcp/daemon/poll.py),
 * not once per buffer or run of buffers, and hands the engine the drain in
 * one call. Included by _udp.c after its receive_buffers. */
#ifndef DLCP_DRAIN_H
#define DLCP_DRAIN_H

/* The drain of bufs[0:nb] as (buffers, bytes, datagrams, sources, source
 * index int32 each, job int64 each, type bytes, length int64 each, `more`,
 * pair int32 each, pairs): a datagram's pair is the index of its (source,
 * job) among the drain's, numbered as they first appear, and `pairs` holds
 * five int64 a pair: source index, job, first datagram, datagrams, bytes. A
 * new tuple, or NULL with an exception set. The buffers are left to the
 * caller. */
static PyObject *
drain_of(const rxbuf_t *bufs, int nb, int more)
{
    PyTypeObject *dt = datagrams_type();
    if (dt == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dlcp.wire._bulk (Datagrams) is not built");
        return NULL;
    }
    Py_ssize_t total = 0, size = 0;
    for (int i = 0; i < nb; i++) {
        Py_ssize_t seg = bufs[i].seg;
        total += segments_of(bufs[i].size, &seg);
        size += bufs[i].size;
    }
    PyObject *owners = PyList_New(nb), *srcs = PyList_New(0), *out = NULL;
    PyObject *src_b = PyBytes_FromStringAndSize(NULL, total * 4);
    PyObject *job_b = PyBytes_FromStringAndSize(NULL, total * 8);
    PyObject *kind_b = PyBytes_FromStringAndSize(NULL, total);
    PyObject *len_b = PyBytes_FromStringAndSize(NULL, total * 8);
    PyObject *pair_b = PyBytes_FromStringAndSize(NULL, total * 4), *pairs_b = NULL;
    struct in_addr *seen = PyMem_Malloc(((size_t)nb + 1) * sizeof(struct in_addr));
    int64_t *pairs = PyMem_Malloc(((size_t)total + 1) * 5 * sizeof(int64_t));
    size_t mask = 15; /* the table's size less one: a power of two, over twice the datagrams */
    while (mask + 1 < 2 * (size_t)total + 2)
        mask = 2 * mask + 1;
    Py_ssize_t *table = PyMem_Malloc((mask + 1) * sizeof(Py_ssize_t));
    size_t smask = 15; /* the same for the sources, over twice the buffers */
    while (smask + 1 < 2 * (size_t)nb + 2)
        smask = 2 * smask + 1;
    int *stable = PyMem_Malloc((smask + 1) * sizeof(int));
    DatagramsObject *d = NULL;
    if (owners == NULL || srcs == NULL || src_b == NULL || job_b == NULL || kind_b == NULL ||
        len_b == NULL || pair_b == NULL || seen == NULL || pairs == NULL || table == NULL ||
        stable == NULL)
        goto fail;
    for (size_t q = 0; q <= mask; q++)
        table[q] = -1;
    for (size_t q = 0; q <= smask; q++)
        stable[q] = -1;
    for (int i = 0; i < nb; i++) {
        Py_INCREF(bufs[i].data);
        PyList_SET_ITEM(owners, i, bufs[i].data);
    }
    d = datagrams_new(dt, total, owners);
    if (d == NULL)
        goto fail;
    int32_t *srci = (int32_t *)PyBytes_AS_STRING(src_b);
    int64_t *job = (int64_t *)PyBytes_AS_STRING(job_b);
    int64_t *len = (int64_t *)PyBytes_AS_STRING(len_b);
    char *kind = PyBytes_AS_STRING(kind_b);
    int32_t *pair = (int32_t *)PyBytes_AS_STRING(pair_b);
    Py_ssize_t npairs = 0, hit = -1;
    int nseen = 0, last = -1;
    Py_ssize_t at = 0;
    for (int i = 0; i < nb; i++) {
        /* the source's index: the last one's again, or found in the table
         * of the drain's, or a new one */
        if (last < 0 || seen[last].s_addr != bufs[i].src.s_addr) {
            uint32_t a = bufs[i].src.s_addr;
            size_t slot = (size_t)(((uint64_t)a * 0x9E3779B97F4A7C15ull) >> 40) & smask;
            last = -1;
            while (stable[slot] >= 0) {
                if (seen[stable[slot]].s_addr == a) {
                    last = stable[slot];
                    break;
                }
                slot = (slot + 1) & smask;
            }
            if (last < 0) {
                stable[slot] = nseen;
                char text[INET_ADDRSTRLEN];
                if (inet_ntop(AF_INET, &bufs[i].src, text, sizeof text) == NULL) {
                    PyErr_SetFromErrno(PyExc_OSError);
                    goto fail;
                }
                PyObject *s = PyUnicode_FromString(text);
                if (s == NULL || PyList_Append(srcs, s) < 0) {
                    Py_XDECREF(s);
                    goto fail;
                }
                Py_DECREF(s);
                seen[nseen] = bufs[i].src;
                last = nseen++;
            }
        }
        const unsigned char *p =
            (const unsigned char *)PyBytes_AS_STRING(bufs[i].data) + bufs[i].skip;
        Py_ssize_t seg = bufs[i].seg;
        Py_ssize_t k = segments_of(bufs[i].size, &seg);
        fill_segments(d, at, i, p, bufs[i].size, seg, k);
        for (Py_ssize_t j = 0; j < k; j++) {
            Py_ssize_t n = d->len[at + j];
            const unsigned char *h = p + j * seg;
            srci[at + j] = last;
            len[at + j] = n;
            job[at + j] = n >= HEADER_SIZE ? (int64_t)job_at(h) : -1;
            kind[at + j] = n >= HEADER_SIZE ? (char)h[3] : 0;
            /* its (source, job): the last one's again, or among the drain's, or new */
            if (hit < 0 || pairs[5 * hit] != last || pairs[5 * hit + 1] != job[at + j]) {
                /* an open-addressed table of the pairs: a drain of many
                 * jobs (forged ones) costs no more than one of a few */
                uint64_t hsh = ((uint64_t)job[at + j] * 0x9E3779B97F4A7C15ull) ^ (uint64_t)last;
                size_t slot = (size_t)(hsh ^ (hsh >> 29)) & mask;
                hit = -1;
                while (table[slot] >= 0) {
                    int64_t *e = &pairs[5 * table[slot]];
                    if (e[0] == last && e[1] == job[at + j]) {
                        hit = table[slot];
                        break;
                    }
                    slot = (slot + 1) & mask;
                }
                if (hit < 0) {
                    table[slot] = npairs;
                    hit = npairs++;
                    int64_t *e = &pairs[5 * hit];
                    e[0] = last;
                    e[1] = job[at + j];
                    e[2] = at + j;
                    e[3] = e[4] = 0;
                }
            }
            pair[at + j] = (int32_t)hit;
            pairs[5 * hit + 3] += 1;
            pairs[5 * hit + 4] += n;
        }
        at += k;
    }
    pairs_b = PyBytes_FromStringAndSize((const char *)pairs,
                                        npairs * 5 * (Py_ssize_t)sizeof(int64_t));
    if (pairs_b == NULL)
        goto fail;
    out = Py_BuildValue("(inOOOOOOiOO)", nb, size, (PyObject *)d, srcs, src_b, job_b, kind_b,
                        len_b, more, pair_b, pairs_b);
fail:
    if (out == NULL && !PyErr_Occurred())
        PyErr_NoMemory();
    Py_XDECREF(d);
    Py_XDECREF(owners);
    Py_XDECREF(srcs);
    Py_XDECREF(src_b);
    Py_XDECREF(job_b);
    Py_XDECREF(kind_b);
    Py_XDECREF(len_b);
    Py_XDECREF(pair_b);
    Py_XDECREF(pairs_b);
    PyMem_Free(seen);
    PyMem_Free(pairs);
    PyMem_Free(table);
    PyMem_Free(stable);
    return out;
}

/* recv_drain(fd, chunk, max_bytes): `chunk` buffers at a time (recvmmsg)
 * while each call took all it asked for and, with max_bytes > 0, the drain
 * is under max_bytes; `more` says it stopped at a full chunk (max_bytes 0)
 * or at max_bytes, so that more may wait. `NetworkIn._splits`' budgets. */
static PyObject *
recv_drain(PyObject *self, PyObject *args)
{
    (void)self;
    int fd, chunk;
    Py_ssize_t max_bytes;
    if (!PyArg_ParseTuple(args, "iin", &fd, &chunk, &max_bytes))
        return NULL;
    if (chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "chunk must be positive");
        return NULL;
    }
    int cap = chunk, nb = 0, more = 0;
    Py_ssize_t taken = 0;
    rxbuf_t *bufs = PyMem_Malloc(((size_t)cap + 1) * sizeof(rxbuf_t));
    if (bufs == NULL)
        return PyErr_NoMemory();
    PyObject *out = NULL;
    for (;;) {
        if (nb + chunk > cap) {
            cap = 2 * cap > nb + chunk ? 2 * cap : nb + chunk;
            rxbuf_t *grown = PyMem_Realloc(bufs, ((size_t)cap + 1) * sizeof(rxbuf_t));
            if (grown == NULL) {
                PyErr_NoMemory();
                goto done;
            }
            bufs = grown;
        }
        int got = receive_buffers(fd, chunk, bufs + nb);
        if (got < 0)
            goto done;
        for (int i = nb; i < nb + got; i++)
            taken += bufs[i].size;
        nb += got;
        if (got < chunk)
            break;
        if (max_bytes <= 0 || taken >= max_bytes) {
            more = 1;
            break;
        }
    }
    out = drain_of(bufs, nb, more);
done:
    for (int i = 0; i < nb; i++)
        Py_DECREF(bufs[i].data);
    PyMem_Free(bufs);
    return out;
}

/* drain_buffers(buffers): drain_of of a list of (bytes, segment size, source
 * IPv4 text), as recvmmsg would have given them (`more` 0): the tests' way
 * to the same drain without a socket. */
static PyObject *
drain_buffers(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &list))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (n > INT_MAX / 2) {
        PyErr_SetString(PyExc_ValueError, "too many buffers");
        return NULL;
    }
    rxbuf_t *bufs = PyMem_Malloc(((size_t)n + 1) * sizeof(rxbuf_t));
    if (bufs == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *data;
        Py_ssize_t seg;
        const char *src;
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyArg_ParseTuple(item, "O!ns", &PyBytes_Type, &data, &seg, &src) ||
            inet_pton(AF_INET, src, &bufs[i].src) != 1) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "a source is not an IPv4 address");
            PyMem_Free(bufs);
            return NULL;
        }
        bufs[i].data = data;
        bufs[i].skip = 0;
        bufs[i].size = PyBytes_GET_SIZE(data);
        bufs[i].seg = seg < 0 ? 0 : seg;
    }
    PyObject *out = drain_of(bufs, (int)n, 0);
    PyMem_Free(bufs);
    return out;
}

#endif
