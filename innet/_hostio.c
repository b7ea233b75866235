/* Batched datagram I/O of the ATP end hosts (workers, PS); optional, innet/hostio.py is its glue and
 * holds the pure-Python reference of both functions.
 *
 *   recv_rows(fd, buf, row_size, max_count, lengths, addrs) -> (received, refused)
 *       recvmmsg up to max_count datagrams without blocking into rows of buf (row i at i * row_size,
 *       at most row_size bytes each: a longer datagram is truncated and its length says row_size);
 *       lengths[i] (int64) the datagram's length, addrs[i] (uint64) its IPv4 sender as ip << 16 | port.
 *   send_rows(fd, buf, row_size, length, rows, addrs, gso) -> (sent, refused, gso)
 *       sendmmsg the first `length` bytes of rows[k] (int64 row numbers) of buf, to addrs[k] (same
 *       encoding) or, when addrs is None, to the connected peer. With gso, runs of rows to the same
 *       destination go as UDP GSO trains (the kernel cuts them back into the same datagrams); if the
 *       kernel refuses GSO the rest goes one datagram per message and the returned gso is False.
 *       A datagram the kernel will not take now (buffer full, refused, unreachable) is dropped, as
 *       UdpTransport.send drops it; ECONNREFUSED is counted.
 *
 * Both run without the GIL. IPv4 only. Uses only libc and the CPython C-API.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "_atp_udp.h"

#define CHUNK 256

static int get_buffer(PyObject *o, Py_buffer *b, int writable, Py_ssize_t need, const char *name) {
    if (PyObject_GetBuffer(o, b, writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) : PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (b->len < need) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes, need %zd", name, b->len, need);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static PyObject *recv_rows(PyObject *self, PyObject *args) {
    int fd;
    Py_ssize_t row_size, max_count;
    PyObject *bo, *lo, *ao;
    if (!PyArg_ParseTuple(args, "iOnnOO", &fd, &bo, &row_size, &max_count, &lo, &ao)) return NULL;
    if (row_size <= 0 || max_count < 0) {
        PyErr_SetString(PyExc_ValueError, "row_size must be > 0 and max_count >= 0");
        return NULL;
    }
    Py_buffer b, l, a;
    if (get_buffer(bo, &b, 1, row_size * max_count, "buf") < 0) return NULL;
    if (get_buffer(lo, &l, 1, 8 * max_count, "lengths") < 0) { PyBuffer_Release(&b); return NULL; }
    if (get_buffer(ao, &a, 1, 8 * max_count, "addrs") < 0) {
        PyBuffer_Release(&b);
        PyBuffer_Release(&l);
        return NULL;
    }
    uint8_t *buf = b.buf;
    int64_t *lengths = l.buf;
    uint64_t *addrs = a.buf;
    Py_ssize_t got = 0, refused = 0;
    int err = 0;
    struct mmsghdr msgs[CHUNK];
    struct iovec iov[CHUNK];
    struct sockaddr_in from[CHUNK];
    Py_BEGIN_ALLOW_THREADS
    while (got < max_count) {
        Py_ssize_t want = max_count - got > CHUNK ? CHUNK : max_count - got;
        for (Py_ssize_t i = 0; i < want; i++) {
            iov[i].iov_base = buf + (got + i) * row_size;
            iov[i].iov_len = (size_t)row_size;
            memset(&msgs[i].msg_hdr, 0, sizeof(struct msghdr));
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            msgs[i].msg_hdr.msg_name = &from[i];
            msgs[i].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
        }
        int k = recvmmsg(fd, msgs, (unsigned)want, MSG_DONTWAIT, NULL);
        if (k < 0) {
            if (errno == ECONNREFUSED) { refused++; continue; }
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) err = errno;
            break;
        }
        for (int i = 0; i < k; i++) {
            lengths[got + i] = (int64_t)msgs[i].msg_len;
            addrs[got + i] = msgs[i].msg_hdr.msg_namelen >= sizeof(struct sockaddr_in)
                ? ((uint64_t)ntohl(from[i].sin_addr.s_addr) << 16) | ntohs(from[i].sin_port) : 0;
        }
        got += k;
        if (k < want) break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    PyBuffer_Release(&l);
    PyBuffer_Release(&a);
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return Py_BuildValue("nn", got, refused);
}

static PyObject *send_rows(PyObject *self, PyObject *args) {
    int fd, gso;
    Py_ssize_t row_size, length;
    PyObject *bo, *ro, *ao;
    if (!PyArg_ParseTuple(args, "iOnnOOp", &fd, &bo, &row_size, &length, &ro, &ao, &gso)) return NULL;
    if (length <= 0 || length > row_size) {
        PyErr_SetString(PyExc_ValueError, "length must be in 1..row_size");
        return NULL;
    }
    Py_buffer b, r, a;
    if (get_buffer(bo, &b, 0, 0, "buf") < 0) return NULL;
    if (get_buffer(ro, &r, 0, 0, "rows") < 0) { PyBuffer_Release(&b); return NULL; }
    Py_ssize_t n = r.len / 8;
    int have_addr = ao != Py_None;
    if (have_addr && get_buffer(ao, &a, 0, 8 * n, "addrs") < 0) {
        PyBuffer_Release(&b);
        PyBuffer_Release(&r);
        return NULL;
    }
    const int64_t *rows = r.buf;
    Py_ssize_t nrows = b.len / row_size;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rows[i] < 0 || rows[i] >= nrows) {
            PyBuffer_Release(&b);
            PyBuffer_Release(&r);
            if (have_addr) PyBuffer_Release(&a);
            return PyErr_Format(PyExc_IndexError, "row %lld outside the buffer's %zd rows", (long long)rows[i], nrows);
        }
    }
    struct mmsghdr *msgs = calloc((size_t)(n ? n : 1), sizeof *msgs);
    struct iovec *iov = calloc((size_t)(n ? n : 1), sizeof *iov);
    struct sockaddr_in *to = calloc((size_t)(n ? n : 1), sizeof *to);
    uint8_t *ctrl = calloc((size_t)(n ? n : 1), CTRL_SPACE);
    if (!msgs || !iov || !to || !ctrl) {
        free(msgs); free(iov); free(to); free(ctrl);
        PyBuffer_Release(&b);
        PyBuffer_Release(&r);
        if (have_addr) PyBuffer_Release(&a);
        return PyErr_NoMemory();
    }
    const uint64_t *addrs = have_addr ? a.buf : NULL;
    const uint8_t *buf = b.buf;
    int64_t sent = 0, refused = 0;
    Py_ssize_t start = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (;;) {
        Py_ssize_t per_train = gso_per_train(gso, length);
        Py_ssize_t nmsg = 0, i = start;
        while (i < n) {
            Py_ssize_t k = 0;
            struct msghdr *h = &msgs[nmsg].msg_hdr;
            memset(h, 0, sizeof *h);
            h->msg_iov = &iov[i];
            if (have_addr) {
                to[nmsg].sin_family = AF_INET;
                to[nmsg].sin_addr.s_addr = htonl((uint32_t)(addrs[i] >> 16));
                to[nmsg].sin_port = htons((uint16_t)(addrs[i] & 0xFFFF));
                h->msg_name = &to[nmsg];
                h->msg_namelen = sizeof(struct sockaddr_in);
            }
            while (i + k < n && k < per_train && (!have_addr || addrs[i + k] == addrs[i])) {
                iov[i + k].iov_base = (void *)(buf + rows[i + k] * row_size);
                iov[i + k].iov_len = (size_t)length;
                k++;
            }
            h->msg_iovlen = (size_t)k;
            if (k > 1) gso_option(h, ctrl + nmsg * CTRL_SPACE, (uint16_t)length);
            nmsg++;
            i += k;
        }
        Py_ssize_t failed = 0;
        int r = udp_send_all(fd, msgs, nmsg, &sent, &refused, &failed);
        if (r < 0) err = errno;
        if (r <= 0 || !gso) break;
        gso = 0;     /* GSO refused: plain datagrams from the refused train on */
        start = (Py_ssize_t)(msgs[failed].msg_hdr.msg_iov - iov);
    }
    Py_END_ALLOW_THREADS
    free(msgs); free(iov); free(to); free(ctrl);
    PyBuffer_Release(&b);
    PyBuffer_Release(&r);
    if (have_addr) PyBuffer_Release(&a);
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return Py_BuildValue("LLO", (long long)sent, (long long)refused, gso ? Py_True : Py_False);
}

static PyMethodDef methods[] = {
    {"recv_rows", recv_rows, METH_VARARGS, "recvmmsg datagrams into rows of a buffer: (received, refused)"},
    {"send_rows", send_rows, METH_VARARGS, "sendmmsg rows of a buffer (GSO trains): (sent, refused, gso)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef hostio_module = {
    PyModuleDef_HEAD_INIT, "innet._hostio", "Batched datagram I/O of the ATP end hosts.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__hostio(void) { return PyModule_Create(&hostio_module); }
