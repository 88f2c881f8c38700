"""The few UCX calls the agent makes, behind one small class per Python binding.

`ucxx` (RAPIDS, the `ucxx-cu12` wheel) is the binding we install and test; `ucp` (ucx-py, its
predecessor) is accepted when it is the one present. Both sit on the same UCP calls, so the agent
sees one interface: a worker address as bytes, endpoints created from a peer's worker address,
tagged sends and receives straight from and into registered memory, and an explicit progress call.

Why these choices (measured on a 2-core host, 4 MiB messages; docs/transfer.md has the numbers):
- Endpoints come from worker addresses, not from a listener (sockaddr) connection. A sockaddr
  endpoint with peer error handling restricts UCX to transports that can report a dead peer, which
  on one host leaves tcp (~0.9 GB/s); a worker-address endpoint without error handling gets shared
  memory and cross-memory attach, as `ucx_perftest` does. Peer death is detected on the control
  connection instead (transfer/control.py), and endpoints are closed (cancelling their requests).
- The agent's own thread calls progress; no binding progress thread, no asyncio, so a request's
  completion is seen as soon as UCX reports it and nothing else touches the worker.
- Every context is created with UCX_PROTO_INDIRECT_ID=on (`UCX_CONFIG`). Without error handling
  UCX otherwise puts raw endpoint and request pointers on the wire. When a holder is killed
  mid-pull, the puller's first rendezvous read from it fails (process_vm_readv: no such process),
  UCX destroys the endpoint it created for that peer (an internal one, never handed to us), and
  the next rendezvous request the holder had already queued in shared memory names the freed
  endpoint: a segfault inside progress (ucp_proto_rndv_send_reply). With indirect ids that
  lookup misses and UCX drops the message, ending the matching receive "canceled". Same
  transports (sysv, cma); one hash lookup per message. Peer error handling would also switch the
  ids on, but costs the fast path: UCX 1.21 then requires memory invalidation support for
  rendezvous lanes, which cma lacks, and falls back to copy-in copy-out through shared memory.
- ...and with UCX_ADAPTIVE_PROGRESS=n. By default a worker polls a shared-memory interface only
  once an endpoint uses it or a wake-up arrives; the puller never opens an endpoint towards the
  holder, and the holder's wake-up travels on an abstract unix socket, which does not cross
  network namespaces. Two containers of one host with their own network namespaces but shared
  IPC (Kubernetes hostIPC, docker --ipc=host) then saw every pull time out
  (tests/integration/test_cross_host.py). Polling every interface costs nothing measurable here.
- A caller that binds a specific address passes `net_devices` (UCX_NET_DEVICES): UCX's tcp
  transport otherwise listens on every interface of the host, loopback included.
- No context uses UCX's shared-memory FIFO transports (posix, sysv, xpmem: `transport_list`).
  A sender claims a FIFO slot in the receiver's shared memory, fills it, then marks it ready; the
  receiver reads slots strictly in order. A peer killed between claim and mark (a puller killed
  mid-pull, writing its acknowledgements into the holder's FIFO) left a slot that never became
  ready, and the worker never received anything again: every fresh endpoint waited forever for
  its wire-up reply. Small messages go over tcp instead (a killed sender leaves an end of
  stream), page data still over cma; docs/transfer.md has the evidence and the cost.
"""

from __future__ import annotations

import collections
import ctypes
import importlib.util
import os
import weakref
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

_MAX_PROGRESS_ROUNDS = 256
# Applied to every UCP context (a key here overrides the UCX_ environment variable of that name);
# see the module docstring for why. Both bindings pass it as `config_dict`.
UCX_CONFIG: Mapping[str, str] = MappingProxyType({"PROTO_INDIRECT_ID": "on", "ADAPTIVE_PROGRESS": "n"})


TRANSPORTS_ENV = "UCX_TLS"
# The mm family: transports that carry messages through a FIFO in the receiver's shared memory.
_FIFO_TRANSPORTS = ("posix", "sysv", "xpmem")
_FIFO_ALIASES = ("mm",)
_SHARED_MEMORY_ALIASES = ("sm", "shm")  # mm plus the zero-copy ones (cma, knem): kept as cma


