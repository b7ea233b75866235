"""Type stub of the compiled host I/O helper (innet/_hostio.c); see innet/hostio.py."""

from typing import Any as Buffer

def recv_rows(fd: int, buf: Buffer, row_size: int, max_count: int, lengths: Buffer,
              addrs: Buffer) -> tuple[int, int]: ...
def send_rows(fd: int, buf: Buffer, row_size: int, length: int, rows: Buffer, addrs: Buffer | None,
              gso: bool) -> tuple[int, int, bool]: ...
