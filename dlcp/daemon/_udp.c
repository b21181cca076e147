/* Many UDP GSO sends in one call, and GRO receives split (dlcp.daemon._udp).
 *
 * `UdpPath.send` hands the kernel one GSO super-datagram per sendmsg: up to
 * 64 KB, so 7 datagrams at MTU 9000 and 45 at 1500. The outbox now hands it
 * a flush's batch at once (up to 4 MB), and a Python loop of one sendmsg
 * per super-datagram cost as much per call as the kernel's own work. Here the
 * same grouping is done in C and the super-datagrams go out in batches of
 * sendmmsg(2), the GIL released; the Python loop in transport.py stays the
 * reference and the fallback (and handles every error but a full socket).
 *
 * recv_gro(fd, budget) takes a readable event's GRO buffers (recvmmsg, up to
 * RECV_BATCH a call) and splits each (split_gro: its datagrams, job ids, type
 * bytes); transport.split_gro is its Python definition. recv_runs(fd,
 * budget), what `Daemon._receive` calls, also joins each run of consecutive
 * buffers from one source whose datagrams are all one job's and one size
 * into one split (transport.merge_splits, its Python definition): a drain of
 * a peer's bulk is then a few splits, not one per buffer, for the Python
 * loop that looks up each split's job, node and peer.
 *
 * send_gso(fd, datagrams, start, addr4, port, tos, gso, gso_max_size)
 *   datagrams: a list of bytes-like objects or Gathered datagrams
 *   (dlcp/wire/gathered.h: header bytes and a payload in place, sent as two
 *   iovecs: the kernel's copy is the payload's only one); sends datagrams[start:] to the
 *   IPv4 address addr4 (4 bytes, network order) and port. Consecutive
 *   datagrams of one size (and a shorter last one) make one super-datagram of
 *   at most MAX_SEGMENTS segments and MAX_BYTES bytes when gso is true and the
 *   size is at most gso_max_size; any other datagram goes alone. Every
 *   message carries IP_TOS = tos. Returns (datagrams sent, messages sent,
 *   errno of the send that stopped it or 0 when all went).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <string.h>
#include <sys/socket.h>

#include "../wire/gathered.h"
#include "../wire/datagrams.h"

#ifndef SOL_UDP
#define SOL_UDP 17
#endif
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

#define MAX_SEGMENTS 64   /* transport.MAX_GSO_SEGMENTS */
#define MAX_BYTES 65000   /* transport.MAX_GSO_BYTES */
#define MSGS 32           /* super-datagrams per sendmmsg */
#define IOVS (2 * MSGS * MAX_SEGMENTS) /* a Gathered datagram takes two */
#define CTRL (CMSG_SPACE(sizeof(int)) + CMSG_SPACE(sizeof(uint16_t)))

typedef struct {
    struct mmsghdr msgs[MSGS];
    struct iovec iov[IOVS];
    /* what keeps the iovecs' memory: a reference to each Gathered datagram
     * (its header and its payload's owner), a buffer view of each other one */
    PyObject *held[IOVS / 2];
    Py_buffer views[IOVS];
    union {
        char buf[CTRL];
        struct cmsghdr align;
    } ctrl[MSGS];
    int segs[MSGS];
} batch_t;

/* How far a batch has got: iovecs, held datagrams and views. */
typedef struct {
    int iov, held, views;
} mark_t;

/* Let go of what was taken from `from` on. */
static void
release(batch_t *b, mark_t from, mark_t to)
{
    for (int i = from.held; i < to.held; i++)
        Py_DECREF(b->held[i]);
    for (int i = from.views; i < to.views; i++)
        PyBuffer_Release(&b->views[i]);
}

/* Datagram list[j]'s iovecs from b->iov[m->iov] on: one for a bytes-like
 * object (a view of it kept), two (header, payload in place) for a Gathered
 * one (a reference to it kept: no view apiece, whose making and releasing
 * cost more than a reference). Returns its size, or -1 with an exception
 * set. */