def transport_list(requested: str | None) -> str:
    """UCX_TLS for our contexts: `requested` (the environment's UCX_TLS, None if unset) without
    the shared-memory FIFO transports. Unset or "all": every transport but those; a negative list
    ("^ib"): those added to it; a positive list: those removed, "sm"/"shm" kept as "cma"."""
    names = [name.strip() for name in (requested or "").split(",") if name.strip()]
    if not names or names == ["all"]:
        return "^" + ",".join(_FIFO_TRANSPORTS)
    if names[0].startswith("^"):
        excluded = [names[0][1:], *names[1:]]
        return "^" + ",".join(dict.fromkeys([*excluded, *_FIFO_TRANSPORTS]))
    kept: list[str] = []
    for name in names:
        if name in _SHARED_MEMORY_ALIASES:
            kept.append("cma")
        elif name == "all":
            return "^" + ",".join(_FIFO_TRANSPORTS)
        elif name not in _FIFO_TRANSPORTS + _FIFO_ALIASES:
            kept.append(name)
    if not kept:
        raise ValueError(
            f"{TRANSPORTS_ENV}={requested!r} leaves no transport once the shared-memory FIFO "
            f"transports ({', '.join(_FIFO_TRANSPORTS)}) are removed; name e.g. tcp,cma,self"
        )
    return ",".join(dict.fromkeys(kept))


def context_config(net_devices: str | None, requested_transports: str | None) -> dict[str, str]:
    config = dict(UCX_CONFIG)
    config["TLS"] = transport_list(requested_transports)
    if net_devices:
        config["NET_DEVICES"] = net_devices
    return config


class CudaPages:
    """A device buffer described by `__cuda_array_interface__`, which both bindings accept."""

    def __init__(self, address: int, num_bytes: int) -> None:
        self.__cuda_array_interface__ = {
            "data": (address, False),
            "shape": (num_bytes,),
            "typestr": "|u1",
            "version": 3,
        }


class UcxBinding(ABC):
    """One UCP worker, driven only by the thread that owns the agent's event loop."""

    name: str
    worker_address: bytes

    @abstractmethod
    def connect(self, worker_address: bytes) -> Any: ...

    @abstractmethod
    def send(self, endpoint: Any, buffer: Any, tag: int) -> Any: ...

    @abstractmethod
    def receive(self, endpoint: Any, buffer: Any, tag: int) -> Any: ...

    @abstractmethod
    def request_state(self, request: Any) -> tuple[bool, str | None]:
        """(completed, error message or None)."""

    @abstractmethod
    def progress(self) -> None: ...

    @abstractmethod
    def close_endpoint(self, endpoint: Any) -> None:
        """Closes without waiting for the peer (its requests are not cancelled by this)."""

    @abstractmethod
    def cancel_and_close(self, endpoint: Any) -> None:
        """For an endpoint to this worker itself: cancels every request posted through it (they
        complete "canceled" before this returns, so a cancelled receive can no longer be written
        into), then closes it. Never for an endpoint to a peer: closing one waits for the peer."""

    @abstractmethod
    def close(self) -> None: ...


class UcxxBinding(UcxBinding):
    name = "ucxx"

    def __init__(self, net_devices: str | None = None, requested_transports: str | None = None) -> None:
        _import_binding("ucxx")
        from ucxx._lib import libucxx
        from ucxx._lib.arr import Array

        self._api = libucxx
        self._array = Array
        self._context = libucxx.UCXContext(
            config_dict=context_config(net_devices, requested_transports),
            feature_flags=(libucxx.Feature.TAG,),
        )
        self._worker = libucxx.UCXWorker(self._context)
        self.worker_address = bytes(self._worker.address.tobytes())

    def connect(self, worker_address: bytes) -> Any:
        address = self._api.UCXAddress.create_from_buffer(worker_address)
        return self._api.UCXEndpoint.create_from_worker_address(self._worker, address, False)

    def send(self, endpoint: Any, buffer: Any, tag: int) -> Any:
        return endpoint.tag_send(self._array(buffer), self._api.UCXXTag(tag))

    def receive(self, endpoint: Any, buffer: Any, tag: int) -> Any:
        # Posted through the endpoint so that closing the endpoint cancels it.
        return endpoint.tag_recv(self._array(buffer), self._api.UCXXTag(tag))

    def request_state(self, request: Any) -> tuple[bool, str | None]:
        if not request.completed:
            return False, None
        try:
            request.check_error()
        except Exception as error:  # the binding raises one class per UCS status
            return True, f"{type(error).__name__}: {error}"
        return True, None

    def progress(self) -> None:
        # Drain what is ready in one go: a large receive completes over many progress rounds
        # (rendezvous fragments), and each trip through the agent's Python loop costs microseconds.
        for _ in range(_MAX_PROGRESS_ROUNDS):
            if not self._worker.progress_once():
                break

    def close_endpoint(self, endpoint: Any) -> None:
        endpoint.close()

    def cancel_and_close(self, endpoint: Any) -> None:
        # ucxx's close() only starts ucp_ep_close_nbx; close_blocking() first cancels the requests
        # registered with the endpoint, then closes it, progressing this worker until it has.
        endpoint.close_blocking()

    def close(self) -> None:
        self._worker = None
        self._context = None


