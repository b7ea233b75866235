"""Engine of the operations that flow *up* k-ary trees towards their destinations (Reduce, Gather, their
All- and Keyed- variants): per-tree node state at this rank, finish bookkeeping and completion.

Records on the up edges are ``(kind, tree, payload)`` with ``tree`` the destination task a tree serves:

* ``("d", tree, payload)`` data (what the payload is depends on the operation);
* ``("f", tree, [tasks])`` these source tasks finished (forwarded at once: diagnostics at the root);
* ``("c", tree, payload)`` the sender's whole subtree finished; ``payload`` is its final partial state.

A child at depth ``L + 1`` sends on channel edge ``UP_BASE + L`` (see :mod:`collectives.edges`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from .base import Operation
from .base.state import OperationState
from .edges import UP_BASE
from .routing import KaryTree, tree_for


class Node:
    """This rank's place in one up tree, with the operation's per-node state."""

    __slots__ = ("tid", "root", "parent", "children", "level", "local_done", "children_done", "finished",
                 "complete", "state")

    def __init__(self, tid: int, tree: KaryTree, rank: int) -> None:
        self.tid = tid
        self.root = tree.root
        self.parent = tree.parent(rank)
        self.children = tree.children(rank)
        self.level = tree.level(rank)
        self.local_done: set[int] = set()
        self.children_done: set[int] = set()
        self.finished: set[int] = set()
        self.complete = False
        self.state: Any = None

    @property
    def is_root(self) -> bool:
        return self.parent is None


class UpTreeState(OperationState):
    """Declarations of what the parts of an up-tree operation (mixins such as its table path) use of
    :class:`UpTreeOperation`, as :class:`~collectives.base.state.OperationState` does for Operation."""

    #: This rank's node of each tree, by the destination task the tree serves.
    _nodes: dict[int, Node]

    if TYPE_CHECKING:
        def _flush_node(self, node: Node) -> None: ...
        def _root_finished(self, tasks: list[int]) -> None: ...


class UpTreeOperation(Operation, UpTreeState):
    """Base of tree-reduction/gather operations; subclasses fill in the ``_up_*`` and ``_root_*`` hooks."""

    def _build_up(self, roots: dict[int, int]) -> None:
        """One tree per ``tid -> root rank`` over the source ranks plus the root."""
        members = set(self.source_ranks)
        self._nodes = {}
        depth = 0
        for tid, root in roots.items():
            tree = tree_for(self.ctx, root, members | {root}, self.fanout)   # host-aware when known
            depth = max(depth, tree.depth)
            if self.rank in tree:
                node = Node(tid, tree, self.rank)
                node.state = self._new_state(node)
                self._nodes[tid] = node
        for level in range(depth):
            self._register(UP_BASE + level, self._on_up)

    # ------------------------------------------------------------------ hooks
    def _new_state(self, node: Node) -> Any:
        return None

    def _up_data(self, node: Node, src: int, payload: Any) -> bool:
        raise NotImplementedError

    def _up_child_done(self, node: Node, src: int, payload: Any) -> None:
        pass

    def _up_local_finish(self, node: Node, task: int) -> None:
        pass

    def _up_ready(self, node: Node) -> bool:
        return True

    def _up_final(self, node: Node) -> Any:
        return None

    def _root_complete(self, node: Node) -> None:
        raise NotImplementedError

    def _flush_node(self, node: Node) -> None:
        """Send records buffered at ``node`` (batch mode) before a finish or completion marker."""

    def _root_finished(self, tasks: list[int]) -> None:
        """The root learned that ``tasks`` finished (AllReduce/AllGather pass it down)."""

    def _root_room(self, node: Node) -> bool:
        return self._sink_room(node.tid)

    # ------------------------------------------------------------------ helpers
    def _up_send(self, node: Node, kind: str, payload: Any) -> None:
        self._emit(cast(int, node.parent), UP_BASE + node.level - 1, (kind, node.tid, payload))  # not the root

    def _out_room(self, node: Node) -> bool:
        """Whether output of ``node`` can move on now (parent has credit, or the root has room)."""
        if node.parent is None:
            return self._root_room(node)
        return self._can_send(node.parent, UP_BASE + node.level - 1)

    def _check_complete(self, node: Node) -> None:
        if node.complete:
            return
        if len(node.local_done) < len(self.local_sources) or len(node.children_done) < len(node.children):
            return
        if not self._up_ready(node):
            return
        node.complete = True
        self._changed = True
        if node.parent is not None:
            self._flush_node(node)
            self._up_send(node, "c", self._up_final(node))
        else:
            self._root_complete(node)

    def _duties_done(self) -> bool:
        return all(n.complete for n in self._nodes.values()) and super()._duties_done()

    def _known_finished(self, task: int | None) -> set[int]:
        out = set(self._finished_local)
        node = self._nodes.get(task) if task is not None else None
        if node is not None:
            out |= node.finished
        return out

    # ------------------------------------------------------------------ events
    def _on_local_finish(self, task: int) -> None:
        for node in self._nodes.values():
            node.finished.add(task)
            node.local_done.add(task)
            if node.parent is not None:
                self._flush_node(node)
                self._up_send(node, "f", [task])
            else:
                self._root_finished([task])
            self._up_local_finish(node, task)
            self._check_complete(node)

    def _on_up(self, src: int, msg: Any) -> bool:
        try:
            kind, tid, payload = msg
            node = self._nodes[tid]
        except (TypeError, ValueError, KeyError):
            raise self._protocol(src, msg) from None
        if src not in node.children:
            raise self._protocol(src, msg)
        if kind == "d":
            return self._up_data(node, src, payload)
        if kind == "f":
            node.finished.update(payload)
            if node.parent is not None:
                self._up_send(node, "f", payload)
            else:
                self._root_finished(list(payload))
            self._changed = True
            return True
        if kind == "c":
            if src in node.children_done:
                raise self._protocol(src, msg)
            node.children_done.add(src)
            self._up_child_done(node, src, payload)
            self._check_complete(node)
            return True
        raise self._protocol(src, msg)
