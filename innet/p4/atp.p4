/* -*- P4_16 -*- */
/*
 * ATP in-network gradient aggregation (Lao et al., NSDI 2021) for the v1model architecture (BMv2).
 *
 * This is the program a hardware or BMv2 switch would run; innet/switch.py is the software switch that
 * behaves the same way, and innet/p4/atp.p4info.txtpb is its P4Info (kept in step by hand: there is
 * no p4c on the build machine; tests/innet/test_p4_program.py checks names and shapes). Controllers
 * program it over P4Runtime (innet/p4runtime/).
 *
 * Packet: Ethernet / IPv4 / UDP (dst port ATP_UDP_PORT) / ATP header (16 bytes) / VALUE_COUNT int32.
 * ATP header, big-endian, in this order:
 *     bitmap0 (32)  contributions aggregated at the worker-rack ToR (level 0)
 *     bitmap1 (32)  contributions aggregated at the PS-rack ToR (level 1)
 *     fan_in0 (5), fan_in1 (5)  fan-in degrees of the two levels (0 encodes 32)
 *     overflow, resend, collision, ecn, edge_switch_id, is_ack (1 bit each)
 *     agg_index (16)  aggregator slot chosen by the worker (hash of job+sequence)
 *     job_seq (32)    jobID (top JOB_ID_BITS) + sequence number; 0 never names a job fragment
 *
 * Source check (before anything else touches state): a parameter (ACK) packet must enter on the
 * job's ps_port and a gradient packet on a port listed for the job in member_table; anything else is
 * dropped and counted in `rejected`.
 * Same per-packet semantics as the software switch (innet/switch.py), at slot agg_index:
 *   - parameter (ACK): frees the slot if it holds that job+sequence; multicast to the job's mcast_grp.
 *   - resend: never reserves nor adds; if the slot holds its job+sequence the held aggregate is flushed
 *     to the PS (resend set) and the slot freed, and the resend packet itself also goes to the PS.
 *   - eligibility: level 0 aggregates packets with edge_switch_id, overflow and collision clear, keyed
 *     by bitmap0; level 1 only complete rack aggregates (edge_switch_id set, popcount(bitmap0) ==
 *     fan_in0), keyed by bitmap1. Anything else goes to the PS port unchanged.
 *   - a free (or stale) slot is reserved; one held by another live fragment is a collision (collision
 *     flag set, packet to the PS); a key already fully in the bitmap is a duplicate (dropped), a partial
 *     overlap goes to the PS.
 *   - aggregate: saturating int32 adds, bitmap |= key, counter += popcount(key), ECN OR-ed.
 *   - counter >= fan_in: the aggregate goes to ps_port with edge_switch_id set (level 0: bitmap0 =
 *     workers; level 1: bitmap0 = 0, bitmap1 = racks); the slot stays held until the parameter packet.
 * Egress marks ECN when the queue depth exceeds the ecn_threshold register and rewrites the IPv4/UDP
 * destination to the node behind the egress port (port_table).
 * Deployment note: the resend path uses an ingress-to-egress clone with session ps_port + 1, which a
 * BMv2 deployment maps to port ps_port (one clone session per PS port; P4Runtime clone sessions are
 * not exposed by this control plane). ECN is marked at egress from enq_qdepth, where v1model exposes
 * the queue; the software switch marks at ingress from its receive queue.
 */
#include <core.p4>
#include <v1model.p4>

/* ---------------------------------------------------------------- constants */
const bit<16> ETHERTYPE_IPV4   = 0x0800;
const bit<8>  IP_PROTO_UDP     = 17;
const bit<16> ATP_UDP_PORT     = 9000;     /* UDP port of ATP traffic at a switch */
#define VALUE_COUNT 62                      /* int32 values per packet (248 bytes, as the paper) */
#define NUM_AGGREGATORS 65536               /* one slot per value of the 16-bit agg_index */
#define JOB_ID_BITS 8                       /* job_seq = jobID (8 bits) . sequence number (24 bits) */
const bit<48> STALE_US         = 2000000;   /* a slot untouched for 2 s may be reclaimed */

typedef bit<9>  port_t;

/* ---------------------------------------------------------------- headers */
header ethernet_t {
    bit<48> dst_addr;
    bit<48> src_addr;
    bit<16> ether_type;
}

