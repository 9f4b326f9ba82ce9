"""--tp's hot collectives between ranks on one host (the o_proj/down_proj all-reduces, the head's
all-gather) through a shared-memory segment instead of gloo's TCP loopback (~1-2 ms each on a small
VM, ~60 a token).

The segment: per rank a cache line holding its sequence counter and its pid, then two banks of one
slot per rank. Collective number `seq` (every rank runs the same ones in the same order) uses bank
seq % 2: a rank copies its part into its slot, publishes seq (a release store, quant/kernels'
bk_shm_post), waits until every counter reaches seq (acquire loads, bk_shm_wait), then reads every
slot. A rank reuses a bank two collectives later, and it gets there only after every rank has
published seq + 1, i.e. finished reading seq. The sum adds the slots in rank order, so every rank
gets the same bits. A tensor larger than a slot goes in rounds of a slot each.

Rank 0 creates the file under /dev/shm and removes it once every rank has mapped it, so a crash
leaves nothing behind. A wait checks every 0.1 s that the peers live (their pids), so a rank that
died ends the pass with an error at once, and gives up after the step timeout as gloo does.
The float32 all-reduce is native (bk_tp_all_reduce), and the native decoder runs it inside a pass
(a CPU rank's blocks in one call, as a single process's): both count collectives in one counter.
"""
from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import time
import uuid

import torch
import torch.distributed as dist

from ..quant import native, settings

SLOT = 1 << 18  # bytes of one rank's part per round
LINE = 128  # a rank's counter and pid, alone on their cache lines (x86 prefetches lines in pairs)
CHECK = 0.1  # seconds between the waits' checks that the peers live


class Segment:
    def __init__(self, mem: mmap.mmap, rank: int, world: int, timeout: float):
        self.mem, self.rank, self.world, self.timeout = mem, rank, world, timeout
        self.bytes = torch.frombuffer(mem, dtype=torch.uint8)
        self.lines = self.bytes[:world * LINE].view(torch.int64).view(world, LINE // 8)
        self.base = self.bytes.data_ptr()
        self.data = _header(world)
        self._seq = ctypes.c_int64(0)  # the collectives so far, also counted by the native ones (desc)
        self.lib = native.library()
        # the native decoder's all-reduces (bk_tp_all_reduce): the same rounds, banks and checks
        self.desc = native.TP(self.base, ctypes.pointer(self._seq), rank, world, LINE, self.data, SLOT, CHECK, timeout)

    @property
    def seq(self) -> int:
        return self._seq.value

    def pids(self) -> list[int]:
        return self.lines[:, 1].tolist()

    def failure(self, rc: int) -> RuntimeError:
        """The error for a native collective's failure code (native.TP.GONE or TIMEOUT)."""
        gone = [r for r, pid in enumerate(self.pids()) if r != self.rank and not _alive(pid)]
        if rc == native.TP.GONE and gone:  # worded for _peer_failure, as gloo's reset connection is
            return RuntimeError(f"shared-memory collective: connection to rank {gone[0]} lost (it ended)")
        return RuntimeError(f"shared-memory collective timed out after {self.timeout:.0f} s")

    def _round(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `part` (flat, at most a slot), as views of their slots."""
        self._seq.value += 1
        bank = self.data + (self.seq % 2) * self.world * SLOT
        n = part.numel() * part.element_size()
        slots = [self.bytes[bank + r * SLOT:bank + r * SLOT + n].view(part.dtype) for r in range(self.world)]
        slots[self.rank].copy_(part)
        self.lib.bk_shm_post(self.base + self.rank * LINE, self.seq)
        deadline = time.monotonic() + self.timeout
        while not self.lib.bk_shm_wait(self.base, self.world, LINE, self.seq, CHECK):
            if any(r != self.rank and not _alive(pid) for r, pid in enumerate(self.pids())):
                raise self.failure(native.TP.GONE)
            if time.monotonic() > deadline:
                raise self.failure(native.TP.TIMEOUT)
        return slots

    def _rounds(self, t: torch.Tensor):
        flat = t.reshape(-1)
        per = SLOT // t.element_size()
        for lo in range(0, flat.numel(), per):
            yield lo, self._round(flat[lo:lo + per])

    def all_reduce(self, t: torch.Tensor) -> None:
        """t (contiguous) summed over the ranks in place, slot 0 + slot 1 + ... in rank order
        (float32 by the native decoder's own all-reduce)."""
        if t.dtype == torch.float32:
            rc = self.lib.bk_tp_all_reduce(self.desc, t.data_ptr(), t.numel())
            if rc:
                raise self.failure(rc)
            return
        flat = t.view(-1)
        for lo, slots in self._rounds(t):
            out = flat[lo:lo + slots[0].numel()]
            out.copy_(slots[0])
            for s in slots[1:]:
                out.add_(s)

    def gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's t (contiguous, the same shape on each) side by side along the last
        dimension, in rank order: [..., world n], each slot copied straight to its columns."""
        n = t.shape[-1]
        out = torch.empty((*t.shape[:-1], self.world * n), dtype=t.dtype)
        cols = out.view(-1, self.world, n)  # [rows, rank, n]
        for lo, slots in self._rounds(t):
            hi = lo + slots[0].numel()
            for r, s in enumerate(slots):
                at = lo
                while at < hi:  # the round's run of t's elements, a row's piece at a time
                    row, col = divmod(at, n)
                    take = min(n - col, hi - at)
                    cols[row, r, col:col + take].copy_(s[at - lo:at - lo + take])
                    at += take
        return out


def _header(world: int) -> int:
    return -(-world * LINE // 4096) * 4096


def _alive(pid: int) -> bool:
    """Whether process pid runs (a zombie has ended: its parent has not collected it yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def usable() -> bool:
    """Whether this rank would use a segment: every rank on this host (brisk's own launcher always,
    torchrun's when its local ranks are all of them), the switch on, the native library built."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    one_host = local is None or local == os.environ.get("WORLD_SIZE")
    return one_host and settings.TP_SHM.get() and os.path.isdir("/dev/shm") and native.library() is not None


def open_segment(rank: int, world: int, timeout: float) -> Segment | None:
    """Every rank's view of one new segment (a collective on the default group), or None on every
    rank where any does not want it or could not make or map it (gloo then)."""
    size = _header(world) + 2 * world * SLOT
    wanted, name = usable(), None
    if rank == 0 and wanted:
        name = f"/dev/shm/brisk-tp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(name)
            name = None
    box = [name]
    dist.broadcast_object_list(box, src=0)
    name, seg = box[0], None
    try:
        if name is not None and wanted:
            try:
                fd = os.open(name, os.O_RDWR)
                try:
                    seg = Segment(mmap.mmap(fd, size), rank, world, timeout)
                finally:
                    os.close(fd)
                seg.lines[rank, 1] = os.getpid()
            except OSError:
                seg = None
        ok = torch.tensor([int(seg is not None)])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # also: every rank has mapped it (and written its pid)
    finally:
        if rank == 0 and name is not None:
            os.unlink(name)
    return seg if ok.item() else None
