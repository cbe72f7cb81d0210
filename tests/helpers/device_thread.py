"""Backward on another thread, as the autograd engine runs it on a GPU, emulated on the CPU.

On CUDA the engine runs every node of a CUDA tensor's backward on its per-device worker thread, not on the thread
that called `loss.backward()` (that one waits, its GIL released). It gives the worker the caller's
`at::ThreadLocalState` (grad mode, which it sets to `create_graph`; inference mode; autocast's enabled flags and
dtypes; the dispatch-key TLS; the saved-tensor hooks stack; the torch function and dispatch mode stacks), and sets
the current CUDA stream, for each node, to the stream its forward op ran on. It does not give it Python's
`threading.local()` objects, `contextvars`, or the caller's current CUDA stream outside the nodes. On the CPU the
engine runs a CPU tensor's backward on the calling thread, so a CPU test never sees any of that.

`backward_on_another_thread(monkeypatch)` makes every `torch.autograd.backward` (so `Tensor.backward`, a
GradScaler's scaled loss's too) run in a fresh Python thread, started for that call, which takes exactly what the
engine would copy and nothing else:
  - the torch function and dispatch mode stacks (the stream simulation's compute log is a dispatch mode: the
    worker's ops are logged as compute's, as the GPU's backward kernels are compute's), autocast's state for
    "cpu" and "cuda" (enabled, dtype, cache), grad mode, inference mode, and the top of the saved-tensor hooks
    stack (the engine copies all of it; only the top one acts);
  - torch >= 2.13 stashes the caller's contextvars context in that thread-local state (`_engine_run_backward`),
    where compiled backward graphs (AOTAutograd) run: the worker stashes the caller's too;
  - no `threading.local`, no contextvars (a new Python thread starts from an empty context), no current stream of
    the caller: the stream simulation's current stream is per thread, and the worker starts on the compute stream,
    which is what the engine sets for nodes whose forward ran on the compute stream (every forward of the runtime);
  - the caller's polite stop signals and SIGINT are blocked while it waits (its Python handlers run only once the
    backward has returned, as on a GPU, where the caller is in C++ with the GIL released), when called from the
    main thread.
An exception raised in the worker is raised again in the caller (the engine does the same, keeping its type).
`calls` counts the backward calls made on the worker; `threads` holds the names of the threads used.
"""
from __future__ import annotations

import contextlib
import contextvars
import signal
import threading
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1") if hasattr(signal, n))


@dataclass
class DeviceThreadStats:
    calls: int = 0
    threads: set[str] = field(default_factory=set)
    seen: list[dict] = field(default_factory=list)  # per call: the state the worker started with (tests)


def _function_modes() -> list:
    from torch.overrides import _get_current_function_mode_stack
    return list(_get_current_function_mode_stack())


def _captured() -> dict:
    """What the engine copies from the caller (at::ThreadLocalState), as far as Python can read it."""
    return dict(
        grad=torch.is_grad_enabled(),
        inference=torch.is_inference_mode_enabled(),
        autocast={d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in ("cpu", "cuda")},
        autocast_cache=torch.is_autocast_cache_enabled(),
        hooks=torch._C._autograd._top_saved_tensors_default_hooks(True),
        function_modes=_function_modes(),
        dispatch_modes=list(_get_current_dispatch_mode_stack()),
    )


@contextlib.contextmanager
def _entered(state: dict):
    """The engine's copy of the caller's thread-local state, entered on this (new) thread."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(state["inference"]))
        stack.enter_context(torch.set_grad_enabled(state["grad"]))
        for device, (enabled, dtype) in state["autocast"].items():
            before = torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
            stack.callback(torch.set_autocast_enabled, device, before[0])
            stack.callback(torch.set_autocast_dtype, device, before[1])
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(state["autocast_cache"])
        stack.callback(torch.set_autocast_cache_enabled, cache)
        if state["hooks"] is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*state["hooks"]))
        for mode in state["function_modes"]:
            torch.overrides._push_mode(mode)
            stack.callback(torch.overrides._pop_mode)
        for mode in state["dispatch_modes"]:
            _push_mode(mode)
            stack.callback(_pop_mode)
        yield


def backward_on_another_thread(monkeypatch, stats: DeviceThreadStats | None = None) -> DeviceThreadStats:
    """For the rest of the test, torch.autograd.backward runs on a new thread per call (the module docstring)."""
    stats = stats if stats is not None else DeviceThreadStats()
    real_backward = torch.autograd.backward
    real_run = torch.autograd._engine_run_backward
    stashes = "_stash_obj_in_tls" in real_run.__code__.co_names  # torch >= 2.13 (2.11 does not)
    caller_context: list = []

    def engine_run_backward(t_outputs, *args, **kwargs):
        """torch's own, but the contextvars context it stashes for the device threads (torch >= 2.13: compiled
        backward graphs run in it) is the caller's, as on a GPU, not the worker's."""
        if not (stashes and caller_context):
            return real_run(t_outputs, *args, **kwargs)
        torch._C._stash_obj_in_tls("context", caller_context[-1])
        try:
            return torch.autograd.Variable._execution_engine.run_backward(t_outputs, *args, **kwargs)
        finally:
            torch._C._remove_obj_from_tls("context")

    def backward(*args, **kwargs):
        state = _captured()
        result: list = []
        caller_context.append(contextvars.copy_context())

        def work():
            try:
                with _entered(state):
                    stats.seen.append(dict(grad=torch.is_grad_enabled(),
                                           autocast_cuda=torch.is_autocast_enabled("cuda"),
                                           in_backward_before=torch._C._current_graph_task_id() != -1))
                    real_backward(*args, **kwargs)
                result.append(None)
            except BaseException as e:  # noqa: BLE001 - raised again in the caller, as the engine does
                result.append(e)

        name = f"autograd-device-thread-{stats.calls}"
        stats.calls += 1
        stats.threads.add(name)
        worker = threading.Thread(target=work, name=name, daemon=True)
        main = threading.current_thread() is threading.main_thread()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS) if main else None
        try:
            worker.start()
            worker.join()
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            caller_context.pop()
        if isinstance(result[0], BaseException):
            raise result[0]

    monkeypatch.setattr(torch.autograd, "backward", backward)
    monkeypatch.setattr(torch.autograd, "_engine_run_backward", engine_run_backward)
    return stats