header ipv4_t {
    bit<4>  version;
    bit<4>  ihl;
    bit<6>  dscp;
    bit<2>  ecn;
    bit<16> total_len;
    bit<16> identification;
    bit<3>  flags;
    bit<13> frag_offset;
    bit<8>  ttl;
    bit<8>  protocol;
    bit<16> hdr_checksum;
    bit<32> src_addr;
    bit<32> dst_addr;
}

header udp_t {
    bit<16> src_port;
    bit<16> dst_port;
    bit<16> len;
    bit<16> checksum;
}

header atp_t {
    bit<32> bitmap0;
    bit<32> bitmap1;
    bit<5>  fan_in0;
    bit<5>  fan_in1;
    bit<1>  overflow;
    bit<1>  resend;
    bit<1>  collision;
    bit<1>  ecn;
    bit<1>  edge_switch_id;
    bit<1>  is_ack;
    bit<16> agg_index;
    bit<32> job_seq;
}

header atp_value_t {
    bit<32> v;                              /* int32, two's complement */
}

struct headers_t {
    ethernet_t                 ethernet;
    ipv4_t                     ipv4;
    udp_t                      udp;
    atp_t                      atp;
    atp_value_t[VALUE_COUNT]   values;
}

struct metadata_t {
    bit<8>  lanes_parsed;
    bit<JOB_ID_BITS> job_id;
    bit<1>  job_known;
    bit<1>  member;                         /* member_table hit: the ingress port may send this job's gradients */
    bit<32> member_key;                     /* job_id ++ ingress port, the key of member_table */
    bit<6>  fan_in;                         /* 1..32 */
    port_t  ps_port;
    bit<16> mcast_grp;
    bit<1>  level;
    bit<1>  eligible;                       /* this level aggregates the packet */
    bit<32> key;                            /* the packet's contribution bitmap at this level */
    bit<32> pop_in;                         /* popcount() operand and result */
    bit<32> pop_out;
    bit<32> index;                          /* aggregator slot */
    bit<32> base;                           /* index * VALUE_COUNT: first lane in agg_values */
    bit<32> held;                           /* agg_job_seq[index] */
    bit<32> bitmap;                         /* agg_bitmap[index] */
    bit<8>  count;                          /* agg_counter[index] */
    bit<1>  agg_ecn;                        /* agg_ecn[index] */
    bit<48> ts;                             /* agg_timestamp[index] */
    bit<32> collided;                       /* agg_collided[index] */
}

/* ---------------------------------------------------------------- parser */
parser AtpParser(packet_in packet, out headers_t hdr, inout metadata_t meta,
                 inout standard_metadata_t std) {
    state start {
        packet.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
            default: accept;
        }
    }
    state parse_ipv4 {
        packet.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.protocol) {
            (4w5, IP_PROTO_UDP): parse_udp;
            default: accept;
        }
    }
    state parse_udp {
        packet.extract(hdr.udp);
        transition select(hdr.udp.dst_port) {
            ATP_UDP_PORT: parse_atp;
            default: accept;
        }
    }
    state parse_atp {
        packet.extract(hdr.atp);
        meta.lanes_parsed = 0;
        transition parse_values;
    }
    state parse_values {
        packet.extract(hdr.values.next);
        meta.lanes_parsed = meta.lanes_parsed + 1;
        transition select(meta.lanes_parsed) {
            VALUE_COUNT: accept;
            default: parse_values;
        }
    }
}

control AtpVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

/* Apply M to every lane index 0 .. VALUE_COUNT-1 (P4_16 has no loops over header stacks). */
#define FOR_EACH_LANE(M) \
    M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7) M(8) M(9) M(10) M(11) M(12) M(13) M(14) M(15) \
    M(16) M(17) M(18) M(19) M(20) M(21) M(22) M(23) M(24) M(25) M(26) M(27) M(28) M(29) M(30) \
    M(31) M(32) M(33) M(34) M(35) M(36) M(37) M(38) M(39) M(40) M(41) M(42) M(43) M(44) M(45) \
    M(46) M(47) M(48) M(49) M(50) M(51) M(52) M(53) M(54) M(55) M(56) M(57) M(58) M(59) M(60) M(61)

