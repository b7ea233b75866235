"""A worker's packets of one call, built for a whole window at a time (``innet.worker``).

``FragmentPackets`` holds every fragment of a call as a ready packet: one row of a ``uint8`` matrix per
fragment (same wire format as ``innet.wire.encode``), the payload quantized straight into it
(``Quantizer.quantize_into``), the header's constant fields written for all rows at once. Only the
aggregator index (known when the fragment enters the window) and the resend flag change later, in
place, for whole sets of rows. The buffers are kept between calls of the same size.

The vectorized aggregator-index functions equal ``aggregator_index`` / ``rehash_index`` of the worker
element by element.
"""

from __future__ import annotations

import numpy as np

from .quantize import Quantizer
from .wire import FLAG_OVERFLOW, FLAG_RESEND, HEADER_DTYPE, HEADER_SIZE, SEQ_MASK

__all__ = ["FragmentPackets", "mix32_array", "aggregator_indices", "rehash_indices", "decode_headers"]

_M32 = np.uint64(0xFFFFFFFF)


def mix32_array(x: np.ndarray) -> np.ndarray:
    """``worker._mix32`` of every element (uint64 arithmetic, 32-bit result)."""
    x = np.asarray(x).astype(np.uint64) & _M32
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _M32
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _M32
    x ^= x >> np.uint64(16)
    return x


def aggregator_indices(job_id: int, seqs: np.ndarray, num_aggregators: int) -> np.ndarray:
    """``aggregator_index(job_id, s, n)`` for every ``s`` of ``seqs`` (int64)."""
    off = int(mix32_array(np.array([job_id]))[0])
    return ((np.asarray(seqs, np.int64) & SEQ_MASK) + off) % num_aggregators


def rehash_indices(indices: np.ndarray, seqs: np.ndarray, num_aggregators: int) -> np.ndarray:
    """``rehash_index(i, s, n)`` element by element (int64)."""
    mixed = np.asarray(indices, np.uint64) * np.uint64(0x9E3779B1) + np.asarray(seqs, np.uint64) + np.uint64(1)
    return (mix32_array(mixed) % np.uint64(num_aggregators)).astype(np.int64)


def decode_headers(rows: np.ndarray) -> np.ndarray:
    """The headers of a (n, >= 16) uint8 matrix of packets as a structured array (``HEADER_DTYPE``)."""
    return np.ascontiguousarray(rows[:, :HEADER_SIZE]).view(HEADER_DTYPE).reshape(-1)


class FragmentPackets:
    """The packets of one call (see the module doc); reused by later calls of the same shape."""

    def __init__(self, nfrag: int, value_count: int) -> None:
        self.nfrag, self.value_count = nfrag, value_count
        self.size = HEADER_SIZE + 4 * value_count
        self.rows = np.zeros((nfrag, self.size), np.uint8)
        self.payload = self.rows[:, HEADER_SIZE:].view(">i4")
        self._scratch = np.empty((nfrag, value_count), np.float32)

    def fill(self, x: np.ndarray, quantizer: Quantizer, *, bitmap0: int, bitmap1: int, flags_word: int,
             job_seq0: int) -> np.ndarray:
        """Quantize the flat array ``x`` into the payloads and write every header (aggregator index 0,
        jobID+seq ``job_seq0 + i`` with the seq wrapping in 24 bits); returns bool[nfrag] overflow."""
        ovf = quantizer.quantize_into(x, self.payload, self._scratch)
        hdr = np.empty(self.nfrag, HEADER_DTYPE)
        hdr["bitmap0"] = bitmap0
        hdr["bitmap1"] = bitmap1
        hdr["flags"] = flags_word | np.where(ovf, FLAG_OVERFLOW, 0)
        hdr["agg_index"] = 0
        job_bits = job_seq0 & ~SEQ_MASK
        hdr["job_seq"] = job_bits | ((np.arange(self.nfrag, dtype=np.int64) + (job_seq0 & SEQ_MASK)) & SEQ_MASK)
        self.rows[:, :HEADER_SIZE] = hdr.view(np.uint8).reshape(self.nfrag, HEADER_SIZE)
        return ovf

    def set_indices(self, rows: np.ndarray | slice, indices: np.ndarray) -> None:
        """Write the aggregator index (u16, big-endian) of ``rows``."""
        idx = np.asarray(indices, np.int64)
        self.rows[rows, 10] = (idx >> 8) & 0xFF
        self.rows[rows, 11] = idx & 0xFF

    def mark_resend(self, rows: np.ndarray) -> None:
        """Set the resend flag of ``rows`` (flags are bytes 8..9; the flag bits are in byte 9)."""
        self.rows[rows, 9] |= FLAG_RESEND
