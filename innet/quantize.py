"""Fixed-point quantization of float32 gradients to int32 for switch aggregation, and its error bound.

A worker sends ``q = round_half_even(x * scale)`` as int32. To make sure the switch's saturating int32
adds never saturate, each worker's magnitude is limited to ``limit = (2**31 - 1) // world``: the sum of
``world`` such values always fits int32. A fragment holding any value with ``|x * scale| > limit`` (or a
NaN/inf) is not quantized: it travels as raw float32 bits in a packet with the ``overflow`` flag, which
the switch forwards to the parameter server, which adds it in float64.

Error bound of a reduced value (sum over ``world`` workers, result returned as float32)::

    |result - exact| <= q_workers * 0.5 / scale  +  2**-24 * |exact|  (+ a float64 rounding term,
                                                                        below 1e-15 * sum |x_i|)

where ``q_workers <= world`` is the number of workers whose fragment was quantized (not overflow):
rounding to the nearest integer loses at most half a unit (``0.5 / scale``) per worker; the integer sum
itself is exact; the last term is the rounding of the result to float32. ``error_bound`` computes it.

float32 and float64 inputs alike are quantized from their own value (a float64 input is never rounded
to float32 first). An overflow fragment travels as float32: exact for float32 inputs; for float64 inputs
its values lose up to ``2**-24 |x_i|`` each, so for float64 values beyond ``limit / scale`` (about
``2048 / world`` at the default scale) add ``2**-24 * sum_i |x_i|`` (``error_bound(..., overflow_abs_sum=)``).
"""

from __future__ import annotations

from typing import cast

import numpy as np

__all__ = ["INT32_MAX", "Quantizer", "error_bound"]

INT32_MAX = 2**31 - 1


class Quantizer:
    """Float32 <-> int32 fixed point with a per-job scale, sized so ``world`` int32 values never overflow."""

    def __init__(self, scale: float, world: int) -> None:
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"quantization scale must be a positive finite number, got {scale!r}")
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        self.scale = float(scale)
        self.world = int(world)
        #: largest magnitude one worker may send, so that world of them sum within int32
        self.limit = INT32_MAX // self.world

    def quantize_fragments(self, frags: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Quantize a (n, V) float32 or float64 matrix of fragments: (int32 matrix, bool[n] overflow).

        float64 values are quantized from their own value (never rounded to float32 first, which would
        add up to ``2**-25 |x|`` per worker, outside the bound). Overflowing rows of the int32 matrix hold
        the float32 bit patterns of the input instead.
        """
        frags = np.asarray(frags)
        if frags.dtype != np.float64:
            frags = frags.astype(np.float32, copy=False)
        scaled = frags.astype(np.float64) * self.scale
        with np.errstate(invalid="ignore"):
            bad = ~(np.abs(scaled) <= self.limit)          # also catches NaN and +-inf
        overflow = cast(np.ndarray, bad.any(axis=1) if frags.ndim == 2 else bad.any(keepdims=True))
        q = np.rint(np.where(bad, 0.0, scaled)).astype(np.int32)
        if overflow.any():
            q[overflow] = frags[overflow].astype(np.float32).view(np.int32)
        return q, overflow

    def quantize_into(self, x: np.ndarray, out: np.ndarray, scratch: np.ndarray | None = None) -> np.ndarray:
        """Quantize the flat array ``x`` into ``out``, an (n, V) int32 matrix of any byte order (e.g. the
        big-endian payload view of a packet buffer), zero-padded past ``x.size``; returns bool[n] overflow
        (those rows hold the float32 bit patterns of the input, as in ``quantize_fragments``).

        float32 input with a power-of-two scale >= 1 takes one pass in float32 (the product and its rounding
        are exact there, so the result equals ``quantize_fragments``); ``scratch`` is an optional float32
        buffer of ``out``'s shape; anything else goes through ``quantize_fragments``."""
        nrow, width = out.shape
        size = x.size
        if size > nrow * width:
            raise ValueError(f"{size} values do not fit {nrow} x {width}")
        mant, _ = np.frexp(self.scale)
        if x.dtype != np.float32 or mant != 0.5 or self.scale < 1:
            padded = np.zeros(nrow * width, np.float64 if x.dtype == np.float64 else np.float32)
            padded[:size] = x
            q, ovf = self.quantize_fragments(padded.reshape(nrow, width))
            out[...] = q
            return ovf
        buf = scratch if scratch is not None and scratch.shape == out.shape else np.empty(out.shape, np.float32)
        flat = buf.reshape(-1)
        np.multiply(x, np.float32(self.scale), out=flat[:size])
        flat[size:] = 0
        np.rint(buf, out=buf)
        # the largest float32 <= limit: a float32 product above it is above limit
        thr = np.float32(self.limit)
        if float(thr) > self.limit:
            thr = np.nextafter(thr, np.float32(0))
        with np.errstate(invalid="ignore"):
            overflow = ~(np.abs(buf).max(axis=1) <= thr)      # also NaN and +-inf
        if overflow.any():
            buf[overflow] = 0
        np.copyto(out, buf, casting="unsafe")
        if overflow.any():
            rows = np.zeros((int(overflow.sum()), width), np.float32)
            for k, r in enumerate(np.nonzero(overflow)[0]):
                part = x[r * width:(r + 1) * width]
                rows[k, :part.size] = part
            out[overflow] = rows.view(np.int32)
        return cast(np.ndarray, overflow)

    def dequantize_sum(self, int_sum: np.ndarray) -> np.ndarray:
        """The float64 value of a sum of quantized values."""
        return np.asarray(int_sum, dtype=np.float64) / self.scale


def error_bound(reference: np.ndarray, scale: float, world: int,
                overflow_abs_sum: np.ndarray | float = 0.0) -> np.ndarray:
    """Per-element bound on ``|innet result - exact sum|`` (see the module doc); ``reference`` is the exact sum.

    ``overflow_abs_sum``: for float64 inputs beyond the int32 range only, the sum over workers of ``|x_i|``
    of those elements (they travel as float32)."""
    ref = np.abs(np.asarray(reference, dtype=np.float64))
    return (world * 0.5 / scale + ref * 2.0**-24 + 1e-12 * (1.0 + ref)
            + np.asarray(overflow_abs_sum, dtype=np.float64) * 2.0**-24)