#define LANE_STORE(i) agg_values.write(meta.base + i, hdr.values[i].v);
#define LANE_LOAD(i)  agg_values.read(hdr.values[i].v, meta.base + i);
#define LANE_ADD(i) \
    agg_values.read(cur, meta.base + i); \
    cur = (bit<32>)((int<32>)cur |+| (int<32>)hdr.values[i].v); \
    agg_values.write(meta.base + i, cur); \
    hdr.values[i].v = cur;

/* ---------------------------------------------------------------- ingress */
control AtpIngress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t std) {

    /* Counters (indirect, one cell each), read over P4Runtime as CounterEntry. */
    counter(1, CounterType.packets) aggregated;
    counter(1, CounterType.packets) forwarded;
    counter(1, CounterType.packets) collisions;
    counter(1, CounterType.packets) resends;
    counter(1, CounterType.packets) acks;
    counter(1, CounterType.packets) dropped;
    counter(1, CounterType.packets) rejected;

    /* Aggregator state, one cell per slot (agg_values: VALUE_COUNT cells per slot). */
    register<bit<32>>(NUM_AGGREGATORS) agg_job_seq;
    register<bit<32>>(NUM_AGGREGATORS) agg_bitmap;
    register<bit<8>>(NUM_AGGREGATORS)  agg_counter;
    register<bit<1>>(NUM_AGGREGATORS)  agg_ecn;
    register<bit<48>>(NUM_AGGREGATORS) agg_timestamp;
    /* jobID+seq whose packet last collided at the slot: its later packets follow it to the PS */
    register<bit<32>>(NUM_AGGREGATORS) agg_collided;
    register<bit<32>>(NUM_AGGREGATORS * VALUE_COUNT) agg_values;

    action drop_packet() {
        mark_to_drop(std);
    }

    action set_job(bit<6> fan_in, port_t ps_port, bit<16> mcast_grp, bit<1> level) {
        meta.job_known = 1;
        meta.fan_in = fan_in;
        meta.ps_port = ps_port;
        meta.mcast_grp = mcast_grp;
        meta.level = level;
    }

    table job_table {
        key = {
            meta.job_id : exact @name("job_id");
        }
        actions = {
            set_job;
            @defaultonly drop_packet;
        }
        const default_action = drop_packet();
        size = 256;
    }

    /* Source check: which ports may send gradients of which job. The software switch's ports are UDP
     * endpoints (port_table), so its ingress port is the port whose address the datagram came from: the
     * (job, source address) pairs programmed here are the only senders of a job's contributions. */
    action allow_member() {
        meta.member = 1;
    }
    table member_table {
        key = {
            meta.member_key : exact @name("member");
        }
        actions = {
            allow_member;
            @defaultonly NoAction;
        }
        const default_action = NoAction();
        size = 8192;
    }
    action to_ps() {
        std.egress_spec = meta.ps_port;
    }

    /* meta.pop_out = number of set bits of meta.pop_in (SWAR popcount). */
    action popcount() {
        bit<32> x = meta.pop_in;
        x = x - ((x >> 1) & 0x55555555);
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333);
        x = (x + (x >> 4)) & 0x0F0F0F0F;
        meta.pop_out = (x * 0x01010101) >> 24;
    }

    action store_lanes() {
        FOR_EACH_LANE(LANE_STORE)
    }

    action load_lanes() {
        FOR_EACH_LANE(LANE_LOAD)
    }

    action add_lanes() {
        bit<32> cur;
        FOR_EACH_LANE(LANE_ADD)
    }

    action release_slot() {
        agg_job_seq.write(meta.index, 0);
        agg_bitmap.write(meta.index, 0);
        agg_counter.write(meta.index, 0);
        agg_ecn.write(meta.index, 0);
    }

    /* Turn the packet into the slot's aggregate (values already in hdr.values) bound for the PS. */
    action emit_aggregate() {
        if (meta.level == 0) {
            hdr.atp.bitmap0 = meta.bitmap;          /* workers of this rack */
        } else {
            hdr.atp.bitmap0 = 0;                    /* 0 = whole racks */
            hdr.atp.bitmap1 = meta.bitmap;          /* racks */
        }
        hdr.atp.edge_switch_id = 1;
        hdr.atp.ecn = meta.agg_ecn;
        hdr.atp.overflow = 0;
        hdr.atp.collision = 0;
        hdr.atp.is_ack = 0;
        std.egress_spec = meta.ps_port;
    }

    apply {
        if (!hdr.atp.isValid() || std.parser_error != error.NoError) {
            drop_packet();
            dropped.count(0);
            return;
        }
        meta.job_id = hdr.atp.job_seq[31:32 - JOB_ID_BITS];
        meta.job_known = 0;
        job_table.apply();
        if (meta.job_known == 0) {          /* unknown job: the default action dropped it */
            dropped.count(0);
            return;
        }
        /* Parameter packets only from the job's PS port; gradients only from its member ports. */
        if (hdr.atp.is_ack == 1) {
            if (std.ingress_port != meta.ps_port) {
                drop_packet();
                rejected.count(0);
                return;
            }
        } else {
            meta.member = 0;
            meta.member_key = meta.job_id ++ (bit<24>)std.ingress_port;
            member_table.apply();
            if (meta.member == 0) {
                drop_packet();
                rejected.count(0);
                return;
            }
        }
        meta.index = (bit<32>)hdr.atp.agg_index;
        meta.base = meta.index * VALUE_COUNT;
        agg_job_seq.read(meta.held, meta.index);

        /* Parameter packet: free the slot, multicast to the job's group. */
        if (hdr.atp.is_ack == 1) {
            acks.count(0);
            if (meta.held == hdr.atp.job_seq) {
                release_slot();
            }
            agg_collided.read(meta.collided, meta.index);
            if (meta.collided == hdr.atp.job_seq) {
                agg_collided.write(meta.index, 0);
            }
            if (meta.mcast_grp == 0) {
                drop_packet();
                dropped.count(0);
            } else {
                std.mcast_grp = meta.mcast_grp;
            }
            return;
        }

        /* Resend: never reserves nor adds. Flush the slot if it holds this fragment (the packet becomes
         * the aggregate, with resend set) and send the resend packet itself on to the PS as an
         * ingress-to-egress clone (clone session ps_port + 1 -> ps_port). */
        if (hdr.atp.resend == 1) {
            resends.count(0);
            forwarded.count(0);
            if (meta.held == hdr.atp.job_seq) {
                clone(CloneType.I2E, (bit<32>)meta.ps_port + 1);
                agg_bitmap.read(meta.bitmap, meta.index);
                agg_ecn.read(meta.agg_ecn, meta.index);
                load_lanes();
                emit_aggregate();
                hdr.atp.resend = 1;
                release_slot();
            } else {
                to_ps();
            }
            return;
        }

        /* Eligibility: level 0 aggregates worker packets (edge clear) keyed by bitmap0; level 1
         * aggregates complete rack aggregates (edge set, popcount(bitmap0) == fan_in0) keyed by bitmap1.
         * fan_in0 == 0 encodes 32. */
        meta.eligible = 0;
        if (hdr.atp.overflow == 0 && hdr.atp.collision == 0) {
            if (meta.level == 0) {
                meta.key = hdr.atp.bitmap0;
                if (hdr.atp.edge_switch_id == 0) {
                    meta.eligible = 1;
                }
            } else {
                meta.key = hdr.atp.bitmap1;
                meta.pop_in = hdr.atp.bitmap0;
                popcount();
                if (hdr.atp.edge_switch_id == 1 && hdr.atp.bitmap0 != 0
                        && ((hdr.atp.fan_in0 == 0 && meta.pop_out == 32)
                            || (hdr.atp.fan_in0 != 0 && meta.pop_out == (bit<32>)hdr.atp.fan_in0))) {
                    meta.eligible = 1;
                }
            }
        }
        if (meta.eligible == 0 || meta.key == 0) {
            to_ps();
            forwarded.count(0);
            return;
        }

        /* Reserve a free slot, or reclaim a stale one. */
        agg_timestamp.read(meta.ts, meta.index);
        if (meta.held != 0 && meta.held != hdr.atp.job_seq
                && std.ingress_global_timestamp - meta.ts > STALE_US) {
            release_slot();
            meta.held = 0;
        }
        agg_collided.read(meta.collided, meta.index);
        if (meta.held == 0 && meta.collided != hdr.atp.job_seq) {
            agg_job_seq.write(meta.index, hdr.atp.job_seq);
            meta.bitmap = 0;
            meta.count = 0;
            meta.agg_ecn = 0;
        } else if (meta.held != hdr.atp.job_seq) {
            /* Held by another live fragment -- or free, but this fragment's first packet collided here
             * and went to the PS: reserving would strand this contribution. Collision: the PS
             * aggregates this one, and the slot remembers the fragment. */
            agg_collided.write(meta.index, hdr.atp.job_seq);
            hdr.atp.collision = 1;
            to_ps();
            collisions.count(0);
            forwarded.count(0);
            return;
        } else {
            agg_bitmap.read(meta.bitmap, meta.index);
            agg_counter.read(meta.count, meta.index);
            agg_ecn.read(meta.agg_ecn, meta.index);
        }

        if ((meta.bitmap & meta.key) != 0) {
            if ((meta.bitmap & meta.key) == meta.key) {
                mark_to_drop(std);          /* duplicate: every contribution already aggregated */
                dropped.count(0);
            } else {
                to_ps();                    /* partial overlap cannot be merged: the PS sorts it out */
                forwarded.count(0);
            }
            return;
        }
        if (meta.count >= (bit<8>)meta.fan_in) {
            to_ps();                        /* more contributions than the fan-in: misconfiguration */
            forwarded.count(0);
            return;
        }

        /* Aggregate: saturating adds (a fresh slot starts from zero), merge bitmap, count, ECN. */
        if (meta.held == 0) {
            store_lanes();
        } else {
            add_lanes();
        }
        meta.pop_in = meta.key;
        popcount();
        meta.bitmap = meta.bitmap | meta.key;
        meta.count = meta.count + (bit<8>)meta.pop_out;
        meta.agg_ecn = meta.agg_ecn | hdr.atp.ecn;
        agg_bitmap.write(meta.index, meta.bitmap);
        agg_counter.write(meta.index, meta.count);
        agg_ecn.write(meta.index, meta.agg_ecn);
        agg_timestamp.write(meta.index, std.ingress_global_timestamp);
        aggregated.count(0);

        if (meta.count >= (bit<8>)meta.fan_in) {
            emit_aggregate();               /* complete; the slot stays held until the parameter packet */
        } else {
            mark_to_drop(std);              /* absorbed */
        }
    }
}

