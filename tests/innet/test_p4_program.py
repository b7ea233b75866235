"""atp.p4, its P4Info and the server's binding table must agree with each other and with SwitchControl.

No P4 compiler is available, so the P4_16 source is checked by a small parser here: every table, action,
counter and register of the P4Info must be declared in atp.p4 inside the control its name says, with the
same parameters, widths, match kinds, sizes and default actions.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

import innet.control as control
from innet.control import AggregatorState, SwitchControl
from innet.p4runtime import bindings
from innet.p4runtime.protos import p4info_pb2
from innet.p4runtime.schema import AtpSchema, load_p4info

P4_DIR = Path(__file__).resolve().parents[2] / "innet" / "p4"
P4_SOURCE = (P4_DIR / "atp.p4").read_text()
V1MODEL_WIDTHS = {"std.egress_port": 9, "std.ingress_port": 9, "std.egress_spec": 9}


def _strip_comments(src: str) -> str:
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    return re.sub(r"//[^\n]*", " ", src)


SRC = _strip_comments(P4_SOURCE)
DEFINES = dict(re.findall(r"^#define\s+(\w+)\s+(\d+)\s*$", SRC, flags=re.M))
TYPEDEFS = dict((name, int(w)) for w, name in re.findall(r"typedef\s+bit<(\d+)>\s+(\w+)\s*;", SRC))


def _eval(expr: str) -> int:
    expr = re.sub(r"\b[A-Z_][A-Z0-9_]*\b", lambda m: DEFINES.get(m.group(0), m.group(0)), expr)
    assert re.fullmatch(r"[\d\s*+()-]+", expr), f"cannot evaluate {expr!r}"
    return int(eval(expr))  # digits and arithmetic only (checked above)


def _width(type_text: str) -> int:
    type_text = type_text.strip()
    m = re.fullmatch(r"bit<\s*([^>]+)\s*>", type_text)
    if m:
        return _eval(m.group(1))
    return TYPEDEFS[type_text]


def _blocks(keyword: str, src: str) -> dict[str, str]:
    """Bodies of ``keyword NAME(...) { ... }`` / ``keyword NAME { ... }`` blocks, by brace matching."""
    out = {}
    for m in re.finditer(rf"\b{keyword}\s+(\w+)\s*(\([^)]*\))?\s*\{{", src):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(src[i], 0)
            i += 1
        out[m.group(1)] = src[m.end():i - 1]
    return out


CONTROLS = _blocks("control", SRC)
METADATA_FIELDS = {
    f"meta.{name}": _width(t)
    for t, name in re.findall(r"(bit<[^>]+>|\w+)\s+(\w+)\s*;", _blocks("struct", SRC)["metadata_t"])
}


def _control_of(p4info_name: str) -> tuple[str, str]:
    ctrl, _, obj = p4info_name.rpartition(".")
    return ctrl, obj


@pytest.fixture(scope="module")
def p4info() -> p4info_pb2.P4Info:
    return load_p4info()


def test_p4info_ids_carry_their_type_prefix(p4info):
    prefixes = p4info_pb2.P4Ids
    for objs, prefix in ((p4info.tables, prefixes.TABLE), (p4info.actions, prefixes.ACTION),
                         (p4info.counters, prefixes.COUNTER), (p4info.registers, prefixes.REGISTER)):
        for obj in objs:
            assert obj.preamble.id >> 24 == prefix, obj.preamble.name
    ids = [o.preamble.id for objs in (p4info.tables, p4info.actions, p4info.counters, p4info.registers)
           for o in objs]
    assert len(ids) == len(set(ids))


def test_every_action_is_declared_with_the_same_parameters(p4info):
    for action in p4info.actions:
        if action.preamble.name == "NoAction":          # from core.p4
            assert not action.params
            continue
        ctrl, name = _control_of(action.preamble.name)
        m = re.search(rf"\baction\s+{name}\s*\(([^)]*)\)", CONTROLS[ctrl])
        assert m, f"action {name} not declared in control {ctrl}"
        declared = [p.strip().rsplit(None, 1) for p in m.group(1).split(",") if p.strip()]
        assert [(n, _width(t)) for t, n in declared] == \
            [(p.name, p.bitwidth) for p in action.params], name
        assert [p.id for p in action.params] == list(range(1, len(action.params) + 1))


def test_every_table_is_declared_with_its_key_actions_default_and_size(p4info):
    actions = {a.preamble.id: a.preamble.name.rpartition(".")[2] for a in p4info.actions}
    for table in p4info.tables:
        ctrl, name = _control_of(table.preamble.name)
        body = _blocks("table", CONTROLS[ctrl]).get(name)
        assert body is not None, f"table {name} not declared in control {ctrl}"
        keys = re.findall(r"([\w.]+)\s*:\s*(\w+)\s*@name\(\"(\w+)\"\)", body)
        assert [(k[2], k[1]) for k in keys] == \
            [(mf.name, p4info_pb2.MatchField.MatchType.Name(mf.match_type).lower())
             for mf in table.match_fields]
        for (field, _, _), mf in zip(keys, table.match_fields):
            width = METADATA_FIELDS.get(field) or V1MODEL_WIDTHS[field]
            assert width == mf.bitwidth, f"{name}.{mf.name}"
        listed = re.search(r"actions\s*=\s*\{([^}]*)\}", body).group(1)
        listed_names = [re.sub(r"@\w+", "", a).strip() for a in listed.split(";") if a.strip()]
        assert sorted(listed_names) == sorted(actions[ref.id] for ref in table.action_refs)
        for ref in table.action_refs:
            default_only = "@defaultonly" in listed.split(actions[ref.id])[0].rsplit(";", 1)[-1]
            assert default_only == (ref.scope == p4info_pb2.ActionRef.DEFAULT_ONLY), actions[ref.id]
        default = re.search(r"const\s+default_action\s*=\s*(\w+)\s*\(", body).group(1)
        assert default == actions[table.const_default_action_id]
        assert _eval(re.search(r"size\s*=\s*([^;]+);", body).group(1)) == table.size


def test_every_counter_and_register_is_declared_with_type_and_size(p4info):
    for counter in p4info.counters:
        ctrl, name = _control_of(counter.preamble.name)
        m = re.search(rf"\bcounter\s*\(([^,]+),\s*CounterType\.(\w+)\s*\)\s*{name}\s*;", CONTROLS[ctrl])
        assert m, f"counter {name} not declared in control {ctrl}"
        assert _eval(m.group(1)) == counter.size
        assert m.group(2).upper() == p4info_pb2.CounterSpec.Unit.Name(counter.spec.unit)
    for register in p4info.registers:
        ctrl, name = _control_of(register.preamble.name)
        m = re.search(rf"\bregister\s*<\s*(bit<[^>]+>)\s*>\s*\(([^;]+)\)\s*{name}\s*;", CONTROLS[ctrl])
        assert m, f"register {name} not declared in control {ctrl}"
        assert _width(m.group(1)) == register.type_spec.bitstring.bit.bitwidth, name
        assert _eval(m.group(2)) == register.size, name


def test_p4_objects_not_in_p4info_do_not_exist(p4info):
    """The reverse direction: atp.p4 declares nothing the P4Info forgot (bar internal helper actions)."""
    names = {o.preamble.name.rpartition(".")[2]
             for objs in (p4info.tables, p4info.counters, p4info.registers) for o in objs}
    for body in CONTROLS.values():
        for name in re.findall(r"\btable\s+(\w+)\s*\{", body):
            assert name in names
        for name in re.findall(r"\bcounter\s*\([^)]*\)\s*(\w+)\s*;", body):
            assert name in names
        for name in re.findall(r"\bregister\s*<.*?>\s*\([^;]*\)\s*(\w+)\s*;", body):
            assert name in names


def test_header_layout_matches_the_wire_format():
    from innet import wire
    atp = _blocks("header", SRC)["atp_t"]
    widths = [_width(t) for t, _ in re.findall(r"(bit<[^>]+>)\s+(\w+)\s*;", atp)]
    assert sum(widths) == 8 * wire.HEADER_SIZE
    assert int(DEFINES["VALUE_COUNT"]) == wire.DEFAULT_VALUE_COUNT
    assert int(DEFINES["JOB_ID_BITS"]) == 32 - wire.SEQ_BITS
    assert 2 ** int(DEFINES["JOB_ID_BITS"]) - 1 == wire.MAX_JOB_ID


def test_every_p4info_object_is_bound_and_resolves(p4info):
    schema = AtpSchema.from_p4info(p4info)
    short = lambda o: o.preamble.alias or o.preamble.name.rpartition(".")[2]  # noqa: E731
    assert {short(t) for t in p4info.tables} == set(bindings.TABLES)
    assert {short(c) for c in p4info.counters} == set(bindings.COUNTERS)
    assert {short(r) for r in p4info.registers} == set(bindings.REGISTERS)
    bound_actions = {b.action for b in bindings.TABLES.values()} | set(bindings.DEFAULT_ONLY_ACTIONS)
    assert {short(a) for a in p4info.actions} == bound_actions
    assert len(schema.tables) == len(p4info.tables)
    for alias, binding in bindings.TABLES.items():
        assert [p.name for p in schema.table(alias).params] == list(binding.params)


def test_binding_methods_exist_on_the_switch_control_protocol():
    protocol = {n for n in vars(SwitchControl) if not n.startswith("_")}
    assert bindings.all_switch_methods() <= protocol
    # counter names as documented in innet/control.py (an independent statement of the contract)
    documented = re.search(r"#: Counter names: (.*)", Path(control.__file__).read_text()).group(1)
    assert set(bindings.COUNTERS.values()) == set(re.findall(r'"(\w+)"', documented))
    fields = {f.name for f in dataclasses.fields(AggregatorState)}
    for rb in bindings.REGISTERS.values():
        assert rb.field is None or rb.field in fields
        assert (rb.field is None) == (rb.write is not None)


def test_a_p4info_missing_objects_is_rejected_with_every_problem(p4info):
    from innet.p4runtime.errors import P4RuntimeError
    broken = p4info_pb2.P4Info()
    broken.CopyFrom(p4info)
    del broken.counters[0]
    del broken.registers[-1]
    broken.actions[0].params[0].name = "fanin"
    with pytest.raises(P4RuntimeError) as info:
        AtpSchema.from_p4info(broken)
    assert info.value.code_name == "INVALID_ARGUMENT"
    for word in ("aggregated", "ecn_threshold", "set_job"):
        assert word in info.value.message
