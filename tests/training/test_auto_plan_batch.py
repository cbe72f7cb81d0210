"""`auto` plans from a probe of one real batch: it must be the largest batch training can give (most latent elements),
or a plan sized on a small bucket or a short last batch runs out of memory on the others."""
import pytest
import torch
from demo_setup import demo_session

from tightrope.training import auto_plan
from tightrope.training.data.dataset import TrainingDataset
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

    def probe(model, make_inputs, device, base, *, batch, repeats):
        probed.append((tuple(make_inputs()[0]["x_t"].shape), batch))
        raise StopIteration  # the plan itself is not what is tested
    monkeypatch.setattr(auto_plan, "probe_model", probe)
    with pytest.raises(StopIteration):
        auto_plan.plan_for_session(session, AutoStrategy(), torch.device("cpu"))
    assert probed == [((1, 16, 32, 32), 1)]
