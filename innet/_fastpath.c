/* The compiled hot loop of the ATP software switch (optional; innet/fastpath.py is its Python glue).
 *
 * Same wire format and the same per-packet semantics as SoftwareSwitch.process (innet/switch.py, the
 * reference): length check, job lookup, source check (ACK only from the job's PS port, gradients only
 * from a registered member port), ECN mark, ACK free + multicast, resend flush, eligibility,
 * reserve / stale reclaim / hit / collide (and the collided mark), bitmap dedup, fan-in guard, saturating int32 add, completion.
 *
 * The Python switch owns every table and register: the aggregator registers are the numpy arrays of
 * SoftwareSwitch (shared through the buffer protocol, written in place), the counters an int64 array
 * the glue folds into the switch's counter dicts, and the port/job/member/group tables are handed over
 * as flat arrays by set_tables() whenever the switch's config_version changes. The core adds:
 *
 *   Core.process(rows, lengths, in_ports, depths, now) -> [(port, bytes)]   the packet function
 *   Core.serve(fd, max_batch) -> received        recvmmsg a batch, process it, sendmmsg the outputs
 *   Core.drain(fd, max_batch) -> received        recvmmsg only (the compiled bare-receive ceiling)
 *
 * serve() and drain() run without the GIL; the caller holds the switch's lock. Only IPv4 sockets.
 * Uses only libc and the CPython C-API (no numpy headers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "_atp_udp.h"

#define FLAG_BYTE 9

/* counters array layout (innet/fastpath.py COUNTER_SLOTS) */
enum { C_AGGREGATED, C_FORWARDED, C_COLLISIONS, C_RESENDS, C_ACKS, C_DROPPED, C_ECN_MARKED, C_REJECTED,
       C_EMITTED, C_FLUSHED, C_RECLAIMED, C_SATURATED, C_SENT, C_REFUSED, C_NCOUNTERS };

/* job table row (set_tables: an int64 array of shape (256, JOB_FIELDS)) */
enum { J_CONFIGURED, J_FAN_IN, J_PS_PORT, J_LEVEL, J_GROUP_EXISTS, J_GROUP_OFF, J_GROUP_LEN, JOB_FIELDS };

typedef struct {
    int configured, fan_in, level, group_exists, ps_ok;
    uint32_t ps_port;
    Py_ssize_t group_off, group_len;
} Job;

typedef struct {          /* one output: the bytes at arena[off:off+size] go to port */
    uint32_t port;
    Py_ssize_t off;
} Out;

typedef struct {
    PyObject_HEAD
    /* registers (buffers exported by the switch's numpy arrays) */
    Py_buffer b_js, b_bm, b_cnt, b_ecn, b_ts, b_val, b_mi, b_mb1, b_mf, b_counters, b_col;
    int have_buffers;
    uint32_t *js, *bm, *mb1, *col;
    int32_t *cnt, *val;
    uint8_t *ecn;
    double *ts;
    uint16_t *mi, *mf;
    int64_t *counters;
    Py_ssize_t nagg, V, size;
    /* tables */
    Job jobs[256];
    uint32_t *port_nos;       /* sorted switch ports that have an address */
    struct sockaddr_in *port_addr;
    Py_ssize_t nports;
    uint64_t *in_keys;        /* sorted (ipv4 host order << 16 | udp port) */
    uint32_t *in_ports;
    Py_ssize_t nin;
    uint64_t *members;        /* sorted job << 32 | port */
    Py_ssize_t nmembers;
    uint32_t *group_ports;
    Py_ssize_t ngroup_ports;
    int64_t ecn_threshold;
    double stale;
    /* outputs of one batch */
    Out *outs;
    Py_ssize_t nouts, cap_outs;
    uint8_t *arena;
    Py_ssize_t arena_len, arena_cap;
    /* receive / send memory */
    RxBatch rxb;
    struct mmsghdr *tx_msgs;
    struct iovec *tx_iov;
    Py_ssize_t *tx_order;     /* outputs grouped by destination (stable) */
    Py_ssize_t *tx_pidx;      /* destination (port index) of each output */
    Py_ssize_t *tx_count;     /* per port index: outputs, then the running start of its group */
    uint8_t *tx_ctrl;         /* one UDP_SEGMENT control message per datagram train */
    Py_ssize_t tx_cap, tx_count_cap;
    int gso;                  /* 1: send trains of same-destination datagrams with UDP GSO */
} Core;

