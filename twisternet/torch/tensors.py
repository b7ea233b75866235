"""What crosses between torch and twisternet: reduce ops translated, tensors checked (CPU only), numpy
views of their memory, results copied into output tensors; :class:`TorchBackendError`."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from twisternet.codec import as_array
from twisternet.errors import TwisternetError


class TorchBackendError(TwisternetError, RuntimeError):
    """A torch.distributed call the twisternet backend cannot carry out (op, device, dtype)."""


_REDUCE_OPS = {"SUM": "sum", "AVG": "avg", "MIN": "min", "MAX": "max", "PRODUCT": "prod"}


def _op_name(op: Any, what: str) -> str:
    for name, ours in _REDUCE_OPS.items():
        if op == getattr(dist.ReduceOp, name):
            return ours
    name = str(getattr(op, "op", op)).rsplit(".", 1)[-1]
    raise TorchBackendError(f"twisternet backend: {what} does not support ReduceOp.{name}; use SUM, AVG, MIN, "
                            "MAX or PRODUCT")


def _check_tensor(t: Any, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TorchBackendError(f"twisternet backend: {what} takes tensors, got {type(t).__qualname__}")
    if t.device.type != "cpu":
        raise TorchBackendError(f"twisternet backend: {what} got a tensor on device {str(t.device)!r}; the "
                                "backend moves CPU tensors only (use gloo or nccl for this device, or .cpu())")


def _view(t: torch.Tensor) -> np.ndarray:
    arr = as_array(t)
    assert arr is not None
    return arr


def _copy_into(out: torch.Tensor, got: Any, what: str, *, flat: bool = False) -> None:
    src = np.asarray(got)
    dst = _view(out)
    if flat:
        if src.size != dst.size:
            raise TorchBackendError(f"{what}: got {src.size} elements for an output of {dst.size}")
        dst.reshape(-1)[...] = src.reshape(-1) if dst.flags.c_contiguous else src.reshape(dst.shape)
        if not dst.flags.c_contiguous:
            dst[...] = src.reshape(dst.shape)
        return
    if src.shape != dst.shape:
        raise TorchBackendError(f"{what}: got a tensor of shape {list(src.shape)} for an output of shape "
                                f"{list(dst.shape)}; every rank must pass tensors of the same shape")
    dst[...] = src


def _split(t: torch.Tensor, sizes: list[int] | None, n: int, what: str) -> list[torch.Tensor]:
    if not sizes:
        if t.shape[0] % n:
            raise TorchBackendError(f"{what}: dim 0 ({t.shape[0]}) is not divisible by {n} ranks")
        sizes = [t.shape[0] // n] * n
    if len(sizes) != n or sum(sizes) != t.shape[0]:
        raise TorchBackendError(f"{what}: split sizes {sizes} do not cover dim 0 ({t.shape[0]}) over {n} ranks")
    return list(torch.split(t, list(sizes)))

