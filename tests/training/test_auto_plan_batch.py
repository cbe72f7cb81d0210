"""`auto` plans from a probe of one real batch: it must be the largest batch training can give (most latent elements),
or a plan sized on a small bucket or a short last batch runs out of memory on the others."""
import pytest
import torch
from demo_setup import demo_session

from tightrope.training import auto_plan
from tightrope.training.data.dataset import TrainingDataset
from tightrope.memory.strategy import StrategyError
from tightrope.training.strategy_choice import AutoStrategy


def two_buckets(context, pooled):
    """One 16x32x32 latent and three 16x8x8 ones: at batch 2 the small bucket gives 2 x 1024 elements per batch (and
    a short batch of 1), the large one 1 x 16384."""
    latents = [torch.randn(16, 32, 32)] + [torch.randn(16, 8, 8) for _ in range(3)]
    return TrainingDataset.from_tensors(latents, [context] * 4, [pooled] * 4)


def test_the_largest_batch_is_the_bucket_with_most_elements_per_batch(tmp_path):
    session = demo_session(tmp_path)
    ds = two_buckets(*session.dataset.text(0))
    assert ds.largest_batch(2)["latents"].shape == (1, 16, 32, 32)
    small = TrainingDataset.from_tensors([torch.randn(16, 8, 8)] * 3 + [torch.randn(16, 8, 16)],
                                         [session.dataset.text(0)[0]] * 4, [session.dataset.text(0)[1]] * 4)
    assert small.largest_batch(2)["latents"].shape == (2, 16, 8, 8)  # 2 x 64 per batch beats 1 x 128


@pytest.mark.parametrize("seed", [0, 1, 4])
def test_auto_probes_the_largest_batch_whatever_the_seed(tmp_path, monkeypatch, seed):
    session = demo_session(tmp_path, seed=seed, batch_size=2)
    session = session.advanced(dataset=two_buckets(*session.dataset.text(0)))
    probed = []

    def probe(model, make_inputs, device, base, *, batch, repeats, progress=None):
        probed.append((tuple(make_inputs()[0]["x_t"].shape), batch))
        raise StopIteration  # the plan itself is not what is tested
    monkeypatch.setattr(auto_plan, "probe_model", probe)
    with pytest.raises(StopIteration):
        auto_plan.plan_for_session(session, AutoStrategy(vram_budget_gb=4.0), torch.device("cpu"))
    assert probed == [((1, 16, 32, 32), 1)]


@pytest.mark.parametrize("optimizer,state_bytes", [("adamw", 8.0), ("prodigy", 16.0), ("adafactor", 4.0)])
def test_auto_budgets_the_chosen_optimizers_state(tmp_path, monkeypatch, optimizer, state_bytes):
    """The planner budgets AdamW's two fp32 moments unless told: Prodigy keeps four fp32 tensors per parameter
    (0.28 GiB more than AdamW for Flux-dev r16, more than the plan's 5 % margin on a 4 GB budget)."""
    session = demo_session(tmp_path, optimizer=optimizer)
    told = []
    monkeypatch.setattr(auto_plan, "probe_model", lambda *a, **k: "profile")
    monkeypatch.setattr(auto_plan, "plan", lambda profile, budget, **k: told.append(k) or next(iter(())))
    with pytest.raises(StopIteration):  # the plan itself is not what is tested
        auto_plan.plan_for_session(session, AutoStrategy(vram_budget_gb=4.0), torch.device("cpu"))
    assert told[0]["optimizer_bytes"] == state_bytes


def test_the_prediction_counts_the_optimizer_state_it_is_given():
    from tightrope.memory.plan_cost import ADAMW_BYTES_PER_ELEMENT, predict
    from tightrope.memory.probe import probe_model
    from tightrope.memory.strategy import Strategy
    from two_stream import make_batch, make_lora_model

    def inputs():
        batch, target = make_batch()
        return batch, lambda out: torch.nn.functional.mse_loss(out, target)
    prof = probe_model(make_lora_model(), inputs, "cpu", Strategy.of(compute_dtype="fp32"), repeats=0)
    s = Strategy.of(compute_dtype="fp32")
    adamw, prodigy = predict(prof, s), predict(prof, s, optimizer_bytes=16.0)
    assert adamw.breakdown["optimizer"] == ADAMW_BYTES_PER_ELEMENT * prof.trainable_numel
    assert prodigy.breakdown["optimizer"] == 2 * adamw.breakdown["optimizer"]


def test_auto_leaves_the_global_random_stream_as_it_found_it(tmp_path, monkeypatch):
    """The probe injects a LoRA (random init: kaiming-uniform A) and runs it with dropout: the caller's
    torch.manual_seed stream (a ComfyUI user's, or the next node's) used to move on by whatever the probe drew."""
    session = demo_session(tmp_path)
    torch.manual_seed(123)
    expected = torch.rand(4)
    def probe(*args, **kwargs):  # the real probe's LoRA dropout draws from the global stream, as this does
        torch.rand(8)
        raise StopIteration  # the plan itself is not what is tested
    monkeypatch.setattr(auto_plan, "probe_model", probe)
    torch.manual_seed(123)
    with pytest.raises(StopIteration):
        auto_plan.plan_for_session(session, AutoStrategy(vram_budget_gb=4.0), torch.device("cpu"))
    assert torch.equal(torch.rand(4), expected)


def test_auto_with_no_budget_off_cuda_names_the_node_input_before_probing(tmp_path, monkeypatch):
    """vram_budget_gb=0 means "the free GPU memory": off CUDA it cannot be read. The error came after the whole probe
    and told the user to give `budget_bytes=12 * 2**30`, a Python argument no node has."""
    monkeypatch.setattr(auto_plan, "probe_model", lambda *a, **k: pytest.fail("probed before refusing"))
    with pytest.raises(StrategyError, match="vram_budget_gb=0 plans for the free GPU memory, but the device is 'cpu'"
                                            ".*set vram_budget_gb to the memory to plan for"):
        auto_plan.plan_for_session(demo_session(tmp_path), AutoStrategy(), torch.device("cpu"))
