/* What the compiled innet extensions (_fastpath.c, _pscore.c, _hostio.c) share: the ATP header's
 * constants and byte order, and batched UDP sending with GSO trains. Every function is static (each
 * extension gets its own copy; nothing is exported). Uses only libc; include it after Python.h (it
 * uses Py_ssize_t). setup.py lists it in each extension's depends.
 *
 * The wire format itself is defined in innet/wire.py; the constants here must match it
 * (tests/innet/test_fastpath.py and tests/innet/test_ps_core.py compare the compiled paths with the
 * Python references packet by packet).
 */
#ifndef TWISTERNET_INNET_ATP_UDP_H
#define TWISTERNET_INNET_ATP_UDP_H

#include <errno.h>
#include <netinet/udp.h>
#include <stdint.h>
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
static int udp_send_all(int fd, struct mmsghdr *msgs, Py_ssize_t nmsg, int64_t *sent, int64_t *refused,
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

#endif
