"""Prefill/decode disaggregation across hosts (``kv_transfer=zmq``): the shared-memory
connector's protocol over a ZMQ side channel instead of a shared file.

A producer's worker side runs a ROUTER socket (``side_channel_host:side_channel_port``) in a
thread. A finished request's blocks stay held; its ``kv_transfer_params`` carry
``remote_address`` instead of ``remote_dir``. A consumer's load thread sends ``read`` (its
fingerprint, the remote request id and block ids) and gets one frame per layer with those
blocks; the producer releases the blocks as soon as they are sent (the bytes are in the
message), or on ``release`` (nothing to read), or after ``transfer_timeout_s``. A consumer that
hears nothing within ``connect_timeout_s``, or gets an error, recomputes the request.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import zmq

from llmkit.config.errors import ConfigError
from llmkit.config.schema import EngineConfig
from llmkit.kv_transfer.base import KVConnectorOutput, KVConnectorRole, KVLayout
from llmkit.kv_transfer.loads import collect_finished_loads
from llmkit.kv_transfer.shared_memory import LoadSpec, SharedMemoryConnector

if TYPE_CHECKING:
    from llmkit.request import Request

logger = logging.getLogger(__name__)

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


class ZmqConnector(SharedMemoryConnector):
    name = "zmq"
    uses_files = False

    def __init__(self, config: EngineConfig, role: KVConnectorRole, layout: KVLayout) -> None:
        super().__init__(config, role, layout)
        cfg = config.kv_transfer
        self.connect_timeout_s = cfg.connect_timeout_s
        self._ctx: zmq.Context | None = None
        self._lock = threading.Lock()
        self._sent: list[str] = []  # released by the server thread, reported by get_finished
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # The worker side binds it, the scheduler side hands it out: a fixed port, so that
        # both know it without talking.
        self.address = f"tcp://{cfg.side_channel_host}:{cfg.side_channel_port}"
        if self.is_producer:
            if not cfg.side_channel_port:
                raise ConfigError("kv_transfer.side_channel_port", 0, "a port 1-65535", message=(
                    f"a zmq {cfg.kv_role} serves its KV on kv_transfer.side_channel_port; "
                    "set one (it is 0)"))
            if role is KVConnectorRole.WORKER:
                self._start_server()

    # -- scheduler side ------------------------------------------------------------------
    @staticmethod
    def _remote_of(params: dict[str, Any]) -> str:
        return str(params.get("remote_address", ""))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        p = request.kv_transfer_params
        if not (self.is_producer and p and p.get("do_remote_decode") and block_ids
                and request.status.name in ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")):
            return False, None
        self._pending.sending.append(request.request_id)
        return True, {"do_remote_prefill": True, "remote_engine_id": self.engine_id,
                      "remote_request_id": request.request_id,
                      "remote_block_ids": list(block_ids),
                      "remote_num_tokens": request.num_prompt_tokens,
                      "remote_address": self.address}

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        if self._ctx is not None:
            self._ctx.term()

    # -- worker side: the producer's server ----------------------------------------------
    def allocate_kv_caches(self, shape, dtype, num_layers, device=None):
        return None  # the runner's own pool: blocks are copied into messages

    def _start_server(self) -> None:
        self._ctx = zmq.Context()
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                        name="llmkit-kv-zmq")
        self._thread.start()

    def _serve(self, sock: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, _, raw = sock.recv_multipart()
            try:
                frames = self._answer(_dec.decode(raw))
            except Exception as e:  # noqa: BLE001 - the consumer recomputes
                frames = [_enc.encode({"error": str(e)})]
            sock.send_multipart([ident, b"", *frames])
        sock.close()

    def _answer(self, msg: dict[str, Any]) -> list[bytes]:
        rid = msg["request_id"]
        with self._lock:
            held = rid in self._held
        if not held:
            return [_enc.encode({"error": "not held", "retry": True})]
        if msg["op"] == "read":
            if msg.get("fingerprint") != self.layout.fingerprint:
                raise ValueError("the consumer's KV fingerprint differs (another model or "
                                 "KV format)")
            ids = torch.tensor(msg["block_ids"], dtype=torch.long)
            d = self.layout.block_dim
            frames = [_enc.encode({"ok": True})]
            frames += [kv.index_select(d, ids.to(kv.device)).cpu().contiguous().view(torch.uint8)
                       .numpy().tobytes()
                       for kv in self.kv_caches]
        else:
            frames = [_enc.encode({"ok": True})]
        with self._lock:
            if self._held.pop(rid, None) is not None:
                self._sent.append(rid)
        return frames

    # -- worker side: the consumer -------------------------------------------------------
    def _request(self, address: str, msg: dict[str, Any]) -> list[bytes]:
        """One request/reply, retrying while the producer has not registered the request
        yet; raises on an error or after ``connect_timeout_s``."""
        if self._ctx is None:
            self._ctx = zmq.Context()
        deadline = time.monotonic() + self.connect_timeout_s
        while True:
            sock = self._ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.connect(address)
                sock.send(_enc.encode(msg))
                left = max(deadline - time.monotonic(), 0.01)
                if not sock.poll(int(left * 1000)):
                    raise TimeoutError(f"no answer from {address} in "
                                       f"{self.connect_timeout_s:.0f} s")
                frames = sock.recv_multipart()
            finally:
                sock.close()
            head = _dec.decode(frames[0])
            if head.get("ok"):
                return frames[1:]
            if head.get("retry") and time.monotonic() < deadline:
                time.sleep(0.01)
                continue
            raise ValueError(f"producer {address}: {head.get('error')}")

    def _release(self, remote: str, remote_request_id: str) -> None:
        try:
            self._request(remote, {"op": "release", "request_id": remote_request_id})
        except Exception as e:  # noqa: BLE001 - it frees them after its timeout anyway
            logger.warning("kv_transfer: could not release %r at %s: %s", remote_request_id,
                           remote, e)

    def _load(self, spec: LoadSpec) -> tuple[bool, int, float]:
        t0 = time.perf_counter()
        try:
            if not spec.remote.startswith("tcp://"):
                raise ValueError(f"not a zmq address: {spec.remote!r}")
            if len(spec.remote_block_ids) != len(spec.local_block_ids):
                raise ValueError("the producer sent fewer blocks than the prompt needs")
            frames = self._request(spec.remote, {
                "op": "read", "request_id": spec.remote_request_id,
                "block_ids": spec.remote_block_ids, "fingerprint": self.layout.fingerprint})
            if len(frames) != len(self.kv_caches):
                raise ValueError(f"{len(frames)} layers sent, {len(self.kv_caches)} here")
            d = self.layout.block_dim
            dst = torch.tensor(spec.local_block_ids, dtype=torch.long)
            for kv, frame in zip(self.kv_caches, frames):
                shape = list(kv.shape)
                shape[d] = len(dst)
                block = torch.frombuffer(bytearray(frame), dtype=kv.dtype).view(shape)
                kv.index_copy_(d, dst.to(kv.device), block.to(kv.device))
            return True, len(dst), time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - any failure means: recompute
            logger.warning("kv_transfer: loading request %r from %s failed (%s); it is "
                           "recomputed", spec.request_id, spec.remote, e)
            return False, 0, time.perf_counter() - t0

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        # the shared-memory bookkeeping, minus its files: timeouts and loads
        out, self._out = self._out, KVConnectorOutput()
        collect_finished_loads(self._loads, out, self.layout.block_nbytes)
        now = time.monotonic()
        with self._lock:
            sent, self._sent = self._sent, []
            for rid, deadline in list(self._held.items()):
                if now >= deadline:
                    logger.warning("kv_transfer: no consumer took request %r's KV within "
                                   "%.0f s; its blocks are freed", rid, self.timeout_s)
                    del self._held[rid]
                    sent.append(rid)
        out.finished_sending.extend(sent)
        return out

    def start_load_kv(self) -> None:
        with self._lock:  # the server thread reads _held
            super().start_load_kv()