static Py_ssize_t
take(batch_t *b, PyObject *list, Py_ssize_t j, mark_t *m)
{
    PyObject *obj = PyList_GET_ITEM(list, j);
    struct iovec *v = &b->iov[m->iov];
    if (is_gathered(obj)) {
        GatheredObject *g = (GatheredObject *)obj;
        /* its tag now, if not yet, with those of the few Gathered datagrams
         * after it: the MAC reads the payloads just before the kernel copies
         * them, which then finds them in cache */
        if (gathered_seal_ahead(list, j) < 0)
            return -1;
        Py_INCREF(obj); /* holds its header and the payload's owner */
        b->held[m->held++] = obj;
        v[0].iov_base = g->head;
        v[0].iov_len = GATHERED_HEADER;
        v[1].iov_base = (void *)gathered_payload(g);
        v[1].iov_len = (size_t)g->len;
        m->iov += 2;
        return GATHERED_HEADER + g->len;
    }
    Py_buffer *view = &b->views[m->views];
    if (PyObject_GetBuffer(obj, view, PyBUF_SIMPLE) < 0)
        return -1;
    m->views++;
    v[0].iov_base = view->buf;
    v[0].iov_len = (size_t)view->len;
    m->iov += 1;
    return view->len;
}

static PyObject *
send_gso(PyObject *self, PyObject *args)
{
    (void)self;
    int fd, tos, gso, port;
    PyObject *list;
    Py_ssize_t start, gso_max;
    Py_buffer addr;
    if (!PyArg_ParseTuple(args, "iO!ny*iipn", &fd, &PyList_Type, &list, &start, &addr, &port,
                          &tos, &gso, &gso_max))
        return NULL;
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    if (addr.len != 4 || port < 0 || port > 65535) {
        PyBuffer_Release(&addr);
        PyErr_SetString(PyExc_ValueError, "addr4 must be 4 bytes and port 0..65535");
        return NULL;
    }
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    memcpy(&sa.sin_addr, addr.buf, 4);
    PyBuffer_Release(&addr);
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (start < 0 || start > n) {
        PyErr_SetString(PyExc_IndexError, "start outside the list");
        return NULL;
    }
    batch_t *b = PyMem_Malloc(sizeof(batch_t));
    if (b == NULL)
        return PyErr_NoMemory();
    Py_ssize_t sent = 0, messages = 0;
    Py_ssize_t i = start;
    int err = 0;
    while (i < n && !err) {
        /* group what follows into up to MSGS super-datagrams */
        int m = 0;
        mark_t zero = {0, 0, 0}, at = zero;
        Py_ssize_t j = i;
        while (j < n && m < MSGS) {
            int first = at.iov;
            Py_ssize_t size = take(b, list, j, &at);
            if (size < 0) {
                release(b, zero, at);
                PyMem_Free(b);
                return NULL;
            }
            j++;
            int k = 1;
            if (gso && size <= gso_max && size > 0) {
                Py_ssize_t lim = MAX_BYTES / size;
                if (lim > MAX_SEGMENTS)
                    lim = MAX_SEGMENTS;
                if (lim < 1)
                    lim = 1;
                while (k < lim && j < n && at.iov < IOVS - 1) {
                    mark_t before = at;
                    Py_ssize_t len = take(b, list, j, &at);
                    if (len < 0) {
                        release(b, zero, at);
                        PyMem_Free(b);
                        return NULL;
                    }
                    if (len > size) { /* does not fit this super-datagram */
                        release(b, before, at);
                        at = before;
                        break;
                    }
                    j++;
                    k++;
                    if (len < size) /* a shorter last segment ends it */
                        break;
                }
            }
            struct msghdr *h = &b->msgs[m].msg_hdr;
            memset(h, 0, sizeof *h);
            h->msg_name = &sa;
            h->msg_namelen = sizeof sa;
            h->msg_iov = &b->iov[first];
            h->msg_iovlen = (size_t)(at.iov - first);
            memset(b->ctrl[m].buf, 0, CTRL);
            h->msg_control = b->ctrl[m].buf;
            h->msg_controllen = k > 1 ? CTRL : CMSG_SPACE(sizeof(int));
            struct cmsghdr *c = CMSG_FIRSTHDR(h);
            c->cmsg_level = IPPROTO_IP;
            c->cmsg_type = IP_TOS;
            c->cmsg_len = CMSG_LEN(sizeof(int));
            memcpy(CMSG_DATA(c), &tos, sizeof(int));
            if (k > 1) {
                uint16_t seg = (uint16_t)size;
                c = CMSG_NXTHDR(h, c);
                c->cmsg_level = SOL_UDP;
                c->cmsg_type = UDP_SEGMENT;
                c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
                memcpy(CMSG_DATA(c), &seg, sizeof seg);
            }
            b->segs[m] = k;
            m++;
            if (at.iov > IOVS - 2) /* no room for a datagram of two iovecs */
                break;
        }
        /* send them; a short count means the next message failed: try it again */
        int done = 0;
        while (done < m) {
            int r;
            Py_BEGIN_ALLOW_THREADS
            r = sendmmsg(fd, &b->msgs[done], (unsigned int)(m - done), 0);
            Py_END_ALLOW_THREADS
            if (r < 0) {
                if (errno == EINTR)
                    continue;
                err = errno;
                break;
            }
            for (int x = done; x < done + r; x++)
                sent += b->segs[x];
            messages += r;
            done += r;
        }
        release(b, zero, at);
        i = start + sent;
    }
    PyMem_Free(b);
    return Py_BuildValue("nni", sent, messages, err);
}

