"""The step loop: continuation equals an uninterrupted run, stops keep their work, inputs are never changed."""
import pytest
import torch
from demo_setup import demo_session

from tightrope.memory.strategy import Strategy, StrategyError
from tightrope.training.data.image_folder import DatasetError
from tightrope.training.lora.files import read_lora_file
from tightrope.training.train_config import ConfigError
from tightrope.training.trainer import SaveTarget, train

CPU = torch.device("cpu")


def test_same_seed_same_run_and_continuation_is_exact(tmp_path):
    session = demo_session(tmp_path)
    whole = train(session, 6, device=CPU)
    again = train(session, 6, device=CPU)
    assert whole.losses == again.losses
    halves = train(train(session, 3, device=CPU), 3, device=CPU)
    assert halves.losses == whole.losses  # bit-identical: data, noise, dropout and optimizer state carry over
    for k, v in whole.lora_state.items():
        assert torch.equal(v, halves.lora_state[k]), k


def test_runtime_strategy_trains_like_plain(tmp_path):
    plain = train(demo_session(tmp_path), 3, device=CPU)
    managed = train(demo_session(tmp_path, strategy=Strategy.of(compute_dtype="fp32", offload_fraction=1.0,
                                                                checkpoint="all", activation_offload=True)),
                    3, device=CPU)
    torch.testing.assert_close(torch.tensor(managed.losses), torch.tensor(plain.losses), rtol=1e-5, atol=1e-6)


def test_the_input_session_and_model_are_left_as_they_were(tmp_path):
    session = demo_session(tmp_path)
    before = {k: v.clone() for k, v in session.model.flux.state_dict().items()}
    result = train(session, 2, device=CPU)
    assert session.step == 0 and session.lora_state is None and session.losses == ()
    assert result.step == 2 and result is not session
    after = session.model.flux.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    assert not any("lora" in n for n, _ in session.model.flux.named_modules())
    assert not any(p.requires_grad for p in session.model.flux.parameters())


def test_stop_request_keeps_the_last_completed_step(tmp_path):
    calls = []

    def stop_after_two():
        calls.append(1)
        return len(calls) > 2

    result = train(demo_session(tmp_path), 10, device=CPU, save=SaveTarget(tmp_path / "out", "run"),
                   should_stop=stop_after_two)
    assert result.interrupted and result.step == 2 and len(result.saved) == 1
    tensors, meta = read_lora_file(result.saved[0])
    assert meta["tightrope.steps"] == "2"
    state = {k.replace("diffusion_model.", ""): v for k, v in tensors.items()}
    assert any(torch.equal(state[k.replace(".default", "")], v) for k, v in result.lora_state.items()
               if k.replace(".default", "") in state)


def test_exception_mid_run_saves_the_last_completed_step(tmp_path):
    def explode(done, total, loss):
        if done == 3:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        train(demo_session(tmp_path), 10, device=CPU, save=SaveTarget(tmp_path / "out", "run"), progress=explode)
    saved = sorted((tmp_path / "out").glob("run_*.safetensors"))
    assert len(saved) == 1 and read_lora_file(saved[0])[1]["tightrope.steps"] == "3"


@pytest.mark.parametrize("steps", [-1, 2.5, True])
def test_bad_steps(tmp_path, steps):
    with pytest.raises(ConfigError, match=f"steps={steps!r} is invalid"):
        train(demo_session(tmp_path), steps, device=CPU)


def test_zero_steps_train_nothing_and_score_a_due_validation(tmp_path):
    """train(session, 0): what a resumed node whose last validation a stop left unscored runs (training_run); the
    Train node itself refuses steps=0 (tests/reliability/bad_input_cases.py)."""
    session = demo_session(tmp_path, validation_fraction=0.25)
    done = train(session, 0, device=CPU)
    assert done.step == 0 and done.losses == () and [s for s, _ in done.validation_losses] == [0]
    assert done.lora_state.keys() and not done.interrupted


def test_batch_larger_than_dataset(tmp_path):
    with pytest.raises(DatasetError, match="batch_size=64 is larger than the dataset"):
        train(demo_session(tmp_path, batch_size=64), 1, device=CPU)


def test_strategy_that_does_not_match_the_model(tmp_path):
    with pytest.raises(StrategyError, match="offload_blocks has indices \\[40\\]"):
        train(demo_session(tmp_path, strategy=Strategy.of(offload_blocks=(40,))), 1, device=CPU)
    with pytest.raises(StrategyError, match="Strategy.block_lists names 'blocks'"):
        train(demo_session(tmp_path, strategy=Strategy.of(block_lists=("blocks",))), 1, device=CPU)


def test_a_run_leaves_every_gpus_random_generator_alone(tmp_path, monkeypatch):
    """torch.manual_seed also seeds every CUDA device, which fork_rng restores only for the devices it is given: a
    CPU run (and a GPU run, on the other GPUs) left ComfyUI's GPU generators at a fixed seed after each Train node.
    The run seeds the CPU generator and its own device only."""
    from demo_setup import demo_session

    from tightrope.training.trainer import train
    calls = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: calls.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: calls.append(seed))
    session = demo_session(tmp_path)
    before = torch.random.get_rng_state()
    train(session, 2, device=torch.device("cpu"))
    assert calls == [] and torch.equal(torch.random.get_rng_state(), before)


def test_chained_runs_with_per_block_compile_compile_once(tmp_path, monkeypatch):
    """Chained Train nodes (and the next prompt) with compile='per_block': the second run compiles nothing (each link
    compiled every block type again: minutes per link with inductor on Flux) and trains as one run of both."""
    from tightrope.memory import block_compile
    monkeypatch.setattr(block_compile, "_BACKENDS", {})  # graphs of earlier tests are not this test's
    strategy = Strategy.of(compute_dtype="fp32", compile="per_block", compile_backend="aot_eager_decomp_partition",
                           activation_memory_budget=0.5)
    compiled = []

    def counted(session, steps):
        before = block_compile.compiled_graph_count()
        result = train(session, steps, device=CPU)
        compiled.append(block_compile.compiled_graph_count() - before)
        return result
    halves = counted(counted(demo_session(tmp_path, strategy=strategy), 1), 1)
    whole = counted(demo_session(tmp_path, strategy=strategy), 2)  # the next prompt, another model
    assert compiled[0] > 0 and compiled[1:] == [0, 0], f"graphs compiled per run: {compiled}"
    assert halves.losses == whole.losses
    assert all(torch.equal(v, halves.lora_state[k]) for k, v in whole.lora_state.items())
