"""The runtime's objects on the "cpu" device taking their CUDA branches under the stream simulation (sim_streams.py):
LayerOffload, ActivationOffload, HostOptimizer, HostGradScaler, CpuEma and InputCopies get simulated side streams (named
for their owner: layers, acts, optimizer, ema, inputs) and page-lock through the driver model (fake_cudart.py); the host-side code of
the host optimizer is marked as the host's. No production code changes for it."""
import torch
from fake_cudart import FakeCudart
from sim_order import span
from sim_streams import StreamSim

from tightrope.memory.activation_offload import ActivationOffload
from tightrope.memory.ema import CpuEma
from tightrope.memory.host_pinning import PinnedRanges
from tightrope.memory.input_copies import InputCopies
from tightrope.memory.layer_offload import LayerOffload
from tightrope.training.host_optimizer import HostGradScaler, HostOptimizer


def cuda_branches(monkeypatch, cudart=None):
    """Make the runtime's objects on the "cpu" device run their CUDA branches (under `simulated_cuda`): LayerOffload,
    ActivationOffload, HostOptimizer and CpuEma take simulated side streams (their `cuda` flag / stream attribute
    set as on CUDA), and page-lock through `cudart` (default a new FakeCudart), as the CUDA path does. Returns the
    cudart."""
    fake = cudart if cudart is not None else FakeCudart()
    sim = torch.cuda.Stream.__self__  # simulated_cuda's (its bound new_stream)
    assert isinstance(sim, StreamSim), "cuda_branches runs under simulated_cuda"
    sim.cudart = fake
    if not getattr(fake, "_sim_checked", False):  # memory unpinned under a queued copy: the driver would fault
        real_unregister = fake.cudaHostUnregister

        def unregister(ptr):
            nbytes = fake.live.get(ptr)
            if nbytes is not None:
                sim.check_unpinned((ptr, ptr + nbytes))
            return real_unregister(ptr)
        fake.cudaHostUnregister, fake._sim_checked = unregister, True

    real_layer = LayerOffload.__init__

    def layer_init(self, *args, **kwargs):
        real_layer(self, *args, **kwargs)
        if self.device.type == "cpu":
            self.cuda = True
            self.copy_stream = torch.cuda.Stream(self.device)
            self.copy_stream.name = "layers"
            if kwargs.get("pin_memory"):
                self.pin = self.pinned = True
                self._pinned = PinnedRanges(self.device, cudart=fake)

    real_acts = ActivationOffload.__init__

    def acts_init(self, device, **kwargs):
        kwargs.setdefault("cudart", fake)
        real_acts(self, device, **kwargs)
        if self.device.type == "cpu":
            self.cuda = True
            self.stream = torch.cuda.Stream(self.device)
            self.stream.name = "acts"

    real_opt = HostOptimizer.__init__

    def opt_init(self, params, make, device, **kwargs):
        kwargs.setdefault("cudart", fake)
        real_opt(self, params, make, device, **kwargs)
        if torch.device(device).type == "cpu":
            self._stream = torch.cuda.Stream(device)
            self._stream.name = "optimizer"
        if self._pinned is None:  # pageable host buffers (pin_memory=False): host memory all the same, not compute's
            for t in [*self._grads, *(self._staging or []), *self.host.values()]:
                sim.pageable_host.add(span(t))
        inner_step = self.inner.step

        def host_step(*a, **k):  # AdamW on the host buffers: the host's work, not the GPU's queue
            with sim.host_side():
                return inner_step(*a, **k)
        self.inner.step = host_step

    real_unscale = HostGradScaler._unscale_grads_

    def unscale(self, optimizer, inv_scale, found_inf, allow_fp16):
        # on CUDA its .cpu() copies are blocking: the host has waited for compute up to here (on the "cpu" device
        # they are no-ops, the wait invisible); the unscale itself runs on host gradients
        sim._host_saw(sim.timeline.pos)
        with sim.host_side():
            return real_unscale(self, optimizer, inv_scale, found_inf, allow_fp16)

    real_settle = HostOptimizer._settle

    def settle(self, i):  # waits for a gradient's copies, then sums them on the host
        with sim.host_side():
            real_settle(self, i)

    real_inputs = InputCopies.__init__

    def inputs_init(self, device):
        real_inputs(self, device)
        if self.device.type == "cpu":
            self.cuda = True
            self.stream = torch.cuda.Stream(self.device)
            self.stream.name = "inputs"

    real_copy_inputs = InputCopies.__call__

    def copy_inputs(self, *tensors):
        # its sources are host memory by contract (a micro-batch made on the host): the ops that made them ran on
        # the host, though the model logged those on the main thread as compute's (the module docstring of
        # sim_streams: pageable host code)
        with sim.lock:
            for t in tensors:
                if t is not None and t.numel():
                    sim.timeline.forget(span(t))
        return real_copy_inputs(self, *tensors)

    real_ema = CpuEma.__init__

    def ema_init(self, params, decay, state=None, **kwargs):
        kwargs.setdefault("cudart", fake)
        real_ema(self, params, decay, state, **kwargs)

    real_page_lock = CpuEma._page_lock

    def page_lock(self, device, cudart):
        real_page_lock(self, device, cudart)
        if self._pinned is not None and self._stream is None and device.type == "cpu":
            self._stream = torch.cuda.Stream(device)
            self._stream.name = "ema"

    monkeypatch.setattr(LayerOffload, "__init__", layer_init)
    monkeypatch.setattr(ActivationOffload, "__init__", acts_init)
    monkeypatch.setattr(HostOptimizer, "__init__", opt_init)
    monkeypatch.setattr(HostOptimizer, "_settle", settle)
    monkeypatch.setattr(HostGradScaler, "_unscale_grads_", unscale)
    monkeypatch.setattr(CpuEma, "__init__", ema_init)
    monkeypatch.setattr(InputCopies, "__init__", inputs_init)
    monkeypatch.setattr(InputCopies, "__call__", copy_inputs)
    monkeypatch.setattr(CpuEma, "_page_lock", page_lock)
    return fake
