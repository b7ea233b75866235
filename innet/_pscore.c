/* The compiled packet path of the ATP parameter server (optional; innet/pscore.py is its Python glue).
 *
 * Same per-packet semantics as ParameterServer.handle (innet/ps.py, the reference): length check, job
 * lookup, ACK drop, source check (the job's switch, or a registered worker speaking for itself only),
 * contribution of the bitmaps, learned direct workers, parameter resent for a completed fragment,
 * per-fragment sets of workers (duplicates ignored, partial overlaps dropped), int32 sums in int64 and
 * overflow (float32) sums in float64, the float32 parameter packet once the set covers the world, sent
 * to the switch and every direct worker, the `keep` most recent results kept, pending expiry.
 *
 * The core owns every job's state while the server runs in C mode (one owner: the Python dicts of the
 * reference are not used). Addresses are keys, IPv4 as ip << 16 | port (innet.hostio.addr_key); the
 * glue gives a key >= 2**48 to an address that is not a numeric IPv4 one (it never matches a received
 * datagram and is never sent to). Rare events that the reference logs are recorded (kind, job, a, b, c)
 * for the glue to log after the call, when the logger's level asks for them.
 *
 *   Core(value_count, pending_ttl)
 *   Core.add_job(job_id, world, rack_size, scale, keep, switch_key, worker_keys) / remove_job(job_id)
 *   Core.process(rows, lengths, keys, now, log_level) -> [(key, bytes)]   the packet function
 *   Core.serve(fd, max_batch, log_level, timeout_ms) -> received
 *       wait up to timeout_ms for the socket to be readable (poll), then up to 64 rounds of: recvmmsg a
 *       batch, process it, sendmmsg the outputs -- all without the GIL, so a wake-up of the PS costs
 *       one GIL acquisition (when serve returns), not one per system call
 *   Core.stats(job_id), Core.state(job_id), Core.take_counters(), Core.take_events()
 *
 * The state is guarded by the core's own lock (a PyThread lock, usable without the GIL): serve()
 * holds it while it processes, not while it waits in poll; every other method takes it too (dropping
 * the GIL while it waits), so serve() runs without the server's Python lock. Uses only libc and the
 * CPython C-API (no numpy headers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pythread.h>

#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "_atp_udp.h"

#define MAX_RACKS 32
#define NAME_KEYS (1ull << 48)  /* keys from here on stand for non-IPv4 addresses: never sent to */
#define MAX_EVENTS 4096

/* events, as innet/pscore.py logs them; log level of each in ev_level */
enum { E_LENGTH, E_GARBLED, E_UNREGISTERED, E_BITMAPS, E_WORKER, E_DIRECT, E_OVERLAP, E_EXPIRED, E_COUNT };
static const int ev_level[E_COUNT] = {10, 10, 10, 30, 10, 20, 10, 30};

/* global counters (take_counters) */
enum { N_DROPPED, N_REJECTED, N_SENT, N_REFUSED, N_LOST_EVENTS, N_COUNT };

/* per-job statistics, in the order of PSJobStats */
enum { S_PACKETS, S_SWITCH_AGGREGATES, S_RAW, S_COLLISIONS, S_OVERFLOW, S_RESENDS, S_DUPLICATES, S_OVERLAPS,
       S_COMPLETED, S_PARAM_RESENT, S_REJECTED, S_COUNT };

typedef struct {           /* open addressing, linear probing; slot key 0 = empty, else seq + 1 */
    uint32_t *keys;
    void **vals;
    size_t cap, n;
} Map;

typedef struct {
    uint32_t seq;
    uint16_t agg_index, fan;
    uint8_t ecn, collision, has_float;
    double t0;
    uint32_t *have;       /* per rack */
    int64_t *isum;
    double *fsum;
} Pend;

typedef struct {
    int world, rack_size, racks;
    double scale;
    Py_ssize_t keep;
    int has_switch;
    uint64_t switch_key;
    uint32_t rack_mask[MAX_RACKS];
    uint64_t *rank_keys;      /* sorted worker keys (last rank of a repeated address wins) */
    int *rank_of;
    Py_ssize_t nranks;
    uint64_t *direct_key;     /* per rank */
    uint8_t *has_direct;
    int *direct_order;        /* ranks in the order they were first seen sending directly */
    int ndirect;
    Map pending;
    Map completed;            /* seq -> param bytes (malloc'd) */
    uint32_t *fifo;           /* completed seqs, oldest first: a ring */
    size_t fifo_cap, fifo_head, fifo_n;
    int64_t stats[S_COUNT];
} Job;

typedef struct { uint64_t key; Py_ssize_t off; } Out;
typedef struct { int kind, job; int64_t a, b, c; } Event;

typedef struct {
    PyObject_HEAD
    PyThread_type_lock mu;    /* guards everything below */
    Py_ssize_t V, size;
    double ttl;
    Job *jobs[256];
    int64_t counters[N_COUNT];
    int log_level;
    Event events[MAX_EVENTS];
    int nevents;
    /* outputs of one call */
    Out *outs;
    Py_ssize_t nouts, cap_outs;
    uint8_t *arena;
    Py_ssize_t arena_len, arena_cap;
    /* receive / send memory */
    RxBatch rxb;
    struct mmsghdr *tx_msgs;
    struct iovec *tx_iov;
    struct sockaddr_in *tx_addr;
    uint8_t *tx_ctrl;
    Py_ssize_t tx_cap;
    int gso;
} Core;

