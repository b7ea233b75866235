/* What the compiled innet extensions (_fastpath.c, _pscore.c, _hostio.c) share: the ATP header's
 * constants and byte order, batched UDP receiving, and batched sending with GSO trains. Every function
 * is static (each extension gets its own copy; nothing is exported). Uses only libc; include it after
 * Python.h (it uses Py_ssize_t). setup.py lists it in each extension's depends.
 *
 * The wire format itself is defined in innet/wire.py; the constants here must match it
 * (tests/innet/test_fastpath.py and tests/innet/test_ps_core.py compare the compiled paths with the
 * Python references packet by packet).
 */
#ifndef TWISTERNET_INNET_ATP_UDP_H
#define TWISTERNET_INNET_ATP_UDP_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

/* ------------------------------------------------------------------ the ATP header (innet/wire.py) */
#define HEADER_SIZE 16
#define SEQ_BITS 24
#define SEQ_MASK ((1u << SEQ_BITS) - 1)
#define FLAG_OVERFLOW (1u << 5)
#define FLAG_RESEND (1u << 4)
#define FLAG_COLLISION (1u << 3)
#define FLAG_ECN (1u << 2)
#define FLAG_EDGE (1u << 1)
#define FLAG_ACK (1u << 0)

/* big-endian fields */
static inline uint32_t rd32(const uint8_t *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}
static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(((unsigned)p[0] << 8) | p[1]); }
static inline void wr32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8); p[3] = (uint8_t)v;
}
static inline void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }

static inline double monotonic_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------ UDP GSO trains */
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#define GSO_MAX_SEGMENTS 64      /* the kernel's UDP_MAX_SEGMENTS on every kernel with UDP_SEGMENT */
#define GSO_MAX_BYTES 65000      /* below the 65507-byte UDP payload limit */
/* the control space of one message's UDP_SEGMENT option */
#define CTRL_SPACE CMSG_SPACE(sizeof(uint16_t))

/* Datagrams of `size` bytes per GSO train: 1 without GSO (or when two do not fit). */
static inline Py_ssize_t gso_per_train(int gso, Py_ssize_t size) {
    Py_ssize_t per_train = gso ? GSO_MAX_BYTES / size : 1;
    if (per_train > GSO_MAX_SEGMENTS) per_train = GSO_MAX_SEGMENTS;
    return per_train < 2 ? 1 : per_train;
}

/* Make message `h` a GSO train of `seg`-byte datagrams, its option written into `ctl` (CTRL_SPACE bytes). */
static inline void gso_option(struct msghdr *h, uint8_t *ctl, uint16_t seg) {
    memset(ctl, 0, CTRL_SPACE);
    h->msg_control = ctl;
    h->msg_controllen = CTRL_SPACE;
    struct cmsghdr *cm = CMSG_FIRSTHDR(h);
    cm->cmsg_level = SOL_UDP;
    cm->cmsg_type = UDP_SEGMENT;
    cm->cmsg_len = CMSG_LEN(sizeof(uint16_t));
    memcpy(CMSG_DATA(cm), &seg, sizeof seg);
}

/* sendmmsg messages [0, nmsg), adding the datagrams sent to *sent and the ECONNREFUSED ones to
 * *refused. A datagram (train) the kernel will not take now (buffer full, refused, unreachable) is
 * dropped, as UdpTransport.send drops it. Returns 0; 1 when a GSO train was refused as unsupported
 * (an old kernel, or a train too big for the route's MTU: messages from *first_failed on are unsent);
 * -1 (errno set) on any other error. */