class UcpBinding(UcxBinding):
    """ucx-py's synchronous core API (`ucp._libs.ucx_api`); requests report through callbacks."""

    name = "ucp"

    def __init__(self, net_devices: str | None = None, requested_transports: str | None = None) -> None:
        _import_binding("ucp")
        from ucp._libs import ucx_api
        from ucp._libs.arr import Array

        self._api = ucx_api
        self._array = Array
        self._context = ucx_api.UCXContext(
            config_dict=context_config(net_devices, requested_transports),
            feature_flags=(ucx_api.Feature.TAG,),
        )
        self._worker = ucx_api.UCXWorker(self._context)
        self.worker_address = bytes(memoryview(self._worker.get_address()))

    def connect(self, worker_address: bytes) -> Any:
        address = self._api.UCXAddress.from_buffer(worker_address)
        return self._api.UCXEndpoint.create_from_worker_address(
            self._worker, address, endpoint_error_handling=False
        )

    def send(self, endpoint: Any, buffer: Any, tag: int) -> Any:
        state: dict[str, Any] = {"completed": False, "error": None}
        array = self._array(buffer)
        self._api.tag_send_nb(endpoint, array, array.nbytes, tag, cb_func=self._on_complete, cb_args=(state,))
        return state

    def receive(self, endpoint: Any, buffer: Any, tag: int) -> Any:
        state: dict[str, Any] = {"completed": False, "error": None}
        array = self._array(buffer)
        self._api.tag_recv_nb(
            self._worker, array, array.nbytes, tag, cb_func=self._on_complete, cb_args=(state,), ep=endpoint
        )
        return state

    @staticmethod
    def _on_complete(request: Any, exception: Exception | None, state: dict[str, Any]) -> None:
        state["completed"] = True
        state["error"] = None if exception is None else f"{type(exception).__name__}: {exception}"

    def request_state(self, request: Any) -> tuple[bool, str | None]:
        return bool(request["completed"]), request["error"]

    def progress(self) -> None:
        self._worker.progress()

    def close_endpoint(self, endpoint: Any) -> None:
        # ucx-py's close() cancels what it can and then progresses the worker until a flush of the
        # endpoint completes: a holder's endpoint whose pull was cancelled holds sends the puller
        # will never match, so that flush never ends and the agent's loop would hang in it. Start
        # the flush and return, as ucxx's close() does: ucx-py's finalizer is detached (it would
        # close again), the close request is released now and UCX frees it once the flush ends.
        handle = endpoint.handle  # readable only while the finalizer is attached
        _detach_finalizer(endpoint)
        libucp = _libucp()
        request = libucp.ucp_ep_close_nb(ctypes.c_void_p(handle), _UCP_EP_CLOSE_MODE_FLUSH)
        if _is_request_pointer(request):
            libucp.ucp_request_free(ctypes.c_void_p(request))

    def cancel_and_close(self, endpoint: Any) -> None:
        # ucx-py's close() cancels the requests posted through the endpoint (receives complete
        # "canceled" at once), then flushes it: an endpoint to this worker itself flushes at once.
        endpoint.close()

    def close(self) -> None:
        self._worker = None
        self._context = None


_UCP_EP_CLOSE_MODE_FLUSH = 1  # ucp_compat.h
_UCS_ERR_LAST = -100  # ucs/type/status.h


def _libucp() -> ctypes.CDLL:
    # libucp is loaded already (ucx-py's import loads it); dlopen by its soname finds that copy.
    library = ctypes.CDLL("libucp.so.0")
    library.ucp_ep_close_nb.restype = ctypes.c_void_p
    library.ucp_ep_close_nb.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    library.ucp_request_free.argtypes = [ctypes.c_void_p]
    return library


