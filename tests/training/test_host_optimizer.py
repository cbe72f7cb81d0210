"""Optimizer offload (training/host_optimizer.py): the optimizer steps host copies of the LoRA, the gradients leave
the device as backward completes each, and the numbers are the device optimizer's.

On the CPU the "device" and the host are the same memory, so what is modelled and counted here is what the GPU run
depends on: the updates (bit for bit, with the same optimizer implementation), that a gradient never outlives the
hook that copies it out (at most one on the device at any time), one host copy of each weight, the micro-batches
adding up on the host, page-locked buffers that no copy straddles, and a state that goes on with the offload on or
off."""
import gc
import mmap

import pytest
import torch
import torch.nn.functional as F
from demo_setup import demo_session
from fake_cudart import FakeCudart, StraddleCheck
from two_stream import make_batch, make_lora_model

from tightrope.memory import host_pinning
from tightrope.memory.host_pinning import interior_ranges, page_aligned, storage_spans
from tightrope.memory.strategy import Strategy, StrategyError
from tightrope.training.host_optimizer import HostGradScaler, HostOptimizer, gradient_holders
from tightrope.training.optimizer import load_optimizer_state
from tightrope.training.train_config import ConfigError
from tightrope.training.trainer import train

CPU = torch.device("cpu")
OFFLOADED = dict(compute_dtype="fp32", offload_fraction=1.0, checkpoint="all")


def _adamw(params: dict) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(params.values()), lr=1e-2, weight_decay=0.1)  # the loop implementation