/* -- receive ------------------------------------------------------------- */

#define HEADER_SIZE 64 /* dlcp.wire.header.HEADER_SIZE */
#define RECV_SIZE 65535
/* A receive buffer's first datagram starts on a cache line (and so do the
 * others where a datagram is a whole number of lines, as at MTU 1500 and
 * 9000: 1472 and 9024 bytes). A bytes object's contents start wherever malloc
 * put them, in 16-byte steps; at 16 or 48 bytes past a line the kernel's copy
 * into the buffer costs more: in one process (GRO buffers of 44 datagrams of
 * 1472 bytes on loopback), recvmsg took 8-15 ns a datagram more than at 0 or
 * 32. The skip before the first datagram is at most RECV_ALIGN - 1 bytes. */
#define RECV_ALIGN 64

/* What `_receive` needs of one GRO buffer (see transport.split_gro, the
 * Python definition): (the datagrams: a Datagrams of the buffer (datagrams.h)
 * where dlcp.wire._bulk is built, else memoryviews; bytes, datagrams with a whole
 * header, their job: one int when they all name the same one (-1 when there
 * are none), else the list of each one's, their type bytes). */
/* The job field (header bytes 8..11, big endian) of the datagram at h. */
static uint32_t
job_at(const unsigned char *h)
{
    return ((uint32_t)h[8] << 24) | ((uint32_t)h[9] << 16) | ((uint32_t)h[10] << 8) |
           (uint32_t)h[11];
}

/* How many datagrams `size` bytes with GRO segment size *seg hold (all of
 * *seg bytes but a shorter last one); *seg becomes `size` where the buffer
 * is one datagram (no segment size, or one at least as large). */
static Py_ssize_t
segments_of(Py_ssize_t size, Py_ssize_t *seg)
{
    if (*seg <= 0 || *seg >= size)
        *seg = size;
    return size == 0 ? 1 : (size + *seg - 1) / *seg;
}

/* The k datagrams of `size` bytes at p (segment size seg) into d's arrays
 * from index `at` on, as owner `owner` of d's owners. */
static void
fill_segments(DatagramsObject *d, Py_ssize_t at, Py_ssize_t owner, const unsigned char *p,
              Py_ssize_t size, Py_ssize_t seg, Py_ssize_t k)
{
    for (Py_ssize_t i = 0; i < k; i++) {
        Py_ssize_t a = i * seg, b = a + seg < size ? a + seg : size;
        d->buf[at + i] = (const char *)p + a;
        d->len[at + i] = b - a;
        d->owner[at + i] = owner;
    }
}