static int u64_find(const uint64_t *a, Py_ssize_t n, uint64_t key, Py_ssize_t *pos) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (a[mid] < key) lo = mid + 1; else hi = mid;
    }
    *pos = lo;
    return lo < n && a[lo] == key;
}

static Py_ssize_t port_index(const Core *c, uint32_t port) {
    Py_ssize_t lo = 0, hi = c->nports;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (c->port_nos[mid] < port) lo = mid + 1; else hi = mid;
    }
    return (lo < c->nports && c->port_nos[lo] == port) ? lo : -1;
}

/* room for one more output and `bytes` more arena bytes; -1 on allocation failure */
static int reserve_out(Core *c, Py_ssize_t bytes) {
    if (c->nouts == c->cap_outs) {
        Py_ssize_t cap = c->cap_outs ? c->cap_outs * 2 : 1024;
        Out *o = realloc(c->outs, (size_t)cap * sizeof(Out));
        if (!o) return -1;
        c->outs = o;
        c->cap_outs = cap;
    }
    if (c->arena_len + bytes > c->arena_cap) {
        Py_ssize_t cap = c->arena_cap ? c->arena_cap * 2 : 1 << 20;
        while (cap < c->arena_len + bytes) cap *= 2;
        uint8_t *a = realloc(c->arena, (size_t)cap);
        if (!a) return -1;
        c->arena = a;
        c->arena_cap = cap;
    }
    return 0;
}

/* reference _out(): emit to port if it has an address, else count a drop */
static int out_copy(Core *c, uint32_t port, Py_ssize_t off) {
    if (port_index(c, port) < 0) { c->counters[C_DROPPED]++; return 0; }
    if (reserve_out(c, 0) < 0) return -1;
    c->outs[c->nouts].port = port;
    c->outs[c->nouts].off = off;
    c->nouts++;
    return 0;
}

/* copy packet bytes into the arena with extra flag bits; returns the offset or -1 */
static Py_ssize_t stash(Core *c, const uint8_t *pkt, uint8_t flag_bits) {
    if (reserve_out(c, c->size) < 0) return -1;
    Py_ssize_t off = c->arena_len;
    memcpy(c->arena + off, pkt, (size_t)c->size);
    c->arena[off + FLAG_BYTE] |= flag_bits;
    c->arena_len += c->size;
    return off;
}

/* the wire bytes of the aggregate held at idx (reference _emit), into the arena */
static Py_ssize_t stash_emission(Core *c, Py_ssize_t idx, int level, int resend) {
    if (reserve_out(c, c->size) < 0) return -1;
    Py_ssize_t off = c->arena_len;
    uint8_t *p = c->arena + off;
    uint16_t fan = (uint16_t)(c->mf[idx] | FLAG_EDGE | (c->ecn[idx] ? FLAG_ECN : 0) | (resend ? FLAG_RESEND : 0));
    uint32_t b0, b1;
    if (level == 0) { b0 = c->bm[idx]; b1 = c->mb1[idx]; } else { b0 = 0; b1 = c->bm[idx]; }
    wr32(p, b0); wr32(p + 4, b1); wr16(p + 8, fan); wr16(p + 10, c->mi[idx]); wr32(p + 12, c->js[idx]);
    const int32_t *v = c->val + idx * c->V;
    for (Py_ssize_t k = 0; k < c->V; k++) wr32(p + HEADER_SIZE + 4 * k, (uint32_t)v[k]);
    c->arena_len += c->size;
    return off;
}

static inline void free_slot(Core *c, Py_ssize_t idx) {
    c->js[idx] = 0; c->bm[idx] = 0; c->cnt[idx] = 0; c->ecn[idx] = 0;
}

static inline int has_member(const Core *c, uint32_t job, uint32_t port) {
    Py_ssize_t pos;
    return u64_find(c->members, c->nmembers, ((uint64_t)job << 32) | port, &pos);
}

/* forward the (marked) packet to the job's PS port, as the reference's _out(job.ps_port, packet) */
static int forward_ps(Core *c, const Job *job, const uint8_t *pkt, uint8_t marks) {
    if (!job->ps_ok) { c->counters[C_DROPPED]++; return 0; }
    Py_ssize_t off = stash(c, pkt, marks);
    if (off < 0) return -1;
    return out_copy(c, job->ps_port, off);
}