def _steps(model, optimizer, params, steps=3, micro=3, clip=0.5, batch=lambda b: b):
    """`steps` steps of `micro` micro-batches each, gradients clipped: the trainer's order of calls. batch: moves a
    batch to the model's device."""
    losses = []
    for step in range(steps):
        for k in range(micro):
            inputs, target = batch(make_batch(seed=100 + 10 * step + k))
            loss = F.mse_loss(model(**inputs), target) / micro
            loss.backward()
            losses.append(loss.item())
        grads = gradient_holders(optimizer, params)
        torch.nn.utils.clip_grad_norm_(list(grads.values()), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def _lora(model) -> dict:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def test_it_steps_exactly_as_the_device_optimizer_with_micro_batches_and_clipping():
    plain_model, host_model = make_lora_model(), make_lora_model()
    plain_params, host_params = _lora(plain_model), _lora(host_model)
    plain = _steps(plain_model, _adamw(plain_params), plain_params)
    optimizer = HostOptimizer(host_params, _adamw, CPU)
    offloaded = _steps(host_model, optimizer, host_params)
    assert offloaded == plain  # the same implementation on the same numbers: bit for bit
    for name, p in host_params.items():
        assert torch.equal(p, plain_params[name]), name
        assert torch.equal(optimizer.host[name], p), name  # the copy back
        assert optimizer.host[name].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
    state = optimizer.state_dict()["state"]
    assert len(state) == len(host_params) and all(v["exp_avg"].device == CPU for v in state.values())
    nbytes = sum(p.numel() * p.element_size() for p in host_params.values())
    assert optimizer.d2h_bytes == 3 * 3 * nbytes  # every micro-batch's gradients, once each
    optimizer.close()


def test_a_gradient_lives_on_the_device_only_until_its_hook_copies_it_out():
    """The lifetime that saves the memory: whenever autograd completes a LoRA gradient, no other one is on the
    device (the device optimizer's run has them all by the end of backward: the check fails there)."""
    model = make_lora_model()
    params = _lora(model)
    on_device = []
    for p in params.values():  # registered first: runs before the optimizer's own hook, sees its gradient arrive
        p.register_post_accumulate_grad_hook(lambda _: on_device.append(sum(q.grad is not None
                                                                             for q in params.values())))
    optimizer = HostOptimizer(params, _adamw, CPU)
    _steps(model, optimizer, params, steps=2, micro=2)
    assert len(on_device) == 2 * 2 * len(params) and max(on_device) == 1
    assert all(p.grad is None for p in params.values())
    optimizer.close()
    on_device.clear()
    inputs, target = make_batch(seed=7)
    F.mse_loss(model(**inputs), target).backward()  # closed: the hooks are gone, gradients stay on the device
    assert max(on_device) == len(params)


@pytest.mark.parametrize("registration_bytes", [host_pinning.CHUNK_BYTES, mmap.PAGESIZE])
def test_host_buffers_are_page_locked_whole_and_no_copy_straddles_them(monkeypatch, registration_bytes):
    """With one registration per page (as 1 GiB pieces cut a LoRA of more than 1 GiB) weights and gradients cross
    registrations' edges: their copies are made in parts, none across an edge (the driver's 'invalid argument')."""
    monkeypatch.setattr(host_pinning, "CHUNK_BYTES", registration_bytes)
    fake = FakeCudart()
    model = make_lora_model()
    params = _lora(model)
    with StraddleCheck(fake):
        optimizer = HostOptimizer(params, _adamw, CPU, cudart=fake)
    registered = sorted(fake.live.items())
    buffers = list(optimizer.host.values()) + optimizer._grads
    for t in buffers:  # each weight's and gradient's bytes lie wholly inside registered memory
        a, n = t.data_ptr(), t.numel() * t.element_size()
        assert sum(max(0, min(a + n, s + size) - max(a, s)) for s, size in registered) == n
    assert (len(registered) > 3) == (registration_bytes == mmap.PAGESIZE)
    with StraddleCheck(fake) as check:
        _steps(model, optimizer, params, steps=2, micro=2)
    assert fake.live  # the staging buffer of the second micro-batch is registered too
    assert check.blocking_pinned_copies == 0  # the copies back read page-locked memory, asynchronously
    assert check.pinned_copies >= 2 * len(params)
    optimizer.close()
    assert not fake.live  # released at the end of the run


def test_with_micro_batches_every_buffer_is_pinned_before_the_first_backward():
    """cudaHostRegister of a LoRA-sized buffer inside a hook would stall autograd's device thread mid-backward."""
    fake = FakeCudart()
    model = make_lora_model()
    params = _lora(model)
    optimizer = HostOptimizer(params, _adamw, CPU, micro_batches=2, cudart=fake)
    before = list(fake.registered)
    assert len(before) == 3  # weights, gradients, staging
    _steps(model, optimizer, params, steps=2, micro=2)
    assert fake.registered == before
    optimizer.close()


def test_refused_pinning_is_one_warning_and_never_read_only():
    """The device writes into these buffers (gradients; the weights at the start): a read-only registration, which
    the offloaded weights' pinning falls back to, would make those copies fail."""
    fake = FakeCudart(refuse=2, refuse_first=1)  # the first call out of memory, a read-only retry would pass
    model = make_lora_model()
    params = _lora(model)
    with pytest.warns(RuntimeWarning, match=r"optimizer offload's host buffers are not page-locked \(.*out of "
                                            r"memory, error 2.*stalls backward; set pin_memory=True"):
        optimizer = HostOptimizer(params, _adamw, CPU, cudart=fake)
    assert len(fake.live) == 1 and 8 not in fake.flags.values()  # the gradients' buffer, registered writable
    with StraddleCheck(fake) as check:
        _steps(model, optimizer, params, steps=1, micro=1)
    assert check.pinned_copies == 0
    optimizer.close()


def test_the_weights_go_back_asynchronously_when_their_own_buffer_is_pinned(monkeypatch):
    """Only the weights' buffer decides: a refused gradient buffer must not make every copy back blocking."""
    fake = FakeCudart()
    real, calls = fake.cudaHostRegister, []

    def second_refused(ptr, nbytes, flags):
        calls.append(ptr)
        return 2 if len(calls) == 2 else real(ptr, nbytes, flags)
    monkeypatch.setattr(fake, "cudaHostRegister", second_refused)
    model = make_lora_model()
    params = _lora(model)
    with pytest.warns(RuntimeWarning, match="not page-locked"):
        optimizer = HostOptimizer(params, _adamw, CPU, cudart=fake)
    with StraddleCheck(fake) as check:
        _steps(model, optimizer, params, steps=1, micro=1)
    assert check.pinned_copies == len(params) and check.blocking_pinned_copies == 0
    optimizer.close()


def test_a_failure_while_setting_up_unpins_what_it_pinned():
    """Else the freed buffers stay registered, and a later allocation at their address copies through stale pages."""
    fake = FakeCudart()

    def broken(host):
        raise RuntimeError("no such optimizer")
    with pytest.raises(RuntimeError, match="no such optimizer"):
        HostOptimizer(_lora(make_lora_model()), broken, CPU, cudart=fake)
    assert fake.registered and not fake.live


def test_an_optimizer_dropped_without_close_unhooks_and_unpins():
    """close() is the way out (the trainer's `finally`), but an optimizer dropped without it must neither keep
    catching the LoRA's gradients (its hooks held it alive, and would have sent every later gradient to it) nor leave
    its buffers registered as they are freed (test_host_pinning: stale pages)."""
    fake = FakeCudart()
    model = make_lora_model()
    params = _lora(model)
    optimizer = HostOptimizer(params, _adamw, CPU, micro_batches=2, cudart=fake)
    _steps(model, optimizer, params, steps=1, micro=2)
    assert len(fake.live) == 3
    del optimizer
    gc.collect()
    assert not fake.live
    inputs, target = make_batch(seed=1)
    F.mse_loss(model(**inputs), target).backward()
    assert all(p.grad is not None for p in params.values())  # no hook took them


def test_page_aligned_buffers_own_the_pages_they_lie_in():
    page = mmap.PAGESIZE
    for numel in (1, 1000, page // 4 + 3):
        t = page_aligned(numel, torch.float32)
        (start, nbytes), = interior_ranges(storage_spans([t]))
        assert t.data_ptr() == start and t.data_ptr() + t.nbytes <= start + nbytes


def test_a_run_with_optimizer_offload_trains_as_one_without(tmp_path):
    """On the CPU both runs step with the fused AdamW (make_optimizer), so they must agree bit for bit: the
    gradients reach the host whole (both micro-batches, added in the same order), clipping sees the same values,
    and the updated weights come back. (With the loop AdamW on one side, Adam turned ulp-sized gradient
    differences at near-cancelling entries into update differences of ~1e-3 of the learning rate.)"""
    base = train(demo_session(tmp_path, strategy=Strategy.of(**OFFLOADED), grad_accumulation=2), 3, device=CPU)
    offloaded = train(demo_session(tmp_path, strategy=Strategy.of(**OFFLOADED, optimizer_offload=True),
                                   grad_accumulation=2), 3, device=CPU)
    change = max(v.abs().max().item() for k, v in base.lora_state.items() if "lora_B" in k)  # B starts at 0
    assert change > 1e-3
    for k, v in base.lora_state.items():
        assert torch.equal(offloaded.lora_state[k], v), k
    assert offloaded.losses == base.losses


def test_a_session_goes_on_with_optimizer_offload_switched_on_or_off(tmp_path):
    on, off = Strategy.of(**OFFLOADED, optimizer_offload=True), Strategy.of(**OFFLOADED)
    whole = train(demo_session(tmp_path, strategy=on), 4, device=CPU)
    halves = train(train(demo_session(tmp_path, strategy=on), 2, device=CPU), 2, device=CPU)
    assert halves.losses == whole.losses  # exact resume with the offload on
    for k, v in whole.lora_state.items():
        assert torch.equal(v, halves.lora_state[k]), k
    first = train(demo_session(tmp_path, strategy=on), 2, device=CPU)
    switched = train(first.advanced(strategy=off), 2, device=CPU)  # the host state goes on on the device
    assert switched.losses[:2] == whole.losses[:2] and switched.losses[2:] == pytest.approx(whole.losses[2:], rel=1e-5)
    back = train(switched.advanced(strategy=on), 1, device=CPU)  # and back
    assert back.step == 5 and all(torch.isfinite(torch.tensor(back.losses)))


def test_a_state_keeps_the_loading_optimizers_implementation():
    """A state saved by the fused host AdamW, loaded into the loop one, leaves it the loop one (torch's load would
    make it fused), with its step count where the loop keeps it (CPU); and the reverse."""
    host = torch.nn.Parameter(torch.ones(4))
    fused = torch.optim.AdamW([host], lr=0.1, fused=True)
    host.grad = torch.ones(4)
    fused.step()
    loop = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=0.1)
    load_optimizer_state(loop, fused.state_dict(), ["w"], 0.0)
    assert not loop.param_groups[0]["fused"] and loop.state[loop.param_groups[0]["params"][0]]["step"].device == CPU
    again = torch.optim.AdamW([torch.nn.Parameter(torch.ones(4))], lr=0.1, fused=True)
    load_optimizer_state(again, loop.state_dict(), ["w"], 0.0)
    assert again.param_groups[0]["fused"]


def test_fp16_loss_scaling_unscales_the_host_gradients(tmp_path, monkeypatch):
    """torch's GradScaler copies its device scale to the CPU gradients non-blocking and reads it at once (stale on
    CUDA): the host one copies it first. On the CPU only the wiring shows: the scale reaches the unscale on the CPU."""
    seen = []
    real = HostGradScaler._unscale_grads_

    def unscale(self, optimizer, inv_scale, found_inf, allow_fp16):
        seen.append((inv_scale.device, found_inf.device))
        return real(self, optimizer, inv_scale, found_inf, allow_fp16)
    monkeypatch.setattr(HostGradScaler, "_unscale_grads_", unscale)
    fp16 = dict(OFFLOADED, compute_dtype="fp16")
    base = train(demo_session(tmp_path, strategy=Strategy.of(**fp16)), 2, device=CPU)
    offloaded = train(demo_session(tmp_path, strategy=Strategy.of(**fp16, optimizer_offload=True)), 2, device=CPU)
    assert offloaded.losses == pytest.approx(base.losses, rel=1e-4)
    for k, v in base.lora_state.items():  # unscaled: a missed unscale would step by the scale (2**16) times more
        torch.testing.assert_close(offloaded.lora_state[k], v, rtol=1e-3, atol=1e-6)
    assert seen and all(devices == (CPU, CPU) for devices in seen)  # only the offloaded run uses it


@pytest.mark.parametrize("name", ["adamw_schedulefree", "adamw8bit"])
def test_an_optimizer_that_cannot_step_on_the_host_is_refused_before_training(tmp_path, name):
    session = demo_session(tmp_path, strategy=Strategy.of(**OFFLOADED, optimizer_offload=True), optimizer=name)
    with pytest.raises(ConfigError, match=rf"optimizer='{name}' does not work with optimizer_offload=True .*"
                                          r"choose optimizer='adamw'.* or set optimizer_offload=False"):
        train(session, 1, device=CPU)


def test_optimizer_offload_and_fsdp_are_refused_together():
    with pytest.raises(StrategyError, match=r"optimizer_offload=True does not work with shard='fsdp'"):
        Strategy.of(optimizer_offload=True, shard="fsdp")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="streams, events and page-locking need CUDA")