/* take the core's lock from a thread holding the GIL (dropping the GIL while serve() holds it) */
static void lock_core(Core *c) {
    if (PyThread_acquire_lock(c->mu, NOWAIT_LOCK)) return;
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(c->mu, WAIT_LOCK);
    Py_END_ALLOW_THREADS
}

static inline void unlock_core(Core *c) { PyThread_release_lock(c->mu); }

/* ------------------------------------------------------------------ seq -> pointer map */

static inline size_t slot_of(const Map *m, uint32_t key) { return (size_t)(key * 2654435761u) & (m->cap - 1); }

static void *map_get(const Map *m, uint32_t seq) {
    if (!m->cap) return NULL;
    uint32_t key = seq + 1;
    for (size_t i = slot_of(m, key);; i = (i + 1) & (m->cap - 1)) {
        if (m->keys[i] == key) return m->vals[i];
        if (m->keys[i] == 0) return NULL;
    }
}

static int map_grow(Map *m) {
    size_t cap = m->cap ? m->cap * 2 : 64;
    uint32_t *keys = calloc(cap, sizeof *keys);
    void **vals = calloc(cap, sizeof *vals);
    if (!keys || !vals) { free(keys); free(vals); return -1; }
    for (size_t i = 0; i < m->cap; i++) {
        if (!m->keys[i]) continue;
        size_t j = (size_t)(m->keys[i] * 2654435761u) & (cap - 1);
        while (keys[j]) j = (j + 1) & (cap - 1);
        keys[j] = m->keys[i];
        vals[j] = m->vals[i];
    }
    free(m->keys); free(m->vals);
    m->keys = keys; m->vals = vals; m->cap = cap;
    return 0;
}

/* insert a seq that is not in the map; -1 on allocation failure */
static int map_put(Map *m, uint32_t seq, void *val) {
    if ((m->n + 1) * 2 > m->cap && map_grow(m) < 0) return -1;
    uint32_t key = seq + 1;
    size_t i = slot_of(m, key);
    while (m->keys[i]) i = (i + 1) & (m->cap - 1);
    m->keys[i] = key;
    m->vals[i] = val;
    m->n++;
    return 0;
}

/* remove seq (backward-shift deletion); its value, or NULL */
static void *map_del(Map *m, uint32_t seq) {
    if (!m->cap) return NULL;
    uint32_t key = seq + 1;
    size_t mask = m->cap - 1, i = slot_of(m, key);
    while (m->keys[i] != key) {
        if (!m->keys[i]) return NULL;
        i = (i + 1) & mask;
    }
    void *val = m->vals[i];
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!m->keys[j]) break;
        size_t home = slot_of(m, m->keys[j]);
        /* move j back to i unless its home lies cyclically in (i, j] */
        if ((i <= j) ? (i < home && home <= j) : (i < home || home <= j)) continue;
        m->keys[i] = m->keys[j];
        m->vals[i] = m->vals[j];
        i = j;
    }
    m->keys[i] = 0;
    m->vals[i] = NULL;
    m->n--;
    return val;
}

/* ------------------------------------------------------------------ jobs */

static void job_free(Job *j) {
    if (!j) return;
    for (size_t i = 0; i < j->pending.cap; i++) if (j->pending.keys[i]) free(j->pending.vals[i]);
    for (size_t i = 0; i < j->completed.cap; i++) if (j->completed.keys[i]) free(j->completed.vals[i]);
    free(j->pending.keys); free(j->pending.vals); free(j->completed.keys); free(j->completed.vals);
    free(j->fifo); free(j->rank_keys); free(j->rank_of); free(j->direct_key); free(j->has_direct);
    free(j->direct_order);
    free(j);
}

/* put job j (NULL: none) at job_id under the core's lock; the one it replaces is freed after */
static void swap_job(Core *c, int job_id, Job *j) {
    lock_core(c);
    Job *old = c->jobs[job_id];
    c->jobs[job_id] = j;
    unlock_core(c);
    job_free(old);
}

static int rank_lookup(const Job *j, uint64_t key) {
    Py_ssize_t lo = 0, hi = j->nranks;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (j->rank_keys[mid] < key) lo = mid + 1; else hi = mid;
    }
    return (lo < j->nranks && j->rank_keys[lo] == key) ? j->rank_of[lo] : -1;
}

static void event(Core *c, int kind, int job, int64_t a, int64_t b, int64_t d) {
    if (ev_level[kind] < c->log_level) return;
    if (c->nevents == MAX_EVENTS) { c->counters[N_LOST_EVENTS]++; return; }
    Event *e = &c->events[c->nevents++];
    e->kind = kind; e->job = job; e->a = a; e->b = b; e->c = d;
}

/* ------------------------------------------------------------------ outputs */

static int reserve_out(Core *c, Py_ssize_t bytes) {
    if (c->nouts == c->cap_outs) {
        Py_ssize_t cap = c->cap_outs ? c->cap_outs * 2 : 1024;
        Out *o = realloc(c->outs, (size_t)cap * sizeof(Out));
        if (!o) return -1;
        c->outs = o;
        c->cap_outs = cap;
    }
    if (c->arena_len + bytes > c->arena_cap) {
        Py_ssize_t cap = c->arena_cap ? c->arena_cap * 2 : 1 << 18;
        while (cap < c->arena_len + bytes) cap *= 2;
        uint8_t *a = realloc(c->arena, (size_t)cap);
        if (!a) return -1;
        c->arena = a;
        c->arena_cap = cap;
    }
    return 0;
}