static PyObject *
split_buffer(PyObject *data, Py_ssize_t skip, Py_ssize_t seg)
{
    /* the datagrams: data's bytes past the first `skip` */
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(data) + skip;
    Py_ssize_t size = PyBytes_GET_SIZE(data) - skip;
    Py_ssize_t k = segments_of(size, &seg);
    /* a Datagrams (dlcp/wire/datagrams.h) where dlcp.wire._bulk is built,
     * else a list of memoryview slices: the same bytes either way */
    PyObject *segs;
    PyTypeObject *dt = datagrams_type();
    if (dt != NULL) {
        PyObject *owners = PyList_New(1);
        if (owners == NULL)
            return NULL;
        Py_INCREF(data);
        PyList_SET_ITEM(owners, 0, data);
        DatagramsObject *d = datagrams_new(dt, k, owners);
        Py_DECREF(owners);
        if (d == NULL)
            return NULL;
        fill_segments(d, 0, 0, p, size, seg, k);
        segs = (PyObject *)d;
    } else {
        PyObject *mv = PyMemoryView_FromObject(data);
        if (mv == NULL || (segs = PyList_New(k)) == NULL) {
            Py_XDECREF(mv);
            return NULL;
        }
        for (Py_ssize_t i = 0; i < k; i++) {
            Py_ssize_t a = i * seg, b = a + seg < size ? a + seg : size;
            PyObject *v = PySequence_GetSlice(mv, skip + a, skip + b);
            if (v == NULL) {
                Py_DECREF(segs);
                Py_DECREF(mv);
                return NULL;
            }
            PyList_SET_ITEM(segs, i, v);
        }
        Py_DECREF(mv);
    }
    Py_ssize_t last = size - (k - 1) * seg;
    Py_ssize_t full = seg < HEADER_SIZE ? 0 : (last >= HEADER_SIZE ? k : k - 1);
    PyObject *ids = NULL, *kinds = NULL;
    if (full == 0) {
        ids = PyLong_FromLong(-1);
        kinds = PyBytes_FromStringAndSize(NULL, 0);
    } else {
        kinds = PyBytes_FromStringAndSize(NULL, full);
        uint32_t first = 0;
        int same = 1;
        for (Py_ssize_t i = 0; i < full && kinds != NULL; i++) {
            const unsigned char *h = p + i * seg;
            uint32_t job = job_at(h);
            if (i == 0)
                first = job;
            else if (job != first)
                same = 0;
            PyBytes_AS_STRING(kinds)[i] = (char)h[3];
        }
        if (same) {
            ids = PyLong_FromUnsignedLong(first);
        } else {
            ids = PyList_New(full);
            for (Py_ssize_t i = 0; i < full && ids != NULL; i++) {
                PyObject *j = PyLong_FromUnsignedLong(job_at(p + i * seg));
                if (j == NULL) {
                    Py_CLEAR(ids);
                    break;
                }
                PyList_SET_ITEM(ids, i, j);
            }
        }
    }
    if (ids == NULL || kinds == NULL) {
        Py_XDECREF(ids);
        Py_XDECREF(kinds);
        Py_DECREF(segs);
        return NULL;
    }
    return Py_BuildValue("(NnnNN)", segs, size, full, ids, kinds);
}

static PyObject *
split_gro(PyObject *self, PyObject *args)
{
    (void)self;
    PyObject *data;
    Py_ssize_t seg;
    if (!PyArg_ParseTuple(args, "O!n", &PyBytes_Type, &data, &seg))
        return NULL;
    return split_buffer(data, 0, seg);
}

/* -- receive: recvmmsg, and runs of buffers taken as one ----------------- */

#define RECV_BATCH 16 /* buffers a recvmmsg call asks for */

/* One received buffer: `data` (a bytes object; the datagrams start `skip`
 * bytes in, `size` bytes of them), its GRO segment size as the kernel gave it
 * (0: none) and its source. */
typedef struct {
    PyObject *data;
    Py_ssize_t skip, size, seg;
    struct in_addr src;
} rxbuf_t;