def _is_request_pointer(status_pointer: int | None) -> bool:
    """UCS_PTR_IS_PTR: neither NULL (done) nor one of the last 100 addresses (an error status)."""
    return status_pointer is not None and 0 < status_pointer < (1 << 64) + _UCS_ERR_LAST


def _detach_finalizer(ucx_object: Any) -> None:
    """ucx-py frees each handle in a weakref.finalize kept private to its Cython class; find it in
    weakref's registry so that it never runs (the handle is closed by the caller instead)."""
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        found = finalizer.peek()
        if found is not None and found[0] is ucx_object:
            finalizer.detach()
            return
    raise RuntimeError("ucx-py endpoint has no finalizer to detach (closed already?)")


class UcxRequests:
    """Requests of one session, kept with the buffers they point into until they complete.

    Polled from the front, stopping at the first one still running: messages from one peer
    complete roughly in order, so a pull of N pages costs O(N) checks in all instead of O(N) per
    loop turn (1024 pending pages made the loop itself the bottleneck). A failure further back is
    seen once the ones before it are done; the pull's deadline bounds the wait either way.
    """

    def __init__(self, binding: UcxBinding) -> None:
        self._binding = binding
        self._pending: collections.deque[tuple[Any, Any]] = collections.deque()
        self.error: str | None = None

    def add(self, request: Any, buffer: Any) -> None:
        self._pending.append((request, buffer))

    @property
    def has_pending(self) -> bool:
        return bool(self._pending)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def poll(self) -> bool:
        """True once every request has completed; the first failure is kept in `error`."""
        while self._pending:
            completed, error = self._binding.request_state(self._pending[0][0])
            if not completed:
                return False
            self._pending.popleft()
            if error is not None and self.error is None:
                self.error = error
        return True


MEMTYPE_CACHE_ENV = "UCX_MEMTYPE_CACHE"


def _import_binding(name: str) -> None:
    """Imports the binding's package without the variable it plants in our environment.

    ucxx (and ucx-py) set UCX_MEMTYPE_CACHE=n on import, for a CUDA issue of UCX releases before
    1.12; the UCX they ship no longer has that setting, so every context creation then printed
    "UCX WARN unused environment variable: UCX_MEMTYPE_CACHE" in every worker's log. A value the
    user set is left alone (a warning they caused)."""
    was_set = MEMTYPE_CACHE_ENV in os.environ
    importlib.import_module(name)
    if not was_set:
        os.environ.pop(MEMTYPE_CACHE_ENV, None)


BINDING_ENV = "BEAMSPLIT_UCX_BINDING"
BINDING_NAMES = ("ucxx", "ucp")


def installed_bindings() -> list[str]:
    return [name for name in BINDING_NAMES if importlib.util.find_spec(name) is not None]


def load_binding(preferred: str | None = None, net_devices: str | None = None) -> UcxBinding:
    """The named binding; unnamed, the one BEAMSPLIT_UCX_BINDING names, else ucxx if installed,
    else ucp. `net_devices` limits UCX's network interfaces (UCX_NET_DEVICES syntax, e.g. "eth0" or
    "lo"), None leaves UCX's choice. UCX_TLS from the environment is honoured less the
    shared-memory FIFO transports (`transport_list`)."""
    requested_transports = os.environ.get(TRANSPORTS_ENV)
    preferred = preferred or os.environ.get(BINDING_ENV) or None
    if preferred is not None and preferred not in BINDING_NAMES:
        raise ValueError(
            f"unknown UCX binding {preferred!r} (from {BINDING_ENV} or binding=): use ucxx or ucp"
        )
    names = [preferred] if preferred else list(BINDING_NAMES)
    for name in names:
        if name == "ucxx" and importlib.util.find_spec("ucxx") is not None:
            return UcxxBinding(net_devices, requested_transports)
        if name == "ucp" and importlib.util.find_spec("ucp") is not None:
            return UcpBinding(net_devices, requested_transports)
    raise RuntimeError(
        f"no UCX Python binding found (tried {', '.join(names)}): install ucxx-cu12"
        + (f", or unset {BINDING_ENV}" if os.environ.get(BINDING_ENV) else "")
    )
