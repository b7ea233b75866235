"""Translate P4Runtime entities to and from ``SwitchControl`` calls, per the binding table.

``EntityStore.write`` applies one ``Update`` (raising ``P4RuntimeError`` with the canonical code the spec
prescribes); ``EntityStore.read`` yields the ``Entity`` messages answering one requested entity,
including wildcard reads. Values are decoded with bitwidth checks (canonical or padded bytestrings) and
encoded canonically. Controller-opaque ``metadata`` bytes of table entries and multicast groups are kept
here, since the switch has no place for them.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Iterator
from typing import TypeAlias, cast

from innet.control import (
    AggregatorState, ControlError, JobEntry, MulticastGroup, SwitchControl,
)

from .bytestrings import decode_uint, encode_uint
from .errors import (
    P4RuntimeError, from_control_error, invalid_argument, not_found, out_of_range, permission_denied,
    unimplemented,
)
from .protos import code_pb2, p4runtime_pb2
from .schema import AtpSchema, RegisterSpec, TableSpec

logger = logging.getLogger(__name__)

Update = p4runtime_pb2.Update
Entity: TypeAlias = p4runtime_pb2.Entity

#: v1model multicast group ids are 16 bits; 0 means "no multicast" and is the wildcard in reads.
MAX_MULTICAST_GROUP_ID = 0xFFFF
_TIMESTAMP_SCALE = 1_000_000          # agg_timestamp register counts microseconds


class EntityStore:
    """Write/read P4Runtime entities on one switch, under one schema (swappable on pipeline change)."""

    def __init__(self, switch: SwitchControl, schema: AtpSchema) -> None:
        self.switch = switch
        self.schema = schema
        self._lock = threading.RLock()
        self._table_metadata: dict[tuple[int, int], bytes] = {}
        self._group_metadata: dict[int, bytes] = {}

    # ------------------------------------------------------------------ write
    def write(self, update: p4runtime_pb2.Update) -> None:
        """Apply one update; raise P4RuntimeError on failure (the switch is left unchanged)."""
        kind = update.entity.WhichOneof("entity")
        if update.type == Update.UNSPECIFIED:
            raise invalid_argument("update type is UNSPECIFIED")
        with self._lock:
            try:
                if kind == "table_entry":
                    self._write_table_entry(update.type, update.entity.table_entry)
                elif kind == "packet_replication_engine_entry":
                    self._write_pre_entry(update.type, update.entity.packet_replication_engine_entry)
                elif kind == "register_entry":
                    self._write_register_entry(update.type, update.entity.register_entry)
                elif kind == "counter_entry":
                    self._write_counter_entry(update.type, update.entity.counter_entry)
                elif kind is None:
                    raise invalid_argument("update carries no entity")
                else:
                    raise unimplemented(f"{kind} is not supported by the ATP switch")
            except ControlError as exc:
                raise from_control_error(exc) from exc

    def clear_forwarding_state(self) -> None:
        """Delete every table entry and multicast group (VERIFY_AND_COMMIT of a new pipeline)."""
        with self._lock:
            try:
                for job in list(self.switch.read_jobs()):
                    self.switch.delete_job(job.job_id)
                for port in list(self.switch.read_ports()):
                    self.switch.delete_port(port)
                for group in list(self.switch.read_mcast_groups()):
                    self.switch.delete_mcast_group(group.group_id)
                for job_id, port in list(self.switch.read_members()):
                    self.switch.delete_member(job_id, port)
            except ControlError as exc:
                raise from_control_error(exc) from exc
            self._table_metadata.clear()
            self._group_metadata.clear()

    def _table(self, table_id: int) -> TableSpec:
        if table_id == 0:
            raise invalid_argument("table_id must be set in a write")
        spec = self.schema.tables.get(table_id)
        if spec is None:
            raise not_found(f"unknown table id {table_id}")
        return spec

    def _key_of(self, spec: TableSpec, entry: p4runtime_pb2.TableEntry) -> int:
        if len(entry.match) != 1:
            raise invalid_argument(f"table '{spec.alias}' takes exactly one exact match on "
                                   f"'{spec.key.name}' (got {len(entry.match)} match fields)")
        mf = entry.match[0]
        if mf.field_id != spec.key.id:
            raise invalid_argument(f"unknown match field id {mf.field_id} for table '{spec.alias}'")
        if mf.WhichOneof("field_match_type") != "exact":
            raise invalid_argument(f"'{spec.key.name}' of table '{spec.alias}' is an exact match")
        return decode_uint(mf.exact.value, spec.key.bitwidth, f"{spec.alias}.{spec.key.name}")

    def _params_of(self, spec: TableSpec, entry: p4runtime_pb2.TableEntry) -> dict[str, int]:
        if entry.action.WhichOneof("type") != "action":
            raise invalid_argument(f"table '{spec.alias}' needs a direct action "
                                   f"'{spec.binding.action}'")
        action = entry.action.action
        if action.action_id != spec.action_id:
            raise invalid_argument(f"action id {action.action_id} is not allowed in table "
                                   f"'{spec.alias}' (use '{spec.binding.action}')")
        by_id = {p.id: p for p in spec.params}
        values: dict[str, int] = {}
        for param in action.params:
            p = by_id.get(param.param_id)
            if p is None:
                raise invalid_argument(f"unknown parameter id {param.param_id} of action "
                                       f"'{spec.binding.action}'")
            if p.name in values:
                raise invalid_argument(f"parameter '{p.name}' given twice")
            values[p.name] = decode_uint(param.value, p.bitwidth, f"{spec.binding.action}.{p.name}")
        missing = [p.name for p in spec.params if p.name not in values]
        if missing:
            raise invalid_argument(f"action '{spec.binding.action}' misses parameter(s) "
                                   f"{', '.join(missing)}")
        return values

    def _write_table_entry(self, utype: int, entry: p4runtime_pb2.TableEntry) -> None:
        spec = self._table(entry.table_id)
        if entry.is_default_action:
            raise permission_denied(f"the default action of table '{spec.alias}' is constant")
        if entry.priority != 0:
            raise invalid_argument(f"table '{spec.alias}' is exact-match: priority must be 0")
        key = self._key_of(spec, entry)
        meta_key = (spec.id, key)
        if utype == Update.DELETE:          # only the key matters; the rest of the entry is ignored
            self._table_delete(spec, key)
            self._table_metadata.pop(meta_key, None)
            return
        if entry.HasField("meter_config") or entry.HasField("counter_data") or entry.idle_timeout_ns:
            raise invalid_argument(f"table '{spec.alias}' has no direct resources or idle timeout")
        params = self._params_of(spec, entry)
        if spec.alias == "job_table":
            job = JobEntry(job_id=key, fan_in=params["fan_in"], ps_port=params["ps_port"],
                           mcast_group=params["mcast_grp"], level=params["level"])
            if utype == Update.INSERT:
                self.switch.insert_job(job)
            elif utype == Update.MODIFY:
                self.switch.modify_job(job)
            else:
                raise invalid_argument(f"unknown update type {utype}")
        elif spec.alias == "port_table":
            addr = (str(ipaddress.IPv4Address(params["ipv4"])), params["udp_port"])
            present = key in self.switch.read_ports()
            if utype == Update.INSERT and present:
                raise P4RuntimeError(code_pb2.ALREADY_EXISTS,
                                     f"port_table already has an entry for port {key}")
            if utype == Update.MODIFY and not present:
                raise not_found(f"port_table has no entry for port {key}")
            if utype not in (Update.INSERT, Update.MODIFY):
                raise invalid_argument(f"unknown update type {utype}")
            self.switch.set_port(key, addr)
        elif spec.alias == "member_table":
            job_id, port = key >> 24, key & 0xFFFFFF
            present = (job_id, port) in set(self.switch.read_members())
            if utype == Update.INSERT:
                self.switch.insert_member(job_id, port)
            elif utype == Update.MODIFY:
                if not present:
                    raise not_found(f"member_table has no entry for job {job_id} port {port}")
            else:
                raise invalid_argument(f"unknown update type {utype}")
        else:  # pragma: no cover - bindings and schema list the same tables
            raise unimplemented(f"table '{spec.alias}' has no SwitchControl mapping")
        if entry.metadata:
            self._table_metadata[meta_key] = bytes(entry.metadata)
        else:
            self._table_metadata.pop(meta_key, None)

    def _table_delete(self, spec: TableSpec, key: int) -> None:
        if spec.alias == "job_table":
            self.switch.delete_job(key)
        elif spec.alias == "port_table":
            if key not in self.switch.read_ports():
                raise not_found(f"port_table has no entry for port {key}")
            self.switch.delete_port(key)
        elif spec.alias == "member_table":
            self.switch.delete_member(key >> 24, key & 0xFFFFFF)

    def _write_pre_entry(self, utype: int, pre: p4runtime_pb2.PacketReplicationEngineEntry) -> None:
        if pre.WhichOneof("type") != "multicast_group_entry":
            raise unimplemented("only multicast groups are supported (no clone sessions)")
        mg = pre.multicast_group_entry
        gid = mg.multicast_group_id
        if gid == 0:
            raise invalid_argument("multicast_group_id must be non-zero in a write")
        if gid > MAX_MULTICAST_GROUP_ID:
            raise invalid_argument(f"multicast_group_id {gid} exceeds {MAX_MULTICAST_GROUP_ID} "
                                   "(v1model mcast_grp is 16 bits)")
        if utype == Update.DELETE:
            self.switch.delete_mcast_group(gid)
            self._group_metadata.pop(gid, None)
            return
        port_bits = self.schema.table("port_table").key.bitwidth
        ports: list[int] = []
        for replica in mg.replicas:
            if len(replica.backup_replicas):
                raise unimplemented("backup replicas are not supported")
            kind = replica.WhichOneof("port_kind")
            if kind == "port":
                port = decode_uint(replica.port, port_bits, "replica.port")
            else:  # the deprecated uint32 egress_port (what p4runtime-shell sends); unset means 0
                port = replica.egress_port
                if port.bit_length() > port_bits:
                    raise invalid_argument(f"replica port {port} exceeds the {port_bits}-bit port range")
            if replica.instance != 0:
                raise invalid_argument("this switch supports replica instance 0 only")
            if port in ports:
                raise invalid_argument(f"port {port} appears twice in multicast group {gid}")
            ports.append(port)
        group = MulticastGroup(group_id=gid, ports=tuple(ports))
        if utype == Update.INSERT:
            self.switch.insert_mcast_group(group)
        elif utype == Update.MODIFY:
            self.switch.modify_mcast_group(group)
        else:
            raise invalid_argument(f"unknown update type {utype}")
        if mg.metadata:
            self._group_metadata[gid] = bytes(mg.metadata)
        else:
            self._group_metadata.pop(gid, None)

    def _register(self, register_id: int) -> RegisterSpec:
        spec = self.schema.registers.get(register_id)
        if spec is None:
            raise not_found(f"unknown register id {register_id}")
        return spec

    def _write_register_entry(self, utype: int, entry: p4runtime_pb2.RegisterEntry) -> None:
        if utype != Update.MODIFY:
            raise invalid_argument("register entries can only be modified (INSERT/DELETE are invalid)")
        spec = self._register(entry.register_id)
        if spec.binding.write is None:
            raise unimplemented(f"register '{spec.alias}' is aggregator state owned by the dataplane; "
                                "it can be read, not written")
        if entry.HasField("index"):
            self._check_index(spec, entry.index.index, spec.size)
        if entry.data.WhichOneof("data") != "bitstring":
            raise invalid_argument(f"register '{spec.alias}' holds bit<{spec.bitwidth}>: "
                                   "data must be a bitstring")
        value = decode_uint(entry.data.bitstring, spec.bitwidth, spec.alias)
        getattr(self.switch, spec.binding.write)(value)

    def _write_counter_entry(self, utype: int, entry: p4runtime_pb2.CounterEntry) -> None:
        if utype != Update.MODIFY:
            raise invalid_argument("counter entries can only be modified (INSERT/DELETE are invalid)")
        if entry.counter_id not in self.schema.counters:
            raise not_found(f"unknown counter id {entry.counter_id}")
        raise unimplemented("the switch counters cannot be written; read them and keep a baseline")

    @staticmethod
    def _check_index(spec, index: int, limit: int) -> None:
        if index < 0:
            raise invalid_argument(f"negative index {index} for '{spec.alias}'")
        if index >= limit:
            raise out_of_range(f"index {index} is out of range for '{spec.alias}' (size {limit})")

    # ------------------------------------------------------------------ read
    def read(self, entity: p4runtime_pb2.Entity) -> Iterator[p4runtime_pb2.Entity]:
        """Yield the entities answering one (possibly wildcard) requested entity."""
        kind = entity.WhichOneof("entity")
        try:
            if kind == "table_entry":
                yield from self._read_table_entries(entity.table_entry)
            elif kind == "packet_replication_engine_entry":
                yield from self._read_pre_entries(entity.packet_replication_engine_entry)
            elif kind == "counter_entry":
                yield from self._read_counter_entries(entity.counter_entry)
            elif kind == "register_entry":
                yield from self._read_register_entries(entity.register_entry)
            elif kind is None:
                raise invalid_argument("read request entity is empty")
            else:
                raise unimplemented(f"{kind} is not supported by the ATP switch")
        except ControlError as exc:
            raise from_control_error(exc) from exc

    def _read_table_entries(self, req: p4runtime_pb2.TableEntry) -> Iterator[Entity]:
        if req.table_id == 0:
            specs = list(self.schema.tables.values())
        else:
            spec = self.schema.tables.get(req.table_id)
            if spec is None:
                raise not_found(f"unknown table id {req.table_id}")
            specs = [spec]
        for spec in specs:
            if req.is_default_action:
                ent = Entity()
                te = ent.table_entry
                te.table_id = spec.id
                te.is_default_action = True
                if spec.default_action_id:
                    te.action.action.action_id = spec.default_action_id
                yield ent
                continue
            only = self._key_of(spec, req) if len(req.match) else None
            for key, params in self._table_rows(spec):
                if only is not None and key != only:
                    continue
                if key.bit_length() > spec.key.bitwidth:
                    logger.warning("%s entry %d is outside the P4Info's %d-bit key; not shown",
                                   spec.alias, key, spec.key.bitwidth)
                    continue
                yield self._table_entity(spec, key, params)

    def _table_rows(self, spec: TableSpec) -> Iterator[tuple[int, dict[str, int]]]:
        if spec.alias == "job_table":
            for job in sorted(self.switch.read_jobs(), key=lambda j: j.job_id):
                yield job.job_id, {"fan_in": job.fan_in, "ps_port": job.ps_port,
                                   "mcast_grp": job.mcast_group, "level": job.level}
        elif spec.alias == "port_table":
            for port, (host, udp_port) in sorted(self.switch.read_ports().items()):
                ipv4 = _ipv4_int(host)
                if ipv4 is None:
                    logger.warning("port %d: address %r is not IPv4; not shown in port_table", port, host)
                    continue
                yield port, {"ipv4": ipv4, "udp_port": udp_port}
        elif spec.alias == "member_table":
            for job_id, port in self.switch.read_members():
                yield job_id << 24 | port, {}

    def _table_entity(self, spec: TableSpec, key: int, params: dict[str, int]) -> Entity:
        ent = Entity()
        te = ent.table_entry
        te.table_id = spec.id
        mf = te.match.add()
        mf.field_id = spec.key.id
        mf.exact.value = _encode(key, spec.key.bitwidth, f"{spec.alias}.{spec.key.name}")
        act = te.action.action
        act.action_id = spec.action_id
        for p in spec.params:
            param = act.params.add()
            param.param_id = p.id
            param.value = _encode(params[p.name], p.bitwidth, f"{spec.binding.action}.{p.name}")
        meta = self._table_metadata.get((spec.id, key))
        if meta:
            te.metadata = meta
        return ent

    def _read_pre_entries(self, req: p4runtime_pb2.PacketReplicationEngineEntry) -> Iterator[Entity]:
        if req.WhichOneof("type") == "clone_session_entry":
            raise unimplemented("clone sessions are not supported")
        gid = req.multicast_group_entry.multicast_group_id
        for group in sorted(self.switch.read_mcast_groups(), key=lambda g: g.group_id):
            if gid and group.group_id != gid:
                continue
            ent = Entity()
            mg = ent.packet_replication_engine_entry.multicast_group_entry
            mg.multicast_group_id = group.group_id
            for port in group.ports:
                replica = mg.replicas.add()
                replica.egress_port = port    # p4runtime-shell (and pre-1.4 clients) read this field
                replica.instance = 0
            meta = self._group_metadata.get(group.group_id)
            if meta:
                mg.metadata = meta
            yield ent

    def _read_counter_entries(self, req: p4runtime_pb2.CounterEntry) -> Iterator[Entity]:
        if req.counter_id == 0:
            specs = list(self.schema.counters.values())
        else:
            spec = self.schema.counters.get(req.counter_id)
            if spec is None:
                raise not_found(f"unknown counter id {req.counter_id}")
            specs = [spec]
        values = self.switch.counters()
        for spec in specs:
            if spec.switch_name not in values:
                raise P4RuntimeError(code_pb2.INTERNAL,
                                     f"the switch does not report counter '{spec.switch_name}'")
            if req.HasField("index"):
                self._check_index(spec, req.index.index, spec.size)
                indices = [req.index.index]
            else:
                indices = list(range(spec.size))
            for index in indices:
                ent = Entity()
                ce = ent.counter_entry
                ce.counter_id = spec.id
                ce.index.index = index
                ce.data.packet_count = int(values[spec.switch_name]) if index == 0 else 0
                yield ent

    def _read_register_entries(self, req: p4runtime_pb2.RegisterEntry) -> Iterator[Entity]:
        if req.register_id == 0:
            specs = list(self.schema.registers.values())
        else:
            specs = [self._register(req.register_id)]
        for spec in specs:
            limit = self._live_size(spec)
            if req.HasField("index"):
                self._check_index(spec, req.index.index, spec.size)
                if req.index.index >= limit:
                    raise out_of_range(f"index {req.index.index} of '{spec.alias}' is beyond this "
                                       f"switch's {limit} cells")
                indices = range(req.index.index, req.index.index + 1)
            else:
                indices = range(limit)
            yield from self._register_cells(spec, indices)

    def _live_size(self, spec: RegisterSpec) -> int:
        """Cells that exist on the running switch (the P4Info size is the compiled maximum)."""
        if spec.binding.field is None:
            return spec.size
        cells = int(self.switch.num_aggregators)
        if spec.binding.per_lane:
            cells *= int(self.switch.value_count)
        return min(spec.size, cells)

    def _register_cells(self, spec: RegisterSpec, indices: range) -> Iterator[Entity]:
        if spec.binding.field is None:
            value = int(getattr(self.switch, spec.binding.read)())
            for index in indices:
                yield _register_entity(spec, index, _encode(value, spec.bitwidth, spec.alias))
            return
        lanes = int(self.switch.value_count) if spec.binding.per_lane else 1
        slot_cache: tuple[int, AggregatorState] | None = None
        for index in indices:
            slot, lane = divmod(index, lanes)
            if slot_cache is None or slot_cache[0] != slot:
                slot_cache = (slot, self.switch.read_aggregator(slot))
            state = slot_cache[1]
            value = _aggregator_cell(state, spec, lane)
            yield _register_entity(spec, index, _encode(value, spec.bitwidth, spec.alias))


def _aggregator_cell(state: AggregatorState, spec: RegisterSpec, lane: int) -> int:
    field = cast(str, spec.binding.field)     # the caller handled a binding without a field
    if field == "values":
        return int(state.values[lane]) & 0xFFFFFFFF          # int32 as two's complement bit<32>
    if field == "timestamp":
        return min(max(int(round(state.timestamp * _TIMESTAMP_SCALE)), 0), (1 << spec.bitwidth) - 1)
    if field == "ecn":
        return int(bool(state.ecn))
    return int(getattr(state, field))


def _register_entity(spec: RegisterSpec, index: int, data: bytes) -> Entity:
    ent = Entity()
    re = ent.register_entry
    re.register_id = spec.id
    re.index.index = index
    re.data.bitstring = data
    return ent


def _encode(value: int, bitwidth: int, what: str) -> bytes:
    if value < 0 or value.bit_length() > bitwidth:
        raise P4RuntimeError(code_pb2.INTERNAL,
                             f"{what}: switch value {value} does not fit the P4Info's {bitwidth} bits")
    return encode_uint(value)


def _ipv4_int(host: str) -> int | None:
    try:
        return int(ipaddress.IPv4Address(host))
    except ValueError:
        pass
    try:
        return int(ipaddress.IPv4Address(socket.gethostbyname(host)))
    except (OSError, ValueError):
        return None
