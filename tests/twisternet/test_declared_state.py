"""The state declarations that let mypy check the Context's and the MPI channel's parts one by one
(twisternet/context/state.py, channels/mpi/state.py) match what the classes really have: a declared
attribute nobody sets, or a declared cross-part method no part defines, would type-check and then fail
with AttributeError at run time."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from twisternet.context import Context
from twisternet.context.state import ContextState
from twisternet.testing import run_local

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]


def _type_checking_methods(cls: type) -> list[str]:
    """Names of the methods ``cls`` declares under ``if TYPE_CHECKING:`` in its class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0]
    assert isinstance(body, ast.ClassDef)
    names = []
    for node in body.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            names += [f.name for f in node.body if isinstance(f, ast.FunctionDef)]
    return names


def _assigned_self_attributes(paths: list[Path]) -> set[str]:
    """Every ``self.NAME = ...`` (or annotated) assignment target in the files."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        names.add(sub.attr)
    return names


def test_context_has_every_declared_attribute_and_method() -> None:
    methods = _type_checking_methods(ContextState)
    assert methods, "no cross-part methods found: the parser no longer sees the TYPE_CHECKING block"
    missing_methods = [m for m in methods if not callable(getattr(Context, m, None))]
    assert not missing_methods, f"declared in ContextState but defined by no part of Context: {missing_methods}"

    def job(ctx: Context) -> list[str]:
        return [a for a in ContextState.__annotations__ if not hasattr(ctx, a)]

    for world, progress in ((1, "manual"), (2, "thread")):
        for missing in run_local(world, job, progress=progress):
            assert not missing, f"declared in ContextState but never set on a Context: {missing}"


def test_mpi_channel_has_every_declared_attribute_and_method() -> None:
    from channels.mpi.channel import MPIChannel   # no MPI initialisation at import
    from channels.mpi.state import MPIChannelState

    methods = _type_checking_methods(MPIChannelState)
    assert methods, "no cross-part methods found: the parser no longer sees the TYPE_CHECKING block"
    missing_methods = [m for m in methods if not callable(getattr(MPIChannel, m, None))]
    assert not missing_methods, f"declared in MPIChannelState but defined by no part: {missing_methods}"
    # Attributes: set in MPIChannel.__init__ (or later by a part), or by the Channel base class.
    assigned = _assigned_self_attributes([*sorted((ROOT / "channels" / "mpi").glob("*.py")),
                                          ROOT / "twisternet" / "channel.py"])
    missing = [a for a in MPIChannelState.__annotations__ if a not in assigned]
    assert not missing, f"declared in MPIChannelState but never assigned: {missing}"


def _operation_classes() -> list[type]:
    """Every operation class the collectives package defines (Operation and its subclasses)."""
    import collectives  # noqa: F401 - defines every operation class
    from collectives.base import Operation

    found: list[type] = [Operation]
    for cls in found:
        found += [s for s in cls.__subclasses__() if s not in found]
    return found


def test_operations_have_every_declared_attribute_and_method() -> None:
    """The declarations of collectives/base/state.py (OperationState), collectives/uptree.py (UpTreeState)
    and of the parts mixed into operations (table paths, Gather's finish quorum), checked against each
    operation class whose parts they declare for."""
    from collectives.base.state import OperationState
    from collectives.columnar import GatherTables, PartitionTables
    from collectives.uptree import UpTreeState

    assert _type_checking_methods(OperationState) and _type_checking_methods(PartitionTables), \
        "no cross-part methods found: the parser no longer sees the TYPE_CHECKING blocks"
    assigned = _assigned_self_attributes(sorted((ROOT / "collectives").rglob("*.py")))
    classes = _operation_classes()
    names = {c.__name__ for c in classes}
    assert {"Partition", "KeyedPartition", "Broadcast", "Gather", "AllGather", "KeyedGather", "KeyedReduce",
            "Reduce", "AllReduce"} <= names, names
    parts_seen: set[type] = set()
    for cls in classes:
        for part in cls.__mro__:
            if not (isinstance(part, type) and issubclass(part, OperationState)):
                continue
            parts_seen.add(part)
            missing_methods = [m for m in _type_checking_methods(part) if not callable(getattr(cls, m, None))]
            assert not missing_methods, f"declared in {part.__name__}, defined by no part of {cls.__name__}: " \
                                        f"{missing_methods}"
            declared = part.__dict__.get("__annotations__", {})
            missing = [a for a in declared if a not in assigned and not hasattr(cls, a)]
            assert not missing, f"declared in {part.__name__}, never set on a {cls.__name__}: {missing}"
    assert {OperationState, UpTreeState, GatherTables, PartitionTables} <= parts_seen


def test_operation_state_is_set_on_live_operations() -> None:
    from collectives import Gather, Partition
    from collectives.base.state import OperationState

    def job(ctx: Context) -> list[str]:
        missing = []
        for i, make in enumerate((Gather, Partition)):
            with make(ctx, edge=10 + i) as op:
                missing += [f"{make.__name__}.{a}" for a in OperationState.__annotations__ if not hasattr(op, a)]
                for t in op.local_sources:
                    op.finish(t)
                if op.local_destinations:
                    list(op.results())
        return missing

    for missing in run_local(2, job):
        assert not missing, f"declared in OperationState but never set on an operation: {missing}"
