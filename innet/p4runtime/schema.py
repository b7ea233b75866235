"""Load an ATP P4Info and resolve it against the binding table into ids, bitwidths and sizes.

``AtpSchema.from_p4info`` is also the pipeline validator: a P4Info that lacks a required table, action,
parameter, counter or register (or gives one an unusable shape) is rejected with one INVALID_ARGUMENT
error that lists every problem, so a controller learns everything that is wrong at once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format

from . import bindings
from .errors import invalid_argument
from .protos import p4info_pb2

logger = logging.getLogger(__name__)

#: The P4Info shipped with the package (innet/p4/atp.p4info.txtpb).
DEFAULT_P4INFO_PATH = Path(__file__).resolve().parent.parent / "p4" / "atp.p4info.txtpb"


def load_p4info(path: str | Path | None = None) -> p4info_pb2.P4Info:
    """Parse a P4Info text-format file (default: the ATP P4Info shipped in ``innet/p4``)."""
    path = Path(path) if path is not None else DEFAULT_P4INFO_PATH
    p4info = p4info_pb2.P4Info()
    try:
        text_format.Parse(path.read_text(encoding="utf-8"), p4info)
    except text_format.ParseError as exc:
        raise ValueError(f"{path}: not a valid P4Info text file: {exc}") from exc
    return p4info


def short_name(preamble: p4info_pb2.Preamble) -> str:
    """The alias of a P4Info object, or the last component of its fully qualified name."""
    return preamble.alias or preamble.name.rsplit(".", 1)[-1]


@dataclass(frozen=True)
class FieldSpec:
    """A match field or action parameter: P4Runtime id, name and bitwidth."""

    id: int
    name: str
    bitwidth: int


@dataclass(frozen=True)
class TableSpec:
    """A bound table: its key field, its controller action and parameters, its default action."""

    id: int
    name: str
    alias: str
    key: FieldSpec
    action_id: int
    params: tuple[FieldSpec, ...]          # in binding order
    default_action_id: int
    size: int
    binding: bindings.TableBinding

    def param(self, name: str) -> FieldSpec:
        return next(p for p in self.params if p.name == name)


@dataclass(frozen=True)
class CounterSpec:
    id: int
    alias: str
    size: int
    switch_name: str


@dataclass(frozen=True)
class RegisterSpec:
    id: int
    alias: str
    bitwidth: int
    size: int
    binding: bindings.RegisterBinding


@dataclass
class AtpSchema:
    """The loaded P4Info with every object the server needs, by id."""

    p4info: p4info_pb2.P4Info
    tables: dict[int, TableSpec] = field(default_factory=dict)
    counters: dict[int, CounterSpec] = field(default_factory=dict)
    registers: dict[int, RegisterSpec] = field(default_factory=dict)

    def table(self, alias: str) -> TableSpec:
        return next(t for t in self.tables.values() if t.alias == alias)

    def register(self, alias: str) -> RegisterSpec:
        return next(r for r in self.registers.values() if r.alias == alias)

    def counter(self, alias: str) -> CounterSpec:
        return next(c for c in self.counters.values() if c.alias == alias)

    @classmethod
    def from_p4info(cls, p4info: p4info_pb2.P4Info) -> AtpSchema:
        """Resolve ``p4info`` against the bindings; INVALID_ARGUMENT listing every missing object."""
        problems: list[str] = []
        schema = cls(p4info=p4info)
        tables = {short_name(t.preamble): t for t in p4info.tables}
        actions = {a.preamble.id: a for a in p4info.actions}
        actions_by_name = {short_name(a.preamble): a for a in p4info.actions}
        for alias, binding in bindings.TABLES.items():
            spec = _resolve_table(alias, binding, tables, actions, actions_by_name, problems)
            if spec is not None:
                schema.tables[spec.id] = spec
        counters = {short_name(c.preamble): c for c in p4info.counters}
        for alias, switch_name in bindings.COUNTERS.items():
            c = counters.get(alias)
            if c is None:
                problems.append(f"counter '{alias}' is missing")
                continue
            if c.size < 1:
                problems.append(f"counter '{alias}' has size {c.size}")
                continue
            schema.counters[c.preamble.id] = CounterSpec(c.preamble.id, alias, c.size, switch_name)
        registers = {short_name(r.preamble): r for r in p4info.registers}
        for alias, rbinding in bindings.REGISTERS.items():
            r = registers.get(alias)
            if r is None:
                problems.append(f"register '{alias}' is missing")
                continue
            if r.type_spec.WhichOneof("type_spec") != "bitstring" or \
                    r.type_spec.bitstring.WhichOneof("type_spec") != "bit":
                problems.append(f"register '{alias}' must hold bit<W> values")
                continue
            width = r.type_spec.bitstring.bit.bitwidth
            if width < 1 or r.size < 1:
                problems.append(f"register '{alias}' has bitwidth {width} and size {r.size}")
                continue
            schema.registers[r.preamble.id] = RegisterSpec(r.preamble.id, alias, width, r.size, rbinding)
        ids = [t.preamble.id for t in p4info.tables] + [a.preamble.id for a in p4info.actions] + \
            [c.preamble.id for c in p4info.counters] + [r.preamble.id for r in p4info.registers]
        if len(ids) != len(set(ids)) or 0 in ids:
            problems.append("P4Info object ids must be non-zero and unique")
        if problems:
            raise invalid_argument("P4Info is not an ATP pipeline this switch can realize: "
                                   + "; ".join(problems))
        return schema


def _resolve_table(alias, binding, tables, actions, actions_by_name, problems) -> TableSpec | None:
    t = tables.get(alias)
    if t is None:
        problems.append(f"table '{alias}' is missing")
        return None
    if len(t.match_fields) != 1 or t.match_fields[0].name != binding.key:
        problems.append(f"table '{alias}' must have exactly one match field '{binding.key}'")
        return None
    mf = t.match_fields[0]
    if mf.match_type != p4info_pb2.MatchField.EXACT or not 1 <= mf.bitwidth <= 32:
        problems.append(f"table '{alias}': '{binding.key}' must be an exact match of 1..32 bits")
        return None
    action = actions_by_name.get(binding.action)
    if action is None or action.preamble.id not in {ref.id for ref in t.action_refs}:
        problems.append(f"table '{alias}' must offer action '{binding.action}'")
        return None
    params_by_name = {p.name: p for p in action.params}
    missing = [p for p in binding.params if p not in params_by_name]
    if missing or len(action.params) != len(binding.params):
        problems.append(f"action '{binding.action}' must have exactly the parameters "
                        f"{', '.join(binding.params)} (missing: {', '.join(missing) or 'none'})")
        return None
    params = tuple(FieldSpec(params_by_name[p].id, p, params_by_name[p].bitwidth) for p in binding.params)
    if any(not 1 <= p.bitwidth <= 32 for p in params):
        problems.append(f"action '{binding.action}': parameters must be 1..32 bits wide")
        return None
    default_id = t.const_default_action_id
    if default_id and default_id not in actions:
        problems.append(f"table '{alias}': unknown default action id {default_id}")
        return None
    return TableSpec(
        id=t.preamble.id, name=t.preamble.name, alias=alias,
        key=FieldSpec(mf.id, mf.name, mf.bitwidth), action_id=action.preamble.id, params=params,
        default_action_id=default_id, size=t.size, binding=binding)


def packet_values(p4info: p4info_pb2.P4Info) -> int:
    """Values per packet of the pipeline ``p4info`` describes: ``agg_values`` holds that many cells per
    aggregator slot (``agg_job_seq``: one), as ``atp.p4`` compiled with ``VALUE_COUNT`` lays them out.

    This is how a controller learns a software switch's packet width (``--values``) from the P4Info it
    serves; ValueError if the P4Info lacks the registers or their sizes do not divide."""
    sizes = {short_name(r.preamble): r.size for r in p4info.registers}
    slots, cells = sizes.get("agg_job_seq", 0), sizes.get("agg_values", 0)
    if slots < 1 or cells < slots or cells % slots:
        raise ValueError(f"P4Info registers agg_job_seq ({slots}) and agg_values ({cells}) do not give a "
                         "packet width")
    return cells // slots


def with_packet_values(p4info: p4info_pb2.P4Info, values: int) -> p4info_pb2.P4Info:
    """A copy of ``p4info`` describing ``values``-wide packets (``agg_values`` resized to match)."""
    out = p4info_pb2.P4Info()
    out.CopyFrom(p4info)
    slots = next((r.size for r in out.registers if short_name(r.preamble) == "agg_job_seq"), 0)
    for r in out.registers:
        if short_name(r.preamble) == "agg_values" and slots:
            r.size = slots * values
            r.preamble.doc.brief = ("Aggregator values, int32 two's complement; "
                                    f"index = slot * {values} + lane")
    return out
