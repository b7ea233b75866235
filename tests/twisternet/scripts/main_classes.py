"""Every rank sends objects of this script's own classes (one holding a 64 MB array) to rank 0, which
checks that they arrive as instances of *its* classes, intact, and that the sender did not copy the
array into the message (its codec parts hold the array's memory itself)."""

import dataclasses
import enum
import hashlib

import numpy as np

import twisternet as tn
from collectives import Gather

BIG = 64 << 20


class Color(enum.Enum):
    RED = 1
    BLUE = 2


@dataclasses.dataclass
class Point:
    x: int
    color: Color

    def norm(self) -> int:
        return abs(self.x)


@dataclasses.dataclass
class Holder:
    name: str
    data: np.ndarray
    point: Point


def holder_of(rank: int) -> Holder:
    return Holder(f"rank{rank}", np.full(BIG // 8, rank + 0.5), Point(-rank, Color.BLUE))


with tn.init() as ctx:
    mine = holder_of(ctx.rank)
    parts = ctx.codec.encode(mine)
    sizes = [memoryview(p).nbytes for p in parts]
    shared = [p for p in parts if isinstance(p, memoryview) and p.nbytes == BIG
              and np.shares_memory(np.frombuffer(p, np.uint8), mine.data)]
    print(f"PARTS rank={ctx.rank} oob={len(shared)} inband={sum(sizes) - BIG}", flush=True)
    del parts, shared

    g = Gather(ctx, sources=ctx.tasks, destinations=[0], edge=1, mode="batch")
    for t in ctx.my_tasks:
        g.send(t, mine, copy=False)
        g.finish(t)
    if ctx.rank == 0:
        for _, h in g.results():
            rank = int(h.name[4:])
            want = holder_of(rank)
            print(f"GOT from={rank} holder={isinstance(h, Holder)} point={isinstance(h.point, Point)} "
                  f"color={h.point.color is Color.BLUE} norm={h.point.norm()} "
                  f"data={hashlib.sha1(h.data).hexdigest() == hashlib.sha1(want.data).hexdigest()} "
                  f"writable={h.data.flags.writeable}", flush=True)
    g.close()