@needs_cuda
def test_on_cuda_host_optimizer_steps_as_the_device_optimizer():
    """The GPU path (side-stream copies out in the hooks, page-locked buffers, async copies back) against the device
    optimizer, fp32 with TF32 off: gradients are computed by the same kernels, so only AdamW's rounding (CUDA foreach
    vs the CPU loop, a few ulps of each update) differs; 1e-4 of the change training made is far above that and far
    below a stale or missing gradient. gpu-check runs this (bench/cuda_checks.py) and the matrix row with sleeps."""
    from tightrope.bench.cuda_checks import exact_fp32
    dev = torch.device("cuda", torch.cuda.current_device())
    with exact_fp32():
        plain_model, host_model = make_lora_model().to(dev), make_lora_model().to(dev)
        start = {n: p.detach().clone() for n, p in _lora(plain_model).items()}
        plain_params, host_params = _lora(plain_model), _lora(host_model)
        inputs_to = _on(dev)
        plain = _steps(plain_model, torch.optim.AdamW(list(plain_params.values()), lr=1e-2, weight_decay=0.1),
                       plain_params, batch=inputs_to)
        optimizer = HostOptimizer(host_params, _adamw, dev, micro_batches=3)
        try:  # closed (unpinned) even when the run fails: freed memory left registered breaks later CUDA tests
            assert optimizer._weights_locked
            offloaded = _steps(host_model, optimizer, host_params, batch=inputs_to)
        finally:
            optimizer.close()
    assert offloaded == pytest.approx(plain, rel=1e-5)
    change = max((p - start[n]).abs().max().item() for n, p in plain_params.items())
    for name, p in host_params.items():
        assert p.grad is None and (p - plain_params[name]).abs().max().item() <= 1e-4 * change, name


