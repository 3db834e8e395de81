"""A one-writer, many-reader ring of messages in shared memory (vLLM's ``MessageQueue``).

The executor writes each step's message once; every worker process reads the same bytes from
the same shared pages, so a step costs one encode and no per-worker pickling or socket copy.

Layout of the one ``multiprocessing.shared_memory`` block: ``num_slots`` read flags per reader
(1 = this reader has read the slot, or it was never written), then ``num_slots`` data slots of
``slot_bytes`` each: a 4-byte payload length, a 1-byte "more chunks follow" flag, the payload.
A message larger than a slot spans consecutive slots. The writer fills a slot only when every
reader has flagged it read; it writes the payload before clearing the flags, and x86 keeps
stores in order, so a reader that sees its flag cleared sees the payload.

Readers sleep on a per-reader semaphore instead of spinning (the machine's cores compute the
model); the writer releases each reader's semaphore once per chunk it writes.
"""
from __future__ import annotations

import struct
import time
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any, Callable

_HEADER = struct.Struct("<IB")  # payload length, more-chunks flag


@dataclass(frozen=True, slots=True)
class RingHandle:
    """What a reader process needs to attach (picklable: passed when the process spawns)."""

    name: str
    num_readers: int
    num_slots: int
    slot_bytes: int
    semaphores: tuple[Any, ...]  # one multiprocessing.Semaphore per reader


class ShmRingBuffer:
    """Create with :meth:`create` (the writer) and attach with :meth:`attach` (a reader)."""

    def __init__(self, shm: shared_memory.SharedMemory, handle: RingHandle, reader: int | None,
                 owner: bool) -> None:
        self._shm = shm
        self.handle = handle
        self.reader = reader  # None for the writer
        self._owner = owner
        self._buf = shm.buf
        self._flags_bytes = handle.num_slots * handle.num_readers
        self._index = 0  # the next slot this side writes or reads (a running count)

    @classmethod
    def create(cls, num_readers: int, semaphore_factory: Callable[[], Any], *,
               num_slots: int = 8, slot_bytes: int = 1 << 20) -> "ShmRingBuffer":
        size = num_slots * num_readers + num_slots * slot_bytes
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[:num_slots * num_readers] = b"\x01" * (num_slots * num_readers)
        handle = RingHandle(shm.name, num_readers, num_slots, slot_bytes,
                            tuple(semaphore_factory() for _ in range(num_readers)))
        return cls(shm, handle, None, owner=True)

    @classmethod
    def attach(cls, handle: RingHandle, reader: int) -> "ShmRingBuffer":
        # A spawned reader shares its parent's resource tracker, whose registry is a set: the
        # attach registers the name again (a no-op) and the writer's unlink removes it.
        shm = shared_memory.SharedMemory(name=handle.name)
        return cls(shm, handle, reader, owner=False)

    # -- layout ------------------------------------------------------------------------------
    def _flag(self, slot: int, reader: int) -> int:
        return slot * self.handle.num_readers + reader

    def _data(self, slot: int) -> int:
        return self._flags_bytes + slot * self.handle.slot_bytes

    # -- the writer ---------------------------------------------------------------------------
    def enqueue(self, data: bytes, check_alive: Callable[[], None] | None = None) -> None:
        """Write one message; waits while the ring is full, calling ``check_alive`` (which
        raises if a reader is gone) every ~0.2 s so that a dead reader never hangs us."""
        h = self.handle
        cap = h.slot_bytes - _HEADER.size
        view = memoryview(data)
        n = len(view)
        pos = 0
        while True:
            chunk = view[pos:pos + cap]
            pos += len(chunk)
            more = pos < n
            slot = self._index % h.num_slots
            self._wait_free(slot, check_alive)
            start = self._data(slot)
            _HEADER.pack_into(self._buf, start, len(chunk), more)
            self._buf[start + _HEADER.size:start + _HEADER.size + len(chunk)] = chunk
            first = self._flag(slot, 0)
            self._buf[first:first + h.num_readers] = bytes(h.num_readers)  # unread by all
            self._index += 1
            for sem in h.semaphores:
                sem.release()
            if not more:
                return

    def _wait_free(self, slot: int, check_alive: Callable[[], None] | None) -> None:
        h = self.handle
        first = self._flag(slot, 0)
        want = b"\x01" * h.num_readers
        next_check = time.monotonic() + 0.2
        sleep = 0.0
        while bytes(self._buf[first:first + h.num_readers]) != want:
            time.sleep(sleep)
            sleep = min(0.001, sleep + 0.00005)
            if check_alive is not None and time.monotonic() >= next_check:
                check_alive()
                next_check = time.monotonic() + 0.2

    # -- a reader -----------------------------------------------------------------------------
    def dequeue(self, on_idle: Callable[[], None] | None = None,
                idle_s: float = 1.0) -> bytes:
        """The next message; sleeps until it comes, calling ``on_idle`` every ``idle_s``
        seconds of waiting (a reader checks there that its parent is still alive)."""
        h = self.handle
        assert self.reader is not None, "the writer does not read"
        sem = h.semaphores[self.reader]
        parts: list[bytes] = []
        while True:
            slot = self._index % h.num_slots
            flag = self._flag(slot, self.reader)
            while self._buf[flag] != 0:
                if not sem.acquire(timeout=idle_s) and on_idle is not None:
                    on_idle()
            start = self._data(slot)
            length, more = _HEADER.unpack_from(self._buf, start)
            parts.append(bytes(self._buf[start + _HEADER.size:start + _HEADER.size + length]))
            self._buf[flag] = 1
            self._index += 1
            if not more:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self._buf = None  # type: ignore[assignment]
        try:
            self._shm.close()
        except BufferError:  # a view still exported; the mapping goes with the process
            pass
        if self._owner:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