static inline int udp_send_all(int fd, struct mmsghdr *msgs, Py_ssize_t nmsg, int64_t *sent, int64_t *refused,
                               Py_ssize_t *first_failed) {
    Py_ssize_t i = 0;
    while (i < nmsg) {
        int k = sendmmsg(fd, msgs + i, (unsigned)(nmsg - i > 1024 ? 1024 : nmsg - i), 0);
        if (k > 0) {
            for (int j = 0; j < k; j++) *sent += (int64_t)msgs[i + j].msg_hdr.msg_iovlen;
            i += k;
            continue;
        }
        if (k == 0) { i++; continue; }
        if (errno == EINTR) continue;
        if (msgs[i].msg_hdr.msg_controllen
            && (errno == EINVAL || errno == EOPNOTSUPP || errno == EIO || errno == EMSGSIZE || errno == ENOPROTOOPT)) {
            *first_failed = i;
            return 1;
        }
        if (errno == ECONNREFUSED) { (*refused)++; i++; continue; }
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS || errno == EHOSTUNREACH
            || errno == ENETUNREACH) { i++; continue; }
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ batched receiving */
/* Memory for up to `cap` datagrams of `width` bytes (a core passes its packet size + 1: a datagram
 * longer than a packet then shows as too long) and their IPv4 senders. Zero-initialised before use. */
typedef struct {
    uint8_t *buf;               /* datagram i at buf + i * width */
    struct mmsghdr *msgs;
    struct iovec *iov;
    struct sockaddr_in *addr;
    Py_ssize_t cap, width;
} RxBatch;

/* Room for `batch` datagrams of `width` bytes: 0, or -1 out of memory (what was had is kept). */
static inline int rx_reserve(RxBatch *b, Py_ssize_t batch, Py_ssize_t width) {
    if (batch <= b->cap && width == b->width) return 0;
    uint8_t *buf = realloc(b->buf, (size_t)(batch * width));
    if (buf) b->buf = buf;
    struct mmsghdr *m = realloc(b->msgs, (size_t)batch * sizeof *m);
    if (m) b->msgs = m;
    struct iovec *v = realloc(b->iov, (size_t)batch * sizeof *v);
    if (v) b->iov = v;
    struct sockaddr_in *a = realloc(b->addr, (size_t)batch * sizeof *a);
    if (a) b->addr = a;
    if (!buf || !m || !v || !a) return -1;
    b->cap = batch;
    b->width = width;
    return 0;
}

static inline void rx_free(RxBatch *b) {
    free(b->buf); free(b->msgs); free(b->iov); free(b->addr);
    memset(b, 0, sizeof *b);
}

/* recvmmsg up to `batch` (<= cap) datagrams without blocking: the count, 0 when none, -1 (errno) on
 * error; ECONNREFUSED (an ICMP error queued on the socket) is counted in *refused and skipped. */
static inline int rx_receive(RxBatch *b, int fd, Py_ssize_t batch, int64_t *refused) {
    for (Py_ssize_t i = 0; i < batch; i++) {
        b->iov[i].iov_base = b->buf + i * b->width;
        b->iov[i].iov_len = (size_t)b->width;
        memset(&b->msgs[i].msg_hdr, 0, sizeof(struct msghdr));
        b->msgs[i].msg_hdr.msg_iov = &b->iov[i];
        b->msgs[i].msg_hdr.msg_iovlen = 1;
        b->msgs[i].msg_hdr.msg_name = &b->addr[i];
        b->msgs[i].msg_hdr.msg_namelen = sizeof(struct sockaddr_in);
    }
    for (;;) {
        int k = recvmmsg(fd, b->msgs, (unsigned)batch, MSG_DONTWAIT, NULL);
        if (k >= 0) return k;
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
        if (errno == ECONNREFUSED) { (*refused)++; continue; }
        return -1;
    }
}

static inline uint8_t *rx_data(const RxBatch *b, Py_ssize_t i) { return b->buf + i * b->width; }
static inline Py_ssize_t rx_length(const RxBatch *b, Py_ssize_t i) { return (Py_ssize_t)b->msgs[i].msg_len; }

/* Datagram i's sender as ip << 16 | port (innet.hostio.addr_key) in *key: 1, or 0 if not IPv4. */
static inline int rx_sender(const RxBatch *b, Py_ssize_t i, uint64_t *key) {
    const struct sockaddr_in *a = &b->addr[i];
    if (b->msgs[i].msg_hdr.msg_namelen < sizeof(struct sockaddr_in) || a->sin_family != AF_INET) return 0;
    *key = ((uint64_t)ntohl(a->sin_addr.s_addr) << 16) | ntohs(a->sin_port);
    return 1;
}

#endif