/* Up to `budget` buffers from fd into bufs (recvmmsg calls of up to
 * RECV_BATCH, the GIL released; stops at an empty socket or when a call
 * returns fewer than it asked for: the next readable event goes on).
 * Returns how many, or -1 with an exception set (those taken released). */
static int
receive_buffers(int fd, int budget, rxbuf_t *bufs)
{
    int nb = 0, refused = 0;
    while (nb + refused < budget) {
        int want = budget - nb - refused < RECV_BATCH ? budget - nb - refused : RECV_BATCH;
        struct mmsghdr msgs[RECV_BATCH];
        struct iovec iov[RECV_BATCH];
        struct sockaddr_in sa[RECV_BATCH];
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } ctrl[RECV_BATCH];
        PyObject *data[RECV_BATCH];
        Py_ssize_t skip[RECV_BATCH];
        for (int i = 0; i < want; i++) {
            data[i] = PyBytes_FromStringAndSize(NULL, RECV_SIZE + RECV_ALIGN - 1);
            if (data[i] == NULL) {
                for (int j = 0; j < i; j++)
                    Py_DECREF(data[j]);
                goto fail;
            }
            char *at = PyBytes_AS_STRING(data[i]);
            skip[i] = (Py_ssize_t)((RECV_ALIGN - (uintptr_t)at % RECV_ALIGN) % RECV_ALIGN);
            iov[i].iov_base = at + skip[i];
            iov[i].iov_len = RECV_SIZE;
            struct msghdr *h = &msgs[i].msg_hdr;
            memset(h, 0, sizeof *h);
            h->msg_name = &sa[i];
            h->msg_namelen = sizeof sa[i];
            h->msg_iov = &iov[i];
            h->msg_iovlen = 1;
            h->msg_control = ctrl[i].buf;
            h->msg_controllen = sizeof ctrl[i].buf;
            msgs[i].msg_len = 0;
        }
        int r;
        Py_BEGIN_ALLOW_THREADS
        r = recvmmsg(fd, msgs, (unsigned int)want, MSG_DONTWAIT, NULL);
        Py_END_ALLOW_THREADS
        int e = errno;
        for (int i = r < 0 ? 0 : r; i < want; i++)
            Py_DECREF(data[i]);
        if (r < 0) {
            if (e == EAGAIN || e == EWOULDBLOCK || e == EINTR)
                break;
            if (e == ECONNREFUSED) { /* ICMP from an earlier send */
                refused++;
                continue;
            }
            for (int i = 0; i < nb; i++)
                Py_DECREF(bufs[i].data);
            errno = e;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        for (int i = 0; i < r; i++) {
            if (_PyBytes_Resize(&data[i], skip[i] + (Py_ssize_t)msgs[i].msg_len) < 0) {
                for (int j = i + 1; j < r; j++)
                    Py_DECREF(data[j]);
                goto fail;
            }
            Py_ssize_t seg = 0;
            struct msghdr *h = &msgs[i].msg_hdr;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c)) {
                if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
                    int v = 0;
                    memcpy(&v, CMSG_DATA(c), c->cmsg_len - CMSG_LEN(0) < sizeof v
                                                 ? c->cmsg_len - CMSG_LEN(0)
                                                 : sizeof v);
                    seg = v;
                }
            }
            bufs[nb].data = data[i];
            bufs[nb].skip = skip[i];
            bufs[nb].size = (Py_ssize_t)msgs[i].msg_len;
            bufs[nb].seg = seg;
            bufs[nb].src = sa[i].sin_addr;
            nb++;
        }
        if (r < want) /* the socket is empty (or nearly): the loop comes back */
            break;
    }
    return nb;
fail:
    for (int i = 0; i < nb; i++)
        Py_DECREF(bufs[i].data);
    return -1;
}

/* What a buffer is as part of a run (recv_runs): the size `d` of its
 * datagrams (all but a shorter last one), how many there are, whether it may
 * join a run (all its datagrams have a whole header and name one job, `job`)
 * and whether a run may go on after it (that, and its last datagram has d
 * bytes too). */
