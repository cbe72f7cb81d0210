"""`tightrope bench headline-plan`'s last section: the largest batch that fits a budget (planner.autotune_batch),
checked against trying every batch with the planner."""
from tightrope.bench.headline_plan import headline_profile, largest_batch_section, largest_batches, least_peak
from tightrope.memory.planner import plan
from tightrope.memory.strategy import StrategyError


def _largest_by_trying_each(profile, budget: int) -> int:
    batch = 0
    while True:
        try:
            plan(profile.at_batch(batch + 1), budget)
        except StrategyError:
            return batch
        batch += 1


def test_the_largest_batch_is_the_one_trying_every_batch_finds():
    profile, _ = headline_profile("tiny", resolution=256)
    one = least_peak(profile)[1].peak_bytes  # the least any plan needs at batch 1
    budgets = (one - 1, one, least_peak(profile.at_batch(3))[1].peak_bytes,
               least_peak(profile.at_batch(11))[1].peak_bytes + 12345)
    found = largest_batches(profile, budgets)
    assert found[budgets[0]] is None  # not even batch 1
    batches = [found[b][0] for b in budgets[1:]]
    assert batches == [_largest_by_trying_each(profile, b) for b in budgets[1:]]
    assert batches[0] >= 1 and batches[1] >= 3 and batches[2] >= 11  # the budgets were cut to fit those batches
    for budget in budgets[1:]:
        batch, best = found[budget]
        assert best.predicted_peak_bytes <= budget and best.budget_bytes == budget
        assert best.prediction.peak_bytes == best.predicted_peak_bytes


def test_the_section_names_each_budget_and_its_batch():
    profile, _ = headline_profile("tiny", resolution=256)
    budget = least_peak(profile.at_batch(3))[1].peak_bytes
    text = largest_batch_section(resolution=256, budgets=(budget,), model_name="tiny")
    batch = largest_batches(profile, (budget,))[budget][0]
    assert text.startswith("## Largest batch that fits, 256 px")
    assert f"| {batch} | " in text and "| --- |" in text