@needs_cuda
def test_on_cuda_fp16_overflow_is_skipped_and_the_scale_backs_off():
    """fp16 under optimizer offload: a first scale so large that the gradients overflow must be found (the host
    unscale reads the device's scale) and backed off from exactly as torch's scaler does with the device optimizer;
    the steps after it unscale by the right scale (the weights agree with the device optimizer's, as above)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    scales, weights, start = {}, {}, None
    for offloaded in (False, True):
        model = make_lora_model().to(dev)
        params = _lora(model)
        start = {n: p.detach().clone() for n, p in params.items()}
        kw = {"init_scale": 2.0 ** 24, "backoff_factor": 2.0 ** -8}  # fp16 overflows at ~2**16 x these gradients
        optimizer = HostOptimizer(params, _adamw, dev) if offloaded else _adamw(params)
        scaler = HostGradScaler("cuda", **kw) if offloaded else torch.amp.GradScaler("cuda", **kw)
        scales[offloaded] = []
        try:  # closed (unpinned) even when a step fails: freed memory left registered breaks later CUDA tests
            for step in range(3):
                inputs, target = _on(dev)(make_batch(seed=100 + step))
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = F.mse_loss(model(**inputs).float(), target)
                scaler.scale(loss).backward()
                gradient_holders(optimizer, params)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                scales[offloaded].append(scaler.get_scale())
        finally:
            if offloaded:
                optimizer.close()
        weights[offloaded] = {n: p.detach().clone() for n, p in params.items()}
    assert scales[True] == scales[False] == [2.0 ** 16] * 3  # step 1 skipped, steps 2 and 3 taken
    change = max((w - start[n]).abs().max().item() for n, w in weights[False].items())
    assert change > 0
    for n, w in weights[False].items():
        assert (weights[True][n] - w).abs().max().item() <= 1e-4 * change, n


def _on(dev):
    def move(batch):
        inputs, target = batch
        return {k: v.to(dev) for k, v in inputs.items()}, target.to(dev)
    return move