static int emit_ps(Core *c, const Job *job, Py_ssize_t idx, int resend) {
    if (!job->ps_ok) { c->counters[C_DROPPED]++; return 0; }
    Py_ssize_t off = stash_emission(c, idx, job->level, resend);
    if (off < 0) return -1;
    return out_copy(c, job->ps_port, off);
}

/* One packet through the dataplane (SoftwareSwitch.process); -1 only on allocation failure. */
static int process_one(Core *c, const uint8_t *pkt, Py_ssize_t len, uint32_t in_port, int64_t depth,
                       double now) {
    int64_t *n = c->counters;
    if (len != c->size) { n[C_DROPPED]++; return 0; }
    uint32_t b0 = rd32(pkt), b1 = rd32(pkt + 4), job_seq = rd32(pkt + 12);
    uint16_t word = rd16(pkt + 8), agg_index = rd16(pkt + 10);
    uint32_t job_id = job_seq >> SEQ_BITS;
    const Job *job = &c->jobs[job_id];
    if (job_id == 0 || !job->configured) { n[C_DROPPED]++; return 0; }
    unsigned flags = word & 0x3F;
    if ((flags & FLAG_ACK) ? (in_port != job->ps_port) : !has_member(c, job_id, in_port)) {
        n[C_REJECTED]++;
        return 0;
    }
    uint8_t marks = 0;
    if (depth > c->ecn_threshold) {
        n[C_ECN_MARKED]++;
        flags |= FLAG_ECN;
        marks = FLAG_ECN;
    }
    Py_ssize_t idx = agg_index % c->nagg;

    if (flags & FLAG_ACK) {
        n[C_ACKS]++;
        if (c->js[idx] == job_seq) free_slot(c, idx);
        if (c->col[idx] == job_seq) c->col[idx] = 0;
        if (!job->group_exists) { n[C_DROPPED]++; return 0; }
        Py_ssize_t off = -1;
        for (Py_ssize_t g = 0; g < job->group_len; g++) {
            uint32_t p = c->group_ports[job->group_off + g];
            if (port_index(c, p) < 0) { n[C_DROPPED]++; continue; }
            if (off < 0 && (off = stash(c, pkt, marks)) < 0) return -1;
            if (out_copy(c, p, off) < 0) return -1;
        }
        return 0;
    }

    if (flags & FLAG_RESEND) {
        n[C_RESENDS]++;
        if (c->js[idx] == job_seq) {
            if (emit_ps(c, job, idx, 1) < 0) return -1;
            n[C_FLUSHED]++;
            free_slot(c, idx);
        }
        n[C_FORWARDED]++;
        return forward_ps(c, job, pkt, marks);
    }

    int eligible;
    uint32_t key;
    if (job->level == 0) {
        eligible = !(flags & (FLAG_EDGE | FLAG_OVERFLOW | FLAG_COLLISION));
        key = b0;
    } else {
        unsigned fan0 = (word >> 11) & 0x1F;
        if (!fan0) fan0 = 32;
        eligible = (flags & FLAG_EDGE) && !(flags & (FLAG_OVERFLOW | FLAG_COLLISION)) && b0 != 0
                   && (unsigned)__builtin_popcount(b0) == fan0;
        key = b1;
    }
    if (!eligible || key == 0) {
        n[C_FORWARDED]++;
        return forward_ps(c, job, pkt, marks);
    }

    uint32_t held = c->js[idx];
    if (held && held != job_seq && now - c->ts[idx] > c->stale) {
        free_slot(c, idx);
        n[C_RECLAIMED]++;
        held = 0;
    }
    if (held == 0 && c->col[idx] == job_seq) held = ~job_seq;   /* its first packet collided here: to the PS */
    if (held == 0) {
        c->js[idx] = job_seq;
        memset(c->val + idx * c->V, 0, (size_t)c->V * sizeof(int32_t));
        c->mi[idx] = agg_index;
        c->mb1[idx] = b1;
        c->mf[idx] = (uint16_t)(word & ~0x3Fu);
    } else if (held != job_seq) {
        c->col[idx] = job_seq;
        n[C_COLLISIONS]++;
        n[C_FORWARDED]++;
        return forward_ps(c, job, pkt, (uint8_t)(marks | FLAG_COLLISION));
    }

    uint32_t have = c->bm[idx];
    if (key & have) {
        if ((key & have) == key) { n[C_DROPPED]++; return 0; }   /* duplicate */
        n[C_FORWARDED]++;
        return forward_ps(c, job, pkt, marks);
    }
    if (c->cnt[idx] >= job->fan_in) {
        n[C_FORWARDED]++;
        return forward_ps(c, job, pkt, marks);
    }

    int32_t *v = c->val + idx * c->V;
    const uint8_t *pay = pkt + HEADER_SIZE;
    int saturated = 0;
    for (Py_ssize_t k = 0; k < c->V; k++) {
        int64_t s = (int64_t)v[k] + (int64_t)(int32_t)rd32(pay + 4 * k);
        if (s > INT32_MAX) { s = INT32_MAX; saturated = 1; }
        else if (s < INT32_MIN) { s = INT32_MIN; saturated = 1; }
        v[k] = (int32_t)s;
    }
    if (saturated) n[C_SATURATED]++;
    c->bm[idx] = have | key;
    c->cnt[idx] += __builtin_popcount(key);
    if (flags & FLAG_ECN) c->ecn[idx] = 1;
    c->ts[idx] = now;
    n[C_AGGREGATED]++;
    if (c->cnt[idx] >= job->fan_in) {
        n[C_EMITTED]++;
        return emit_ps(c, job, idx, 0);
    }
    return 0;
}

