"""The finite check used by every loader and writer, and per step on the LoRA weights and gradients."""
import pytest
import torch

from tightrope.training.finite_check import NonFiniteDataError, all_finite, check_finite, nonfinite_keys

NAN, INF = float("nan"), float("inf")


def test_nan_and_inf_are_found_in_every_float_dtype():
    tensors = {"nan32": torch.tensor([1.0, NAN]), "ok": torch.ones(3, 3), "inf_bf16": torch.tensor([-INF]).bfloat16(),
               "nan_f16": torch.tensor([NAN]).half(), "int": torch.tensor([2**62]),
               "rng": torch.zeros(8, dtype=torch.uint8), "empty": torch.empty(0), "scalar": torch.tensor(3.0)}
    assert nonfinite_keys(tensors) == ["nan32", "inf_bf16", "nan_f16"]
    assert all_finite([tensors["ok"], tensors["scalar"], tensors["empty"]])
    assert not all_finite([tensors["ok"], tensors["nan_f16"]])


def test_huge_finite_values_are_finite():
    # a sum or the 2-norm of these would overflow to inf; the max-abs used here cannot
    assert all_finite([torch.full((1000,), 3e38), torch.full((10,), -6e4).half()])


def test_check_names_what_and_the_fix():
    with pytest.raises(NonFiniteDataError, match=r"file 'x' holds NaN or infinite values in 1 of 2 tensors "
                                                 r"\(e\.g\. b\): delete it"):
        check_finite({"a": torch.ones(2), "b": torch.tensor([INF])}, "file 'x'", "delete it")
    check_finite({"a": torch.ones(2)}, "file 'x'", "delete it")