typedef struct {
    Py_ssize_t d, k;
    uint32_t job;
    int joins, open;
} shape_t;

static shape_t
shape_of(const rxbuf_t *b)
{
    shape_t s = {0, 0, 0, 0, 0};
    Py_ssize_t size = b->size, seg = b->seg;
    s.k = segments_of(size, &seg);
    s.d = seg;
    Py_ssize_t last = size - (s.k - 1) * seg;
    if (seg < HEADER_SIZE || last < HEADER_SIZE)
        return s;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(b->data) + b->skip;
    s.job = job_at(p);
    for (Py_ssize_t i = 1; i < s.k; i++)
        if (job_at(p + i * seg) != s.job)
            return s;
    s.joins = 1;
    s.open = last == seg;
    return s;
}

/* The Split of the run of buffers bufs[0:n] (n >= 2, each of shape sh[i]:
 * all join, all but the last open, one job and size): a Datagrams over the
 * n buffers, with the source left for the caller. */
static PyObject *
split_run(const rxbuf_t *bufs, const shape_t *sh, int n, PyTypeObject *dt)
{
    Py_ssize_t total = 0, size = 0;
    for (int i = 0; i < n; i++) {
        total += sh[i].k;
        size += bufs[i].size;
    }
    PyObject *owners = PyList_New(n);
    if (owners == NULL)
        return NULL;
    for (int i = 0; i < n; i++) {
        Py_INCREF(bufs[i].data);
        PyList_SET_ITEM(owners, i, bufs[i].data);
    }
    DatagramsObject *d = datagrams_new(dt, total, owners);
    Py_DECREF(owners);
    if (d == NULL)
        return NULL;
    PyObject *kinds = PyBytes_FromStringAndSize(NULL, total);
    if (kinds == NULL) {
        Py_DECREF(d);
        return NULL;
    }
    char *kind = PyBytes_AS_STRING(kinds);
    Py_ssize_t at = 0;
    for (int i = 0; i < n; i++) {
        const unsigned char *p =
            (const unsigned char *)PyBytes_AS_STRING(bufs[i].data) + bufs[i].skip;
        fill_segments(d, at, i, p, bufs[i].size, sh[i].d, sh[i].k);
        for (Py_ssize_t j = 0; j < sh[i].k; j++)
            kind[at + j] = (char)p[j * sh[i].d + 3];
        at += sh[i].k;
    }
    return Py_BuildValue("(NnnNN)", (PyObject *)d, size, total,
                         PyLong_FromUnsignedLong(sh[0].job), kinds);
}

/* receive(fd, budget, runs): the buffers as recv_gro or recv_runs returns
 * them (a list of Splits, and with `runs` the number of buffers before it). */
