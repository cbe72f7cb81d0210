"""The strategy's dtype names ('bf16', 'fp16', 'fp32') as torch dtypes."""
from __future__ import annotations

import torch

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