/* one more output: the bytes at arena offset off to key */
static int out_at(Core *c, uint64_t key, Py_ssize_t off) {
    if (reserve_out(c, 0) < 0) return -1;
    c->outs[c->nouts].key = key;
    c->outs[c->nouts].off = off;
    c->nouts++;
    return 0;
}

/* copy a packet into the arena; its offset, or -1 */
static Py_ssize_t stash(Core *c, const uint8_t *pkt) {
    if (reserve_out(c, c->size) < 0) return -1;
    Py_ssize_t off = c->arena_len;
    memcpy(c->arena + off, pkt, (size_t)c->size);
    c->arena_len += c->size;
    return off;
}

/* ------------------------------------------------------------------ the packet function */

static int expire(Core *c, Job *j, int job_id, double now) {
    uint32_t *old = malloc((j->pending.n ? j->pending.n : 1) * sizeof *old);
    if (!old) return -1;
    size_t n = 0;
    for (size_t i = 0; i < j->pending.cap; i++) {
        if (!j->pending.keys[i]) continue;
        const Pend *p = j->pending.vals[i];
        if (now - p->t0 > c->ttl) old[n++] = p->seq;
    }
    for (size_t i = 0; i < n; i++) free(map_del(&j->pending, old[i]));
    free(old);
    if (n) event(c, E_EXPIRED, job_id, (int64_t)n, 0, 0);
    return 0;
}

static int fifo_push(Job *j, uint32_t seq) {
    if (j->fifo_n == j->fifo_cap) {
        size_t cap = j->fifo_cap ? j->fifo_cap * 2 : 64;
        uint32_t *f = malloc(cap * sizeof *f);
        if (!f) return -1;
        for (size_t i = 0; i < j->fifo_n; i++) f[i] = j->fifo[(j->fifo_head + i) % j->fifo_cap];
        free(j->fifo);
        j->fifo = f;
        j->fifo_cap = cap;
        j->fifo_head = 0;
    }
    j->fifo[(j->fifo_head + j->fifo_n) % j->fifo_cap] = seq;
    j->fifo_n++;
    return 0;
}