/* ------------------------------------------------------------------ object life */

static int get_buf(PyObject *obj, Py_buffer *b, Py_ssize_t itemsize, Py_ssize_t count, const char *name) {
    if (PyObject_GetBuffer(obj, b, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (b->itemsize != itemsize || b->len != itemsize * count) {
        PyErr_Format(PyExc_ValueError, "%s: expected %zd items of %zd bytes, got %zd bytes of %zd", name,
                     count, itemsize, b->len, b->itemsize);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

static void release_all(Core *c) {
    if (c->have_buffers) {
        Py_buffer *bs[] = {&c->b_js, &c->b_bm, &c->b_cnt, &c->b_ecn, &c->b_ts, &c->b_val, &c->b_mi, &c->b_mb1,
                           &c->b_mf, &c->b_counters, &c->b_col};
        for (size_t i = 0; i < sizeof bs / sizeof bs[0]; i++)
            if (bs[i]->obj) PyBuffer_Release(bs[i]);
        c->have_buffers = 0;
    }
}

static void Core_dealloc(Core *c) {
    release_all(c);
    free(c->port_nos); free(c->port_addr); free(c->in_keys); free(c->in_ports); free(c->members);
    free(c->group_ports); free(c->outs); free(c->arena);
    rx_free(&c->rxb);
    free(c->tx_msgs); free(c->tx_iov); free(c->tx_order); free(c->tx_pidx); free(c->tx_count); free(c->tx_ctrl);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"job_seq", "bitmap", "counter", "ecn", "timestamp", "values", "meta_index",
                             "meta_b1", "meta_fan", "counters", "collided", NULL};
    PyObject *o[11];
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOOOOO", kwlist, &o[0], &o[1], &o[2], &o[3], &o[4], &o[5],
                                     &o[6], &o[7], &o[8], &o[9], &o[10]))
        return -1;
    release_all(c);
    memset(&c->b_js, 0, sizeof(Py_buffer) * 11);
    c->have_buffers = 1;
    if (PyObject_GetBuffer(o[0], &c->b_js, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (c->b_js.itemsize != 4) { PyErr_SetString(PyExc_ValueError, "job_seq: expected uint32"); return -1; }
    Py_ssize_t n = c->b_js.len / 4;
    if (get_buf(o[1], &c->b_bm, 4, n, "bitmap") < 0 || get_buf(o[2], &c->b_cnt, 4, n, "counter") < 0
        || get_buf(o[3], &c->b_ecn, 1, n, "ecn") < 0 || get_buf(o[4], &c->b_ts, 8, n, "timestamp") < 0
        || get_buf(o[6], &c->b_mi, 2, n, "meta_index") < 0 || get_buf(o[7], &c->b_mb1, 4, n, "meta_b1") < 0
        || get_buf(o[8], &c->b_mf, 2, n, "meta_fan") < 0
        || get_buf(o[9], &c->b_counters, 8, C_NCOUNTERS, "counters") < 0
        || get_buf(o[10], &c->b_col, 4, n, "collided") < 0)
        return -1;
    if (PyObject_GetBuffer(o[5], &c->b_val, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
    if (n < 1 || c->b_val.itemsize != 4 || c->b_val.len % (4 * n) != 0 || c->b_val.len == 0) {
        PyErr_SetString(PyExc_ValueError, "values: expected an int32 array of shape (aggregators, values)");
        return -1;
    }
    c->nagg = n;
    c->V = c->b_val.len / (4 * n);
    c->size = HEADER_SIZE + 4 * c->V;
    c->js = c->b_js.buf; c->bm = c->b_bm.buf; c->cnt = c->b_cnt.buf; c->ecn = c->b_ecn.buf; c->ts = c->b_ts.buf;
    c->val = c->b_val.buf; c->mi = c->b_mi.buf; c->mb1 = c->b_mb1.buf; c->mf = c->b_mf.buf;
    c->col = c->b_col.buf;
    c->counters = c->b_counters.buf;
    c->ecn_threshold = INT64_MAX;
    c->stale = 2.0;
    c->gso = 1;
    return 0;
}

/* a contiguous buffer of count items of itemsize bytes, copied into fresh malloc'd memory */
static void *copy_array(PyObject *obj, Py_ssize_t itemsize, Py_ssize_t *count, const char *name) {
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (b.itemsize != itemsize || b.len % itemsize) {
        PyErr_Format(PyExc_ValueError, "%s: expected items of %zd bytes", name, itemsize);
        PyBuffer_Release(&b);
        return NULL;
    }
    void *m = malloc(b.len ? (size_t)b.len : 1);
    if (!m) { PyBuffer_Release(&b); PyErr_NoMemory(); return NULL; }
    memcpy(m, b.buf, (size_t)b.len);
    *count = b.len / itemsize;
    PyBuffer_Release(&b);
    return m;
}

static PyObject *Core_set_tables(Core *c, PyObject *args) {
    PyObject *o_port_nos, *o_port_ip, *o_port_udp, *o_in_keys, *o_in_ports, *o_jobs, *o_members, *o_groups;
    if (!PyArg_ParseTuple(args, "OOOOOOOO", &o_port_nos, &o_port_ip, &o_port_udp, &o_in_keys, &o_in_ports,
                          &o_jobs, &o_members, &o_groups))
        return NULL;
    Py_ssize_t np_, nip, nudp, nk, nip2, nj, nm, ng;
    uint32_t *port_nos = NULL, *ip = NULL, *in_ports = NULL, *groups = NULL;
    uint16_t *udp = NULL;
    uint64_t *in_keys = NULL, *members = NULL;
    int64_t *jobs = NULL;
    struct sockaddr_in *addrs = NULL;
    if (!(port_nos = copy_array(o_port_nos, 4, &np_, "port_nos")) || !(ip = copy_array(o_port_ip, 4, &nip, "port_ip"))
        || !(udp = copy_array(o_port_udp, 2, &nudp, "port_udp")) || !(in_keys = copy_array(o_in_keys, 8, &nk, "in_keys"))
        || !(in_ports = copy_array(o_in_ports, 4, &nip2, "in_ports")) || !(jobs = copy_array(o_jobs, 8, &nj, "jobs"))
        || !(members = copy_array(o_members, 8, &nm, "members")) || !(groups = copy_array(o_groups, 4, &ng, "groups")))
        goto fail;
    if (nip != np_ || nudp != np_ || nip2 != nk || nj != 256 * JOB_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "set_tables: inconsistent table sizes");
        goto fail;
    }
    addrs = calloc((size_t)(np_ ? np_ : 1), sizeof(struct sockaddr_in));
    if (!addrs) { PyErr_NoMemory(); goto fail; }
    for (Py_ssize_t i = 0; i < np_; i++) {
        addrs[i].sin_family = AF_INET;
        addrs[i].sin_addr.s_addr = htonl(ip[i]);
        addrs[i].sin_port = htons(udp[i]);
    }
    for (int j = 0; j < 256; j++) {
        const int64_t *r = jobs + j * JOB_FIELDS;
        Job *d = &c->jobs[j];
        d->configured = r[J_CONFIGURED] != 0;
        d->fan_in = (int)r[J_FAN_IN];
        d->ps_port = (uint32_t)r[J_PS_PORT];
        d->level = (int)r[J_LEVEL];
        d->group_exists = r[J_GROUP_EXISTS] != 0;
        d->group_off = (Py_ssize_t)r[J_GROUP_OFF];
        d->group_len = (Py_ssize_t)r[J_GROUP_LEN];
        if (d->group_off < 0 || d->group_len < 0 || d->group_off + d->group_len > ng) {
            PyErr_Format(PyExc_ValueError, "set_tables: job %d: multicast ports out of range", j);
            goto fail;
        }
    }
    free(c->port_nos); free(c->port_addr); free(c->in_keys); free(c->in_ports); free(c->members);
    free(c->group_ports);
    c->port_nos = port_nos; c->port_addr = addrs; c->nports = np_;
    c->in_keys = in_keys; c->in_ports = in_ports; c->nin = nk;
    c->members = members; c->nmembers = nm;
    c->group_ports = groups; c->ngroup_ports = ng;
    for (int j = 0; j < 256; j++) c->jobs[j].ps_ok = port_index(c, c->jobs[j].ps_port) >= 0;
    free(ip); free(udp); free(jobs);
    Py_RETURN_NONE;
fail:
    free(port_nos); free(ip); free(udp); free(in_keys); free(in_ports); free(jobs); free(members); free(groups);
    free(addrs);
    return NULL;
}

static PyObject *Core_set_params(Core *c, PyObject *args) {
    long long thr;
    double stale;
    if (!PyArg_ParseTuple(args, "Ld", &thr, &stale)) return NULL;
    c->ecn_threshold = thr;
    c->stale = stale;
    Py_RETURN_NONE;
}

static PyObject *Core_set_gso(Core *c, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    c->gso = on;
    Py_RETURN_NONE;
}

static PyObject *Core_gso(Core *c, PyObject *Py_UNUSED(args)) { return PyBool_FromLong(c->gso); }

static PyObject *outputs_list(Core *c) {
    PyObject *res = PyList_New(c->nouts);
    if (!res) return NULL;
    for (Py_ssize_t i = 0; i < c->nouts; i++) {
        PyObject *t = Py_BuildValue("(Iy#)", c->outs[i].port, (const char *)(c->arena + c->outs[i].off),
                                    c->size);
        if (!t) { Py_DECREF(res); return NULL; }
        PyList_SET_ITEM(res, i, t);
    }
    return res;
}

static int long_at(PyObject *seq, Py_ssize_t i, long long *v) {
    PyObject *x = PySequence_GetItem(seq, i);
    if (!x) return -1;
    *v = PyLong_AsLongLong(x);
    Py_DECREF(x);
    return (*v == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* process(rows, lengths, in_ports, depths, now): the packet function on rows of a 2-D uint8 buffer */
static PyObject *Core_process(Core *c, PyObject *args) {
    PyObject *o_rows, *lengths, *in_ports, *depths;
    double now;
    if (!PyArg_ParseTuple(args, "OOOOd", &o_rows, &lengths, &in_ports, &depths, &now)) return NULL;
    Py_buffer rows;
    if (PyObject_GetBuffer(o_rows, &rows, PyBUF_ND | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    PyObject *res = NULL;
    Py_ssize_t n = PySequence_Size(lengths);
    if (n < 0) goto done;
    if (rows.ndim != 2 || rows.itemsize != 1 || rows.shape[0] < n) {
        PyErr_SetString(PyExc_ValueError, "rows: expected a C-contiguous 2-D uint8 array with a row per packet");
        goto done;
    }
    if (PySequence_Size(in_ports) != n || (depths != Py_None && PySequence_Size(depths) != n)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "lengths, in_ports and depths differ in length");
        goto done;
    }
    Py_ssize_t width = rows.shape[1];
    c->nouts = 0;
    c->arena_len = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long ln, port, dep = 0;
        if (long_at(lengths, i, &ln) < 0 || long_at(in_ports, i, &port) < 0
            || (depths != Py_None && long_at(depths, i, &dep) < 0))
            goto done;
        if (ln < 0 || ln > width) { PyErr_Format(PyExc_ValueError, "lengths[%zd] = %lld exceeds the row", i, ln); goto done; }
        if (process_one(c, (const uint8_t *)rows.buf + i * width, (Py_ssize_t)ln, (uint32_t)port, dep, now) < 0) {
            PyErr_NoMemory();
            goto done;
        }
    }
    res = outputs_list(c);
done:
    PyBuffer_Release(&rows);
    return res;
}

/* room for a batch of datagrams one byte longer than a packet (an oversize one shows as too long) */
static int ensure_rx(Core *c, Py_ssize_t batch) { return rx_reserve(&c->rxb, batch, c->size + 1); }

static int ensure_tx(Core *c, Py_ssize_t n) {
    if (c->tx_count_cap < c->nports + 1) {
        Py_ssize_t *t = realloc(c->tx_count, (size_t)(c->nports + 1) * sizeof *t);
        if (!t) return -1;
        c->tx_count = t;
        c->tx_count_cap = c->nports + 1;
    }
    if (n <= c->tx_cap) return 0;
    struct mmsghdr *m = realloc(c->tx_msgs, (size_t)n * sizeof *m);
    if (m) c->tx_msgs = m;
    struct iovec *v = realloc(c->tx_iov, (size_t)n * sizeof *v);
    if (v) c->tx_iov = v;
    Py_ssize_t *o = realloc(c->tx_order, (size_t)n * sizeof *o);
    if (o) c->tx_order = o;
    Py_ssize_t *p = realloc(c->tx_pidx, (size_t)n * sizeof *p);
    if (p) c->tx_pidx = p;
    uint8_t *ctl = realloc(c->tx_ctrl, (size_t)n * CTRL_SPACE);
    if (ctl) c->tx_ctrl = ctl;
    if (!m || !v || !o || !p || !ctl) return -1;
    c->tx_cap = n;
    return 0;
}

/* Send every output. Outputs are grouped by destination (order kept per destination, which is all a
 * receiver can observe) and each destination's run goes out as trains of up to 64 datagrams in one
 * UDP GSO message (the kernel cuts them back into the same datagrams); without GSO support, one
 * message per datagram. -1 (errno) on an unexpected socket error. */
static int send_outputs(Core *c, int fd) {
    Py_ssize_t n = c->nouts, np_ = c->nports;
    for (Py_ssize_t d = 0; d <= np_; d++) c->tx_count[d] = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t pi = port_index(c, c->outs[i].port);   /* always found: out_copy checked it */
        c->tx_pidx[i] = pi;
        c->tx_count[pi]++;
    }
    Py_ssize_t run = 0;
    for (Py_ssize_t d = 0; d < np_; d++) { Py_ssize_t k = c->tx_count[d]; c->tx_count[d] = run; run += k; }
    for (Py_ssize_t i = 0; i < n; i++) c->tx_order[c->tx_count[c->tx_pidx[i]]++] = i;
    Py_ssize_t per_train = gso_per_train(c->gso, c->size);
    for (;;) {
        Py_ssize_t nmsg = 0, i = 0;
        while (i < n) {
            Py_ssize_t pi = c->tx_pidx[c->tx_order[i]], k = 0;
            struct msghdr *h = &c->tx_msgs[nmsg].msg_hdr;
            memset(h, 0, sizeof *h);
            h->msg_iov = &c->tx_iov[i];
            h->msg_name = &c->port_addr[pi];
            h->msg_namelen = sizeof(struct sockaddr_in);
            while (i + k < n && k < per_train && c->tx_pidx[c->tx_order[i + k]] == pi) {
                c->tx_iov[i + k].iov_base = c->arena + c->outs[c->tx_order[i + k]].off;
                c->tx_iov[i + k].iov_len = (size_t)c->size;
                k++;
            }
            h->msg_iovlen = (size_t)k;
            if (k > 1) gso_option(h, c->tx_ctrl + nmsg * CTRL_SPACE, (uint16_t)c->size);
            nmsg++;
            i += k;
        }
        Py_ssize_t failed = 0;
        int r = udp_send_all(fd, c->tx_msgs, nmsg, &c->counters[C_SENT], &c->counters[C_REFUSED], &failed);
        if (r <= 0) return r;
        /* GSO refused (an old kernel, or trains too big for the route's MTU): plain datagrams from
         * the refused train on, and for good */
        c->gso = 0;
        per_train = 1;
        Py_ssize_t done = (Py_ssize_t)(c->tx_msgs[failed].msg_hdr.msg_iov - c->tx_iov);
        Py_ssize_t rest = n - done;
        memmove(c->tx_order, c->tx_order + done, (size_t)rest * sizeof *c->tx_order);
        n = rest;
    }
}

/* serve(fd, max_batch): one receive batch through the dataplane; the number of datagrams received */
static PyObject *Core_serve(Core *c, PyObject *args) {
    int fd;
    Py_ssize_t batch;
    if (!PyArg_ParseTuple(args, "in", &fd, &batch)) return NULL;
    if (batch < 1) { PyErr_SetString(PyExc_ValueError, "max_batch must be >= 1"); return NULL; }
    if (ensure_rx(c, batch) < 0) return PyErr_NoMemory();
    int k, err = 0, nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    k = rx_receive(&c->rxb, fd, batch, &c->counters[C_REFUSED]);
    if (k < 0) {
        err = errno;
    } else if (k > 0) {
        double now = monotonic_now();
        c->nouts = 0;
        c->arena_len = 0;
        for (int i = 0; i < k; i++) {
            uint32_t port = 0xFFFFFFFFu;   /* UNKNOWN_PORT */
            uint64_t key;
            Py_ssize_t pos;
            if (rx_sender(&c->rxb, i, &key) && u64_find(c->in_keys, c->nin, key, &pos)) port = c->in_ports[pos];
            if (process_one(c, rx_data(&c->rxb, i), rx_length(&c->rxb, i), port, (int64_t)(k - 1 - i), now) < 0) {
                nomem = 1;
                break;
            }
        }
        if (!nomem && c->nouts) {
            if (ensure_tx(c, c->nouts) < 0) nomem = 1;
            else if (send_outputs(c, fd) < 0) err = errno;
        }
    }
    Py_END_ALLOW_THREADS
    if (nomem) return PyErr_NoMemory();
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyLong_FromLong(k);
}

/* drain(fd, max_batch): recvmmsg only, nothing else (the compiled bare-receive ceiling) */
static PyObject *Core_drain(Core *c, PyObject *args) {
    int fd;
    Py_ssize_t batch;
    if (!PyArg_ParseTuple(args, "in", &fd, &batch)) return NULL;
    if (batch < 1) { PyErr_SetString(PyExc_ValueError, "max_batch must be >= 1"); return NULL; }
    if (ensure_rx(c, batch) < 0) return PyErr_NoMemory();
    int k, err = 0;
    Py_BEGIN_ALLOW_THREADS
    k = rx_receive(&c->rxb, fd, batch, &c->counters[C_REFUSED]);
    if (k < 0) err = errno;
    Py_END_ALLOW_THREADS
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyLong_FromLong(k);
}

static PyMethodDef Core_methods[] = {
    {"set_tables", (PyCFunction)Core_set_tables, METH_VARARGS,
     "set_tables(port_nos, port_ip, port_udp, in_keys, in_ports, jobs, members, group_ports): the control tables"},
    {"set_params", (PyCFunction)Core_set_params, METH_VARARGS, "set_params(ecn_threshold, stale_timeout)"},
    {"process", (PyCFunction)Core_process, METH_VARARGS,
     "process(rows, lengths, in_ports, depths, now) -> [(port, bytes)]: the packet function"},
    {"serve", (PyCFunction)Core_serve, METH_VARARGS,
     "serve(fd, max_batch) -> int: receive a batch, process it, send the outputs"},
    {"set_gso", (PyCFunction)Core_set_gso, METH_VARARGS,
     "set_gso(on): send same-destination outputs as UDP GSO trains (default on; off after the kernel refuses)"},
    {"gso", (PyCFunction)Core_gso, METH_NOARGS, "gso() -> bool: whether outputs go out as UDP GSO trains"},
    {"drain", (PyCFunction)Core_drain, METH_VARARGS, "drain(fd, max_batch) -> int: receive a batch, nothing else"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "innet._fastpath.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The compiled ATP dataplane over a SoftwareSwitch's registers (see innet/fastpath.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
};

static struct PyModuleDef fastpath_module = {
    PyModuleDef_HEAD_INIT, "innet._fastpath", "The compiled hot loop of the ATP software switch.", -1, NULL,
};

PyMODINIT_FUNC PyInit__fastpath(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&fastpath_module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "COUNTER_COUNT", C_NCOUNTERS);
    PyModule_AddIntConstant(m, "JOB_FIELDS", JOB_FIELDS);
    return m;
}