/* ---------------------------------------------------------------- egress */
control AtpEgress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t std) {

    counter(1, CounterType.packets) ecn_marked;
    register<bit<19>>(1) ecn_threshold;     /* queue depth (packets), compared with enq_qdepth */

    action set_port_addr(bit<32> ipv4, bit<16> udp_port) {
        hdr.ipv4.dst_addr = ipv4;
        hdr.udp.dst_port = udp_port;
    }

    table port_table {
        key = {
            std.egress_port : exact @name("port");
        }
        actions = {
            set_port_addr;
            @defaultonly NoAction;
        }
        const default_action = NoAction();
        size = 512;
    }

    apply {
        if (hdr.atp.isValid()) {
            bit<19> threshold;
            ecn_threshold.read(threshold, 0);
            if (std.enq_qdepth > threshold) {
                hdr.atp.ecn = 1;
                hdr.ipv4.ecn = 3;           /* congestion experienced */
                ecn_marked.count(0);
            }
            hdr.udp.checksum = 0;           /* payload changed; 0 = no checksum over IPv4 */
        }
        port_table.apply();
    }
}

control AtpComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(
            hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.dscp, hdr.ipv4.ecn, hdr.ipv4.total_len,
              hdr.ipv4.identification, hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl,
              hdr.ipv4.protocol, hdr.ipv4.src_addr, hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum,
            HashAlgorithm.csum16);
    }
}

control AtpDeparser(packet_out packet, in headers_t hdr) {
    apply {
        packet.emit(hdr.ethernet);
        packet.emit(hdr.ipv4);
        packet.emit(hdr.udp);
        packet.emit(hdr.atp);
        packet.emit(hdr.values);
    }
}

V1Switch(
    AtpParser(),
    AtpVerifyChecksum(),
    AtpIngress(),
    AtpEgress(),
    AtpComputeChecksum(),
    AtpDeparser()
) main;
