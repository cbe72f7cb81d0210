"""Shared builders for the reliability tests: the tiny demo world through the real node classes."""
from __future__ import annotations

import torch

from tightrope.nodes import host
from tightrope.nodes.dataset_nodes import TightropeLoadDataset
from tightrope.nodes.demo_nodes import TightropeDemoEncoders, TightropeDemoImages, TightropeDemoModel
from tightrope.nodes.lora_node import TightropeLoraSetup
from tightrope.nodes.strategy_node import TightropeMemoryStrategy
from tightrope.nodes.train_node import TightropeTrain
from tightrope.training.lora.layers import lora_layers


def resuming():
    """The current headless run with --resume, for a block: the run the test (or its fixture) entered is back
    after it."""
    return host.headless(host.output_dir(), run_dir=host.run_dir(), resume=True)


def dataset_inputs(folder=None, **kw):
    if folder is None:
        (folder,) = TightropeDemoImages().make("imgs", 4, 32, 0)
    vae, clip = TightropeDemoEncoders().load(0)
    return dict(folder=str(folder), vae=vae, clip=clip, resolution=32, caption_dropout=0.0, use_repeats=True,
                strict=False) | kw


def load_dataset(folder=None, **kw):
    return TightropeLoadDataset().load(**dataset_inputs(folder, **kw))[0]


def lora(rank=4, alpha=4.0, existing_lora=""):
    return TightropeLoraSetup().setup(rank, alpha, False, 0.0, "attention", "default", existing_lora=existing_lora)[0]


def strategy(**kw):
    spec = TightropeMemoryStrategy.INPUT_TYPES()["required"]
    values = {k: v[1]["default"] for k, v in spec.items()} | {"compute_dtype": "fp32"} | kw
    return TightropeMemoryStrategy().make(**values)[0]


def widgets(**kw):
    spec = TightropeTrain.INPUT_TYPES()["required"]
    return {k: v[1]["default"] for k, v in spec.items()} | dict(steps=2, batch_size=2, device="cpu",
                                                              learning_rate=1e-3, filename_prefix="rt/lora") | kw


def world(out):
    """(model, dataset, lora, strategy) of the demo, built by the nodes."""
    return TightropeDemoModel().load(0)[0], load_dataset(), lora(), strategy()


def train_node(model=None, dataset=None, lora_spec=None, strat=None, session=None, **kw):
    return TightropeTrain().train(**widgets(**kw), model=model, dataset=dataset, lora=lora_spec, strategy=strat,
                                  session=session)


def snapshot(flux: torch.nn.Module) -> dict:
    return {"state": {k: v.clone() for k, v in flux.state_dict().items()},
            "grad": {n: p.requires_grad for n, p in flux.named_parameters()},
            "modules": [n for n, _ in flux.named_modules()]}


def assert_untouched(flux: torch.nn.Module, before: dict) -> None:
    """The base model is as the user gave it: same weights, modules, flags; no peft layers or patched forwards."""
    after = snapshot(flux)
    assert after["modules"] == before["modules"] and not lora_layers(flux)
    assert after["grad"] == before["grad"]
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(after["state"][k], v) for k, v in before["state"].items())
    assert not [n for n, m in flux.named_modules() if "forward" in m.__dict__]
