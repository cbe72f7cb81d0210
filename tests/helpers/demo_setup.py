"""A small demo session for trainer tests: 8 generated 32 px images, the tiny Flux, LoRA rank 4."""
from tightrope.memory.strategy import Strategy
from tightrope.training.data.dataset import TrainingDataset
from tightrope.demo.model import demo_encoders, demo_model
from tightrope.demo.data import make_demo_dataset
from tightrope.training.lora.layers import LoraSpec
from tightrope.training.session import TrainingSession
from tightrope.training.train_config import TrainConfig


def demo_session(tmp_path, *, strategy=None, **config) -> TrainingSession:
    folder = make_demo_dataset(tmp_path / "images", n_images=8, size=32, seed=0)
    vae, clip = demo_encoders()
    dataset = TrainingDataset(folder, vae, clip, max_pixels=32 * 32, cache_dir=tmp_path / "cache")
    cfg = dict(learning_rate=1e-3, batch_size=2, seed=0)
    cfg.update(config)
    return TrainingSession(model=demo_model(), dataset=dataset, lora=LoraSpec(rank=4, targets="attention_mlp"),
                           strategy=strategy or Strategy.of(compute_dtype="fp32"), config=TrainConfig(**cfg))