/* One packet (ParameterServer.handle); -1 only on allocation failure. */
static int process_one(Core *c, const uint8_t *pkt, Py_ssize_t len, uint64_t src, double now) {
    if (len != c->size) {
        c->counters[N_DROPPED]++;
        event(c, E_LENGTH, 0, (int64_t)len, (int64_t)src, 0);
        return 0;
    }
    uint32_t b0 = rd32(pkt), b1 = rd32(pkt + 4), job_seq = rd32(pkt + 12);
    uint16_t word = rd16(pkt + 8), agg_index = rd16(pkt + 10);
    unsigned flags = word & 0x3Fu;
    int job_id = (int)(job_seq >> SEQ_BITS);
    if (job_id == 0) {
        c->counters[N_DROPPED]++;
        event(c, E_GARBLED, 0, (int64_t)src, 0, 0);
        return 0;
    }
    Job *j = c->jobs[job_id];
    if (!j || (flags & FLAG_ACK)) { c->counters[N_DROPPED]++; return 0; }
    int64_t *st = j->stats;
    int direct = !j->has_switch || src != j->switch_key;
    int rank = rank_lookup(j, src);
    if (direct && rank < 0) {
        c->counters[N_REJECTED]++;
        st[S_REJECTED]++;
        event(c, E_UNREGISTERED, job_id, (int64_t)src, 0, 0);
        return 0;
    }
    /* the contribution: a mask per rack (_JobState.contribution) */
    uint32_t cm[MAX_RACKS];
    int racks = j->racks;
    int bad = b1 == 0 || (racks < 32 && (b1 >> racks) != 0);
    int only = -1;           /* the one rack of a b0 != 0 packet */
    if (!bad) {
        if (b0 == 0) {
            for (int r = 0; r < racks; r++) cm[r] = (b1 >> r & 1u) ? j->rack_mask[r] : 0;
        } else if (b1 & (b1 - 1)) {
            bad = 1;
        } else {
            only = __builtin_ctz(b1);
            if (b0 & ~j->rack_mask[only]) bad = 1;
            else {
                for (int r = 0; r < racks; r++) cm[r] = 0;
                cm[only] = b0;
            }
        }
    }
    if (bad) {
        c->counters[N_DROPPED]++;
        event(c, E_BITMAPS, job_id, b0, b1, 0);
        return 0;
    }
    if (rank >= 0 && direct) {
        int mine = 0;
        if (!(flags & FLAG_EDGE)) {     /* the contribution is exactly 1 << rank */
            int rr = rank / j->rack_size;
            uint32_t bit = 1u << (rank % j->rack_size);
            mine = 1;
            for (int r = 0; r < racks; r++) if (cm[r] != (r == rr ? bit : 0u)) { mine = 0; break; }
        }
        if (!mine) {
            c->counters[N_REJECTED]++;
            st[S_REJECTED]++;
            event(c, E_WORKER, job_id, rank, b0, b1);
            return 0;
        }
    }
    st[S_PACKETS]++;
    if (direct && rank >= 0 && (!j->has_direct[rank] || j->direct_key[rank] != src)) {
        if (!j->has_direct[rank]) {
            j->has_direct[rank] = 1;
            j->direct_order[j->ndirect++] = rank;
        }
        j->direct_key[rank] = src;
        event(c, E_DIRECT, job_id, rank, (int64_t)src, 0);
    }
    if (flags & FLAG_RESEND) st[S_RESENDS]++;
    uint32_t seq = job_seq & SEQ_MASK;
    const uint8_t *kept = map_get(&j->completed, seq);
    if (kept) {
        st[S_DUPLICATES]++;
        st[S_PARAM_RESENT]++;
        if (!direct && !j->has_switch) return 0;
        Py_ssize_t off = stash(c, kept);
        if (off < 0) return -1;
        return out_at(c, direct ? src : j->switch_key, off);
    }
    Pend *p = map_get(&j->pending, seq);
    if (!p) {
        size_t bytes = sizeof(Pend) + (size_t)racks * sizeof(uint32_t) + 8 + (size_t)c->V * 16;
        p = malloc(bytes);
        if (!p) return -1;
        p->seq = seq;
        p->agg_index = agg_index;
        p->fan = (uint16_t)(word & ~0x3Fu);
        p->ecn = p->collision = p->has_float = 0;
        p->t0 = now;
        uintptr_t at = ((uintptr_t)(p + 1) + 7) & ~(uintptr_t)7;
        p->isum = (int64_t *)at;
        p->fsum = (double *)(at + (size_t)c->V * 8);
        p->have = (uint32_t *)(at + (size_t)c->V * 16);
        memset(p->have, 0, (size_t)racks * sizeof(uint32_t));
        memset(p->isum, 0, (size_t)c->V * 8);
        if (map_put(&j->pending, seq, p) < 0) { free(p); return -1; }
    }
    int overlap = 0, subset = 1;
    for (int r = 0; r < racks; r++) {
        uint32_t both = cm[r] & p->have[r];
        if (both) overlap = 1;
        if (both != cm[r]) subset = 0;
    }
    if (overlap) {
        if (subset) st[S_DUPLICATES]++;
        else {
            st[S_OVERLAPS]++;
            event(c, E_OVERLAP, job_id, seq, 0, 0);
        }
        return 0;
    }
    const uint8_t *pay = pkt + HEADER_SIZE;
    Py_ssize_t V = c->V;
    if (flags & FLAG_OVERFLOW) {
        st[S_OVERFLOW]++;
        for (Py_ssize_t k = 0; k < V; k++) {
            uint32_t bits = rd32(pay + 4 * k);
            float f;
            memcpy(&f, &bits, 4);
            if (p->has_float) p->fsum[k] += (double)f; else p->fsum[k] = (double)f;
        }
        p->has_float = 1;
    } else {
        for (Py_ssize_t k = 0; k < V; k++) p->isum[k] += (int32_t)rd32(pay + 4 * k);
    }
    if (flags & FLAG_EDGE) st[S_SWITCH_AGGREGATES]++; else st[S_RAW]++;
    if (flags & FLAG_COLLISION) { st[S_COLLISIONS]++; p->collision = 1; }
    if (flags & FLAG_ECN) p->ecn = 1;
    int full = 1;
    for (int r = 0; r < racks; r++) {
        p->have[r] |= cm[r];
        if (p->have[r] != j->rack_mask[r]) full = 0;
    }
    if (!full) return 0;
    map_del(&j->pending, seq);
    uint8_t *param = malloc((size_t)c->size);
    if (!param) { free(p); return -1; }
    unsigned out_flags = FLAG_ACK | (p->ecn ? FLAG_ECN : 0) | (p->collision ? FLAG_COLLISION : 0);
    int fan0 = j->rack_size < j->world ? j->rack_size : j->world;
    uint16_t fw = (uint16_t)(((unsigned)(fan0 & 0x1F) << 11) | ((unsigned)(racks & 0x1F) << 6) | out_flags);
    wr32(param, j->rack_mask[0]);
    wr32(param + 4, (uint32_t)((1ull << racks) - 1));
    wr16(param + 8, fw);
    wr16(param + 10, p->agg_index);
    wr32(param + 12, job_seq);
    for (Py_ssize_t k = 0; k < V; k++) {
        double d = (double)p->isum[k] / j->scale;
        if (p->has_float) d += p->fsum[k];
        float f = (float)d;
        uint32_t bits;
        memcpy(&bits, &f, 4);
        wr32(param + HEADER_SIZE + 4 * k, bits);
    }
    free(p);
    if (j->has_switch || j->ndirect) {
        Py_ssize_t off = stash(c, param);   /* copied: param may be evicted below or later in the batch */
        if (off < 0) { free(param); return -1; }
        if (j->has_switch && out_at(c, j->switch_key, off) < 0) { free(param); return -1; }
        for (int d = 0; d < j->ndirect; d++)
            if (out_at(c, j->direct_key[j->direct_order[d]], off) < 0) { free(param); return -1; }
    }
    if (map_put(&j->completed, seq, param) < 0) { free(param); return -1; }
    if (fifo_push(j, seq) < 0) return -1;
    while ((Py_ssize_t)j->fifo_n > j->keep) {
        uint32_t old = j->fifo[j->fifo_head];
        j->fifo_head = (j->fifo_head + 1) % j->fifo_cap;
        j->fifo_n--;
        free(map_del(&j->completed, old));
    }
    st[S_COMPLETED]++;
    if ((Py_ssize_t)j->pending.n > j->keep) return expire(c, j, job_id, now);
    return 0;
}