static PyObject *
receive(int fd, int budget, int runs)
{
    if (budget < 0)
        budget = 0;
    rxbuf_t *bufs = PyMem_Malloc(((size_t)budget + 1) * sizeof(rxbuf_t));
    shape_t *sh = PyMem_Malloc(((size_t)budget + 1) * sizeof(shape_t));
    PyObject *out = NULL, *src = NULL; /* the last source's string, reused while it repeats */
    int nb = 0;
    if (bufs == NULL || sh == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    nb = receive_buffers(fd, budget, bufs);
    if (nb < 0) {
        nb = 0;
        goto done;
    }
    if ((out = PyList_New(0)) == NULL)
        goto done;
    PyTypeObject *dt = runs ? datagrams_type() : NULL;
    struct in_addr src_addr;
    memset(&src_addr, 0, sizeof src_addr);
    if (dt != NULL) /* only recv_runs joins runs: what each buffer is as part of one */
        for (int i = 0; i < nb; i++)
            sh[i] = shape_of(&bufs[i]);
    for (int i = 0, j; i < nb; i = j) {
        /* the run from buffer i: the buffers after it from the same source,
         * of the same job and datagram size, while the one before is open */
        j = i + 1;
        if (dt != NULL && sh[i].joins)
            while (j < nb && sh[j - 1].open && sh[j].joins && sh[j].job == sh[i].job &&
                   sh[j].d == sh[i].d && bufs[j].src.s_addr == bufs[i].src.s_addr)
                j++;
        if (src == NULL || bufs[i].src.s_addr != src_addr.s_addr) {
            char text[INET_ADDRSTRLEN];
            if (inet_ntop(AF_INET, &bufs[i].src, text, sizeof text) == NULL) {
                PyErr_SetFromErrno(PyExc_OSError);
                goto fail;
            }
            Py_XDECREF(src);
            if ((src = PyUnicode_FromString(text)) == NULL)
                goto fail;
            src_addr = bufs[i].src;
        }
        PyObject *parts = j - i > 1 ? split_run(&bufs[i], &sh[i], j - i, dt)
                                    : split_buffer(bufs[i].data, bufs[i].skip, bufs[i].seg);
        if (parts == NULL)
            goto fail;
        PyObject *item = Py_BuildValue("(OOOOOO)", PyTuple_GET_ITEM(parts, 0),
                                       PyTuple_GET_ITEM(parts, 1), PyTuple_GET_ITEM(parts, 2),
                                       PyTuple_GET_ITEM(parts, 3), PyTuple_GET_ITEM(parts, 4), src);
        Py_DECREF(parts);
        if (item == NULL)
            goto fail;
        int r = PyList_Append(out, item);
        Py_DECREF(item);
        if (r < 0)
            goto fail;
    }
    if (runs) {
        PyObject *pair = Py_BuildValue("(iN)", nb, out);
        out = pair;
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    for (int i = 0; i < nb; i++)
        Py_DECREF(bufs[i].data);
    Py_XDECREF(src);
    PyMem_Free(bufs);
    PyMem_Free(sh);
    return out;
}

#include "drain.h"

/* recv_gro(fd, budget): up to `budget` buffers (recvmmsg calls), what
 * `split_gro` makes of each, with the source IP appended: a list of
 * (segments, bytes, full, ids, kinds, source). */
static PyObject *
recv_gro(PyObject *self, PyObject *args)
{
    (void)self;
    int fd, budget;
    if (!PyArg_ParseTuple(args, "ii", &fd, &budget))
        return NULL;
    return receive(fd, budget, 0);
}

/* recv_runs(fd, budget): recv_gro with runs of buffers taken as one
 * (transport.merge_splits, the Python definition): (buffers received, list). */
static PyObject *
recv_runs(PyObject *self, PyObject *args)
{
    (void)self;
    int fd, budget;
    if (!PyArg_ParseTuple(args, "ii", &fd, &budget))
        return NULL;
    return receive(fd, budget, 1);
}

static PyMethodDef methods[] = {
    {"send_gso", send_gso, METH_VARARGS,
     "send_gso(fd, datagrams, start, addr4, port, tos, gso, gso_max_size) -> "
     "(datagrams sent, messages sent, errno or 0)"},
    {"split_gro", split_gro, METH_VARARGS,
     "split_gro(data: bytes, seg) -> (segments, bytes, full, ids, kinds)"},
    {"recv_gro", recv_gro, METH_VARARGS,
     "recv_gro(fd, budget) -> [(segments, bytes, full, ids, kinds, source)]"},
    {"recv_runs", recv_runs, METH_VARARGS,
     "recv_runs(fd, budget) -> (buffers, [(segments, bytes, full, ids, kinds, source)]): "
     "recv_gro, consecutive buffers of one source, job and datagram size taken as one"},
    {"recv_drain", recv_drain, METH_VARARGS,
     "recv_drain(fd, chunk, max_bytes) -> (buffers, bytes, datagrams, sources, source index "
     "int32s, job int64s, type bytes, length int64s, more): one poll's drain"},
    {"drain_buffers", drain_buffers, METH_VARARGS,
     "drain_buffers([(data, seg, source)]) -> recv_drain's tuple of those buffers (more 0)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_udp", "UDP GSO sends in batches of sendmmsg, GRO receives split", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__udp(void)
{
    return PyModule_Create(&module);
}
