"""Fast, in-process checks of the torch integration: zero-copy tensors in the codec, the functional layer
on tensors (local channel), and the registered backend in a one-process group with DDP."""

from __future__ import annotations

import array
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'twisternet[torch]')")

import twisternet as tn
from twisternet.codec import Codec, as_array
from twisternet.errors import CodecError
from twisternet.testing import run_local


def test_a_cpu_tensor_travels_as_a_numpy_view_of_its_memory() -> None:
    t = torch.arange(1 << 16, dtype=torch.float32)
    parts = Codec().encode(t)
    big = parts[-1]
    assert isinstance(big, memoryview) and np.shares_memory(np.asarray(big), t.numpy())   # no copy on send
    back = Codec().decode(b"".join(parts))
    assert isinstance(back, np.ndarray) and back.dtype == np.float32 and np.array_equal(back, t.numpy())
    # inside containers too, and a tensor that needs grad is sent detached
    w = torch.ones(3, requires_grad=True)
    got = Codec().decode(Codec().encode_bytes({"w": w, "pair": (torch.zeros(2, 2, dtype=torch.int64),)}))
    assert got["w"].tolist() == [1.0, 1.0, 1.0] and got["pair"][0].dtype == np.int64


def test_other_devices_and_dtypes_numpy_lacks_are_clear_errors() -> None:
    with pytest.raises(CodecError, match="device 'meta'.*cpu"):
        Codec().encode(torch.ones(3, device="meta"))
    with pytest.raises(CodecError, match="bfloat16"):
        Codec().encode(torch.ones(3, dtype=torch.bfloat16))


def test_buffer_protocol_array_interface_and_dlpack_objects_are_views() -> None:
    base = np.arange(6.0)

    class Iface:
        __array_interface__ = base.__array_interface__

    class Dl:
        def __dlpack__(self, **kw):
            return base.__dlpack__(**kw)

        def __dlpack_device__(self):
            return base.__dlpack_device__()
    for obj in (Iface(), Dl()):
        v = as_array(obj)
        assert np.shares_memory(v, base)
    a = array.array("d", [1.0, 2.0])
    assert np.shares_memory(as_array(a), np.frombuffer(a))
    assert Codec().decode(Codec().encode_bytes(a)).tolist() == [1.0, 2.0]
    assert as_array(b"bytes") is None and as_array(3) is None


def test_functional_calls_take_tensors_and_write_into_them() -> None:
    def body(ctx):
        t = torch.full((1000,), float(ctx.rank + 1))
        res = tn.all_reduce(t, "avg", out=t, ctx=ctx)
        fresh = tn.all_reduce(torch.ones(4), ctx=ctx)
        b = torch.zeros(3)
        tn.broadcast(torch.arange(3.0) if ctx.rank == 0 else None, src=0, out=b, ctx=ctx)
        return res is t, t[0].item(), type(fresh).__name__, fresh.tolist(), b.tolist()
    for same, v, kind, fresh, b in run_local(2, body, timeout=60):
        assert same and v == 1.5 and kind == "Tensor" and fresh == [2.0] * 4 and b == [0.0, 1.0, 2.0]


def test_one_process_group_and_ddp(monkeypatch) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import twisternet.torch as tt
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert "twisternet" in dist.Backend.backend_list
    ctx = tn.init(channel="local")
    try:
        dist.init_process_group("twisternet", store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=60), pg_options={"via": "tree"})
        try:
            pg = dist.distributed_c10d._get_default_group()
            assert isinstance(pg, tt.ProcessGroupTwisternet) and pg.ctx is ctx and pg.via == "tree"
            t = torch.ones(5)
            dist.all_reduce(t, op=dist.ReduceOp.AVG)
            assert t.tolist() == [1.0] * 5
            with pytest.raises(tt.TorchBackendError, match="BAND"):
                dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.BAND)
            model = DDP(torch.nn.Linear(4, 1))
            before = [p.detach().clone() for p in model.parameters()]
            model(torch.ones(2, 4)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
            assert any(not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))
        finally:
            dist.destroy_process_group()
    finally:
        tn.functional.release(ctx)
        ctx.close()