/* ------------------------------------------------------------------ Python methods */

static void Core_dealloc(Core *c) {
    for (int i = 0; i < 256; i++) job_free(c->jobs[i]);
    if (c->mu) PyThread_free_lock(c->mu);
    free(c->outs); free(c->arena);
    rx_free(&c->rxb);
    free(c->tx_msgs); free(c->tx_iov); free(c->tx_addr); free(c->tx_ctrl);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static int Core_init(Core *c, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"value_count", "pending_ttl", NULL};
    Py_ssize_t V;
    double ttl;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nd", kwlist, &V, &ttl)) return -1;
    if (V < 0 || V > 1 << 20) { PyErr_SetString(PyExc_ValueError, "value_count out of range"); return -1; }
    if (c->mu) { PyErr_SetString(PyExc_RuntimeError, "Core is initialized once"); return -1; }
    c->mu = PyThread_allocate_lock();
    if (!c->mu) { PyErr_NoMemory(); return -1; }
    c->V = V;
    c->size = HEADER_SIZE + 4 * V;
    c->ttl = ttl;
    c->gso = 1;
    c->log_level = 100;
    return 0;
}

static PyObject *Core_add_job(Core *c, PyObject *args) {
    int job_id, world, rack_size, has_switch;
    double scale;
    Py_ssize_t keep;
    unsigned long long switch_key;
    PyObject *o_workers;
    if (!PyArg_ParseTuple(args, "iiidnpKO", &job_id, &world, &rack_size, &scale, &keep, &has_switch, &switch_key,
                          &o_workers))
        return NULL;
    if (job_id < 1 || job_id > 255 || rack_size < 1 || rack_size > 32 || world < 1 || world > rack_size * MAX_RACKS
        || keep < 0 || !(scale > 0)) {
        PyErr_SetString(PyExc_ValueError, "add_job: job id, world, rack size, keep or scale out of range");
        return NULL;
    }
    Py_buffer wb;
    if (PyObject_GetBuffer(o_workers, &wb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    if (wb.itemsize != 8 || (wb.len / 8 != 0 && wb.len / 8 != world)) {
        PyBuffer_Release(&wb);
        PyErr_SetString(PyExc_ValueError, "add_job: worker_keys must be uint64, none or one per rank");
        return NULL;
    }
    Py_ssize_t nw = wb.len / 8;
    Job *j = calloc(1, sizeof *j);
    if (!j) { PyBuffer_Release(&wb); return PyErr_NoMemory(); }
    j->world = world;
    j->rack_size = rack_size;
    j->racks = (world + rack_size - 1) / rack_size;
    j->scale = scale;
    j->keep = keep;
    j->has_switch = has_switch;
    j->switch_key = switch_key;
    for (int r = 0; r < j->racks; r++) {
        int n = world - r * rack_size < rack_size ? world - r * rack_size : rack_size;
        j->rack_mask[r] = (uint32_t)((1ull << n) - 1);
    }
    j->rank_keys = malloc((size_t)(nw ? nw : 1) * sizeof(uint64_t));
    j->rank_of = malloc((size_t)(nw ? nw : 1) * sizeof(int));
    j->direct_key = calloc((size_t)world, sizeof(uint64_t));
    j->has_direct = calloc((size_t)world, 1);
    j->direct_order = calloc((size_t)world, sizeof(int));
    if (!j->rank_keys || !j->rank_of || !j->direct_key || !j->has_direct || !j->direct_order) {
        PyBuffer_Release(&wb);
        job_free(j);
        return PyErr_NoMemory();
    }
    /* sorted by key; a repeated address maps to its last rank, as {a: r for r, a in enumerate(...)} */
    const uint64_t *keys = wb.buf;
    for (Py_ssize_t r = 0; r < nw; r++) {
        Py_ssize_t pos = 0;
        while (pos < j->nranks && j->rank_keys[pos] < keys[r]) pos++;
        if (pos < j->nranks && j->rank_keys[pos] == keys[r]) { j->rank_of[pos] = (int)r; continue; }
        memmove(j->rank_keys + pos + 1, j->rank_keys + pos, (size_t)(j->nranks - pos) * sizeof(uint64_t));
        memmove(j->rank_of + pos + 1, j->rank_of + pos, (size_t)(j->nranks - pos) * sizeof(int));
        j->rank_keys[pos] = keys[r];
        j->rank_of[pos] = (int)r;
        j->nranks++;
    }
    PyBuffer_Release(&wb);
    swap_job(c, job_id, j);
    Py_RETURN_NONE;
}

static PyObject *Core_remove_job(Core *c, PyObject *args) {
    int job_id;
    if (!PyArg_ParseTuple(args, "i", &job_id)) return NULL;
    if (job_id >= 0 && job_id < 256) swap_job(c, job_id, NULL);
    Py_RETURN_NONE;
}

static Job *job_arg(Core *c, PyObject *args) {
    int job_id;
    if (!PyArg_ParseTuple(args, "i", &job_id)) return NULL;
    if (job_id < 0 || job_id > 255 || !c->jobs[job_id]) {
        PyErr_SetObject(PyExc_KeyError, PyLong_FromLong(job_id));
        return NULL;
    }
    return c->jobs[job_id];
}

/* stats(job_id) -> (the 11 counters of PSJobStats in order, [direct ranks]) */
static PyObject *stats_locked(Core *c, PyObject *args) {
    Job *j = job_arg(c, args);
    if (!j) return NULL;
    PyObject *counts = PyTuple_New(S_COUNT), *ranks = PyList_New(j->ndirect);
    if (!counts || !ranks) { Py_XDECREF(counts); Py_XDECREF(ranks); return NULL; }
    for (int i = 0; i < S_COUNT; i++) PyTuple_SET_ITEM(counts, i, PyLong_FromLongLong(j->stats[i]));
    for (int d = 0; d < j->ndirect; d++) PyList_SET_ITEM(ranks, d, PyLong_FromLong(j->direct_order[d]));
    return Py_BuildValue("(NN)", counts, ranks);
}

/* state(job_id) -> ({seq: (have per rack, int sums bytes, float sums bytes or None, ecn, collision,
 *                   agg_index, fan, t0)}, [(seq, param bytes)] oldest first, [(rank, key)] in order) */
static PyObject *state_locked(Core *c, PyObject *args) {
    Job *j = job_arg(c, args);
    if (!j) return NULL;
    PyObject *pend = PyDict_New(), *done = PyList_New(0), *direct = PyList_New(0);
    if (!pend || !done || !direct) goto fail;
    for (size_t i = 0; i < j->pending.cap; i++) {
        if (!j->pending.keys[i]) continue;
        Pend *p = j->pending.vals[i];
        PyObject *have = PyList_New(j->racks);
        if (!have) goto fail;
        for (int r = 0; r < j->racks; r++) PyList_SET_ITEM(have, r, PyLong_FromUnsignedLong(p->have[r]));
        PyObject *fs = p->has_float ? PyBytes_FromStringAndSize((const char *)p->fsum, c->V * 8)
                                    : Py_NewRef(Py_None);
        PyObject *v = Py_BuildValue("(Ny#NiiiId)", have, (const char *)p->isum, c->V * 8, fs, p->ecn,
                                    p->collision, (int)p->agg_index, (unsigned)p->fan, p->t0);
        PyObject *k = PyLong_FromUnsignedLong(p->seq);
        if (!v || !k || PyDict_SetItem(pend, k, v) < 0) { Py_XDECREF(v); Py_XDECREF(k); goto fail; }
        Py_DECREF(v); Py_DECREF(k);
    }
    for (size_t i = 0; i < j->fifo_n; i++) {
        uint32_t seq = j->fifo[(j->fifo_head + i) % j->fifo_cap];
        const uint8_t *param = map_get(&j->completed, seq);
        PyObject *t = Py_BuildValue("(Iy#)", seq, (const char *)param, c->size);
        if (!t || PyList_Append(done, t) < 0) { Py_XDECREF(t); goto fail; }
        Py_DECREF(t);
    }
    for (int d = 0; d < j->ndirect; d++) {
        int r = j->direct_order[d];
        PyObject *t = Py_BuildValue("(iK)", r, (unsigned long long)j->direct_key[r]);
        if (!t || PyList_Append(direct, t) < 0) { Py_XDECREF(t); goto fail; }
        Py_DECREF(t);
    }
    return Py_BuildValue("(NNN)", pend, done, direct);
fail:
    Py_XDECREF(pend); Py_XDECREF(done); Py_XDECREF(direct);
    return NULL;
}

static PyObject *Core_stats(Core *c, PyObject *args) {
    lock_core(c);
    PyObject *r = stats_locked(c, args);
    unlock_core(c);
    return r;
}

static PyObject *Core_state(Core *c, PyObject *args) {
    lock_core(c);
    PyObject *r = state_locked(c, args);
    unlock_core(c);
    return r;
}

/* take_counters() -> (dropped, rejected, sent, refused, lost events) since the last call */
static PyObject *Core_take_counters(Core *c, PyObject *Py_UNUSED(args)) {
    lock_core(c);
    PyObject *t = Py_BuildValue("(LLLLL)", (long long)c->counters[0], (long long)c->counters[1],
                                (long long)c->counters[2], (long long)c->counters[3], (long long)c->counters[4]);
    if (t) memset(c->counters, 0, sizeof c->counters);
    unlock_core(c);
    return t;
}

static PyObject *take_events_locked(Core *c) {
    PyObject *res = PyList_New(c->nevents);
    if (!res) return NULL;
    for (int i = 0; i < c->nevents; i++) {
        const Event *e = &c->events[i];
        PyObject *t = Py_BuildValue("(iiLLL)", e->kind, e->job, (long long)e->a, (long long)e->b, (long long)e->c);
        if (!t) { Py_DECREF(res); return NULL; }
        PyList_SET_ITEM(res, i, t);
    }
    c->nevents = 0;
    return res;
}

/* take_events() -> [(kind, job, a, b, c)] recorded since the last call */
static PyObject *Core_take_events(Core *c, PyObject *Py_UNUSED(args)) {
    lock_core(c);
    PyObject *r = take_events_locked(c);
    unlock_core(c);
    return r;
}

static PyObject *outputs_list(Core *c) {
    PyObject *res = PyList_New(c->nouts);
    if (!res) return NULL;
    for (Py_ssize_t i = 0; i < c->nouts; i++) {
        PyObject *t = Py_BuildValue("(Ky#)", (unsigned long long)c->outs[i].key,
                                    (const char *)(c->arena + c->outs[i].off), c->size);
        if (!t) { Py_DECREF(res); return NULL; }
        PyList_SET_ITEM(res, i, t);
    }
    return res;
}

/* process(rows, lengths, keys, now, log_level): rows of a 2-D uint8 buffer, int64 lengths, uint64 keys */
static PyObject *Core_process(Core *c, PyObject *args) {
    PyObject *o_rows, *o_len, *o_keys;
    double now;
    int level;
    if (!PyArg_ParseTuple(args, "OOOdi", &o_rows, &o_len, &o_keys, &now, &level)) return NULL;
    Py_buffer rows, lb, kb;
    if (PyObject_GetBuffer(o_rows, &rows, PyBUF_ND | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (PyObject_GetBuffer(o_len, &lb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) { PyBuffer_Release(&rows); return NULL; }
    if (PyObject_GetBuffer(o_keys, &kb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&rows);
        PyBuffer_Release(&lb);
        return NULL;
    }
    PyObject *res = NULL;
    Py_ssize_t n = lb.len / 8;
    if (rows.ndim != 2 || rows.itemsize != 1 || rows.shape[0] < n || lb.itemsize != 8 || kb.itemsize != 8
        || kb.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "process: expected a 2-D uint8 row matrix, int64 lengths and uint64 keys "
                                          "of one length");
        goto done;
    }
    Py_ssize_t width = rows.shape[1];
    const int64_t *lengths = lb.buf;
    const uint64_t *keys = kb.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (lengths[i] < 0 || lengths[i] > width) {
            PyErr_Format(PyExc_ValueError, "lengths[%zd] = %lld exceeds the row", i, (long long)lengths[i]);
            goto done;
        }
    }
    lock_core(c);
    c->log_level = level;
    c->nouts = 0;
    c->arena_len = 0;
    int nomem = 0;
    for (Py_ssize_t i = 0; i < n && !nomem; i++)
        nomem = process_one(c, (const uint8_t *)rows.buf + i * width, (Py_ssize_t)lengths[i], keys[i], now) < 0;
    res = nomem ? PyErr_NoMemory() : outputs_list(c);
    unlock_core(c);
done:
    PyBuffer_Release(&rows);
    PyBuffer_Release(&lb);
    PyBuffer_Release(&kb);
    return res;
}

/* room for a batch of datagrams one byte longer than a packet (an oversize one shows as too long) */
static int ensure_rx(Core *c, Py_ssize_t batch) { return rx_reserve(&c->rxb, batch, c->size + 1); }

static int ensure_tx(Core *c, Py_ssize_t n) {
    if (n <= c->tx_cap) return 0;
    struct mmsghdr *m = realloc(c->tx_msgs, (size_t)n * sizeof *m);
    if (m) c->tx_msgs = m;
    struct iovec *v = realloc(c->tx_iov, (size_t)n * sizeof *v);
    if (v) c->tx_iov = v;
    struct sockaddr_in *a = realloc(c->tx_addr, (size_t)n * sizeof *a);
    if (a) c->tx_addr = a;
    uint8_t *ctl = realloc(c->tx_ctrl, (size_t)n * CTRL_SPACE);
    if (ctl) c->tx_ctrl = ctl;
    if (!m || !v || !a || !ctl) return -1;
    c->tx_cap = n;
    return 0;
}

/* Send the outputs in order (as RowIO.send of the Python loop): runs of consecutive outputs to one
 * destination go as UDP GSO trains. Outputs to non-IPv4 keys are skipped. -1 (errno) on a socket error. */
static int send_outputs(Core *c, int fd) {
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < c->nouts; i++)
        if (c->outs[i].key < NAME_KEYS) c->outs[n++] = c->outs[i];
    Py_ssize_t start = 0;
    for (;;) {
        Py_ssize_t per_train = gso_per_train(c->gso, c->size);
        Py_ssize_t nmsg = 0, i = start;
        while (i < n) {
            Py_ssize_t k = 0;
            uint64_t key = c->outs[i].key;
            struct msghdr *h = &c->tx_msgs[nmsg].msg_hdr;
            memset(h, 0, sizeof *h);
            h->msg_iov = &c->tx_iov[i];
            struct sockaddr_in *to = &c->tx_addr[nmsg];
            memset(to, 0, sizeof *to);
            to->sin_family = AF_INET;
            to->sin_addr.s_addr = htonl((uint32_t)(key >> 16));
            to->sin_port = htons((uint16_t)(key & 0xFFFF));
            h->msg_name = to;
            h->msg_namelen = sizeof *to;
            while (i + k < n && k < per_train && c->outs[i + k].key == key) {
                c->tx_iov[i + k].iov_base = c->arena + c->outs[i + k].off;
                c->tx_iov[i + k].iov_len = (size_t)c->size;
                k++;
            }
            h->msg_iovlen = (size_t)k;
            if (k > 1) gso_option(h, c->tx_ctrl + nmsg * CTRL_SPACE, (uint16_t)c->size);
            nmsg++;
            i += k;
        }
        Py_ssize_t failed = 0;
        int r = udp_send_all(fd, c->tx_msgs, nmsg, &c->counters[N_SENT], &c->counters[N_REFUSED], &failed);
        if (r <= 0) return r;
        c->gso = 0;      /* GSO refused: plain datagrams from the refused train on, and for good */
        start = (Py_ssize_t)(c->tx_msgs[failed].msg_hdr.msg_iov - c->tx_iov);
    }
}

#define SERVE_ROUNDS 64      /* batches per wake-up, as the Python loop */

/* serve(fd, max_batch, log_level, timeout_ms): wait for the socket (a negative timeout: do not wait),
 * then receive, process and send batches until none is waiting (at most SERVE_ROUNDS); the count received */
static PyObject *Core_serve(Core *c, PyObject *args) {
    int fd, level, timeout;
    Py_ssize_t batch;
    if (!PyArg_ParseTuple(args, "inii", &fd, &batch, &level, &timeout)) return NULL;
    if (batch < 1) { PyErr_SetString(PyExc_ValueError, "max_batch must be >= 1"); return NULL; }
    lock_core(c);
    int ok = ensure_rx(c, batch) == 0;
    unlock_core(c);
    if (!ok) return PyErr_NoMemory();
    long total = 0;
    int err = 0, nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    int ready = 1;
    if (timeout >= 0) {
        struct pollfd pfd = {.fd = fd, .events = POLLIN, .revents = 0};
        int r = poll(&pfd, 1, timeout);
        if (r < 0 && errno != EINTR) err = errno;
        ready = r > 0;
    }
    if (ready && !err) {
        PyThread_acquire_lock(c->mu, WAIT_LOCK);
        c->log_level = level;
        for (int round = 0; round < SERVE_ROUNDS; round++) {
            int k = rx_receive(&c->rxb, fd, batch, &c->counters[N_REFUSED]);
            if (k < 0) { err = errno; break; }
            if (k == 0) break;
            total += k;
            double now = monotonic_now();
            c->nouts = 0;
            c->arena_len = 0;
            for (int i = 0; i < k; i++) {
                uint64_t key = 0;       /* (0: no IPv4 sender; no job's switch or worker has that key) */
                rx_sender(&c->rxb, i, &key);
                if (process_one(c, rx_data(&c->rxb, i), rx_length(&c->rxb, i), key, now) < 0) {
                    nomem = 1;
                    break;
                }
            }
            if (!nomem && c->nouts) {
                if (ensure_tx(c, c->nouts) < 0) nomem = 1;
                else if (send_outputs(c, fd) < 0) err = errno;
            }
            if (nomem || err || k < batch) break;
        }
        PyThread_release_lock(c->mu);
    }
    Py_END_ALLOW_THREADS
    if (nomem) return PyErr_NoMemory();
    if (err) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    return PyLong_FromLong(total);
}

static PyObject *Core_set_gso(Core *c, PyObject *args) {
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    lock_core(c);
    c->gso = on;
    unlock_core(c);
    Py_RETURN_NONE;
}

static PyObject *Core_gso(Core *c, PyObject *Py_UNUSED(args)) { return PyBool_FromLong(c->gso); }

static PyMethodDef Core_methods[] = {
    {"add_job", (PyCFunction)Core_add_job, METH_VARARGS,
     "add_job(job_id, world, rack_size, scale, keep, has_switch, switch_key, worker_keys): serve a job (fresh state)"},
    {"remove_job", (PyCFunction)Core_remove_job, METH_VARARGS, "remove_job(job_id): forget a job and its state"},
    {"stats", (PyCFunction)Core_stats, METH_VARARGS, "stats(job_id) -> (counters, direct ranks)"},
    {"state", (PyCFunction)Core_state, METH_VARARGS, "state(job_id) -> (pending, completed, direct)"},
    {"take_counters", (PyCFunction)Core_take_counters, METH_NOARGS,
     "take_counters() -> (dropped, rejected, sent, refused, lost events), then zero them"},
    {"take_events", (PyCFunction)Core_take_events, METH_NOARGS, "take_events() -> [(kind, job, a, b, c)]"},
    {"process", (PyCFunction)Core_process, METH_VARARGS,
     "process(rows, lengths, keys, now, log_level) -> [(key, bytes)]: the packet function"},
    {"serve", (PyCFunction)Core_serve, METH_VARARGS,
     "serve(fd, max_batch, log_level, timeout_ms) -> int: wait, then receive, process and send batches"},
    {"set_gso", (PyCFunction)Core_set_gso, METH_VARARGS, "set_gso(on): send runs to one destination as GSO trains"},
    {"gso", (PyCFunction)Core_gso, METH_NOARGS, "gso() -> bool"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "innet._pscore.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The compiled packet path of the ATP parameter server (see innet/pscore.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Core_init,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
};

static struct PyModuleDef pscore_module = {
    PyModuleDef_HEAD_INIT, "innet._pscore", "The compiled packet path of the ATP parameter server.", -1, NULL,
};

PyMODINIT_FUNC PyInit__pscore(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&pscore_module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "STAT_COUNT", S_COUNT);
    return m;
}
