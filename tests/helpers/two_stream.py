"""A small two-stream transformer shaped like Flux, for runtime tests.

It has what makes real models hard for an offloading runtime: double- and single-stream block lists, tensors passed
as keyword arguments (vec, pe), and residuals added in place into the block inputs (as ComfyUI's Flux does) — in a
form plain autograd accepts, so a plain-PyTorch run is the reference.
"""
import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from torch import nn

from tightrope.memory.token_chunks import register_chunked_forward, token_slices
from tightrope.training.flow_loss import exact_summable
from tightrope.training.host_optimizer import HostOptimizer, gradient_holders
from tightrope.training.lora.linear_columns import linear_columns


def _attention(h, qkv, proj, pe, heads):
    b, n, d = h.shape
    q, k, v = qkv(h).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
    q, k = q * pe, k * pe
    return proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))


class DoubleBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.txt_to_img = nn.Linear(d, d)
        self.mod = nn.Linear(d, 3 * d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(approximate="tanh"), nn.Linear(2 * d, d))

    def forward(self, img, txt, *, vec, pe):
        img += self.txt_to_img(txt.mean(1, keepdim=True))  # in place, into the block's input
        shift, scale, gate = self.mod(F.silu(vec)).unsqueeze(1).chunk(3, -1)
        h = torch.cat([txt, img], 1)
        h = F.layer_norm(h, h.shape[-1:]) * (1 + scale) + shift
        a = _attention(h, self.qkv, self.proj, pe, self.heads)
        txt = txt + gate * a[:, : txt.shape[1]]
        img = img + gate * a[:, txt.shape[1]:]
        img = img + self.mlp(F.layer_norm(img, img.shape[-1:]))
        return img, txt


class SingleBlock(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.shift = nn.Linear(d, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(approximate="tanh"), nn.Linear(2 * d, d))

    def forward(self, x, *, vec, pe):
        x += self.shift(F.silu(vec)).unsqueeze(1)  # in place, into the block's input
        h = F.layer_norm(x, x.shape[-1:])
        x = x + _attention(h, self.qkv, self.proj, pe, self.heads)
        return x + self.mlp(F.layer_norm(x, x.shape[-1:]))


# -- token-chunked forwards (memory/token_chunks.py contract), so the runtime's chunk regions run under every strategy
# of the equivalence matrix (bench/cuda_checks.py on a GPU): the blocks' values, inputs never changed
def _qkv_chunks(block, ctx, x, pe, offset, norm, *extra):
    """Pass 1 of one token stream: per chunk (one region), h = norm(chunk, *extra) and q, k, v of h (by columns), the
    chunk's positions offset + its tokens in pe."""
    slices = token_slices(x.shape[1], ctx.chunks)

    def qkv_of(xc, pec, *e):
        h = norm(xc, *e)
        b, n, d = h.shape
        # q, k and v each from its rows of the (LoRA) qkv weight (training/lora/linear_columns.py, as the Flux
        # single blocks compute linear1): under layer offload, row slices of a slot that regions save and recompute
        q, k, v = (linear_columns(block.qkv, h, slice(j * d, (j + 1) * d)).view(b, n, block.heads, d // block.heads)
                   .transpose(1, 2) for j in range(3))
        return q * pec, k * pec, v

    return slices, [ctx.run(qkv_of, x[:, sl], pe[offset + sl.start:offset + sl.stop], *extra) for sl in slices]


def _whole_attention(block, parts):
    q, k, v = (torch.cat([p[i] for p in parts], 2) for i in range(3))
    b, _, n, hd = q.shape
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, block.heads * hd)


def double_block_chunked(block, ctx, img, txt, *, vec, pe):
    bias = ctx.run(lambda t: block.txt_to_img(t.mean(1, keepdim=True)), txt)  # a mean over tokens: whole
    shift, scale, gate = ctx.run(lambda v: block.mod(F.silu(v)).unsqueeze(1).chunk(3, -1), vec)
    img = img + bias  # the block's in-place residual, out of place

    def modulated(xc, sh, sc):
        return F.layer_norm(xc, xc.shape[-1:]) * (1 + sc) + sh

    n_txt = txt.shape[1]
    t_slices, t_parts = _qkv_chunks(block, ctx, txt, pe, 0, modulated, shift, scale)
    i_slices, i_parts = _qkv_chunks(block, ctx, img, pe, n_txt, modulated, shift, scale)
    a = _whole_attention(block, t_parts + i_parts)
    del t_parts, i_parts

    def img_out(xc, ac, g):
        y = xc + g * block.proj(ac)
        return y + block.mlp(F.layer_norm(y, y.shape[-1:]))

    txt_out = torch.cat([ctx.run_output(lambda xc, ac, g: xc + g * block.proj(ac), txt[:, sl], a[:, sl], gate)
                         for sl in t_slices], 1)
    img_out = torch.cat([ctx.run_output(img_out, img[:, sl], a[:, n_txt + sl.start:n_txt + sl.stop], gate)
                         for sl in i_slices], 1)
    return img_out, txt_out


def single_block_chunked(block, ctx, x, *, vec, pe):
    x = x + ctx.run(lambda v: block.shift(F.silu(v)).unsqueeze(1), vec)  # out of place
    slices, parts = _qkv_chunks(block, ctx, x, pe, 0, lambda xc: F.layer_norm(xc, xc.shape[-1:]))
    a = _whole_attention(block, parts)
    del parts

    def out(xc, ac):
        y = xc + block.proj(ac)
        return y + block.mlp(F.layer_norm(y, y.shape[-1:]))

    return torch.cat([ctx.run_output(out, x[:, sl], a[:, sl]) for sl in slices], 1)


register_chunked_forward(DoubleBlock, double_block_chunked)
register_chunked_forward(SingleBlock, single_block_chunked)


class TwoStream(nn.Module):
    def __init__(self, d=32, heads=2, n_double=3, n_single=3, d_in=8):
        super().__init__()
        self.img_in, self.txt_in, self.vec_in = nn.Linear(d_in, d), nn.Linear(d_in, d), nn.Linear(d_in, d)
        self.double_blocks = nn.ModuleList(DoubleBlock(d, heads) for _ in range(n_double))
        self.single_blocks = nn.ModuleList(SingleBlock(d, heads) for _ in range(n_single))
        self.out = nn.Linear(d, d_in)
        self.d, self.heads = d, heads

    def embed(self, img, txt, vec):
        """The inputs projected to the model width, and the positional table `pe`."""
        img, txt, vec = self.img_in(img), self.txt_in(txt), self.vec_in(vec)
        n = txt.shape[1] + img.shape[1]
        pe = torch.cos(torch.arange(n, dtype=img.dtype, device=img.device)[:, None]
                       * torch.linspace(0.1, 1.0, self.d // self.heads, device=img.device))
        return img, txt, vec, pe

    def forward(self, img, txt, vec):
        img, txt, vec, pe = self.embed(img, txt, vec)
        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe)
        x = torch.cat([txt, img], 1)
        for block in self.single_blocks:
            x = block(x, vec=vec, pe=pe)
        return self.out(x[:, txt.shape[1]:])


LORA_TARGETS = r".*_blocks\.\d+\..*(qkv|proj|mod|shift|txt_to_img|mlp\.[02])"


def make_lora_model(seed=0, config=None, **kw):
    """The model with frozen base weights and LoRA (peft) on every block linear, B initialised non-zero; `config`: a
    peft config of another adapter instead (its target_modules are set here)."""
    torch.manual_seed(seed)
    model = TwoStream(**kw)
    model.requires_grad_(False)
    if config is not None:
        config.target_modules = LORA_TARGETS
        return inject_adapter_in_model(config, model)
    cfg = LoraConfig(r=4, lora_alpha=4, target_modules=LORA_TARGETS)
    model = inject_adapter_in_model(cfg, model)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.05)
    return model


def make_batch(seed=1, b=2, n_img=12, n_txt=5, d_in=8):
    g = torch.Generator().manual_seed(seed)
    return dict(img=torch.randn(b, n_img, d_in, generator=g), txt=torch.randn(b, n_txt, d_in, generator=g),
                vec=torch.randn(b, d_in, generator=g)), torch.randn(b, n_img, d_in, generator=g)


def train_steps(model, steps=2, runtime=None, lr=1e-2, micro=1):
    """Losses and LoRA gradients (cloned, on CPU) of `steps` AdamW steps; under a runtime whose strategy offloads the
    optimizer, AdamW steps on the host (training/host_optimizer.py) and the gradients are read there. `micro` > 1:
    each step's batch in that many micro-batches (gradient accumulation, each loss weighted by its share), with no
    synchronisation between them."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if runtime is not None and runtime.strategy.optimizer.enabled:
        return _train_steps_offloaded(model, params, steps, runtime, lr, micro)
    opt = torch.optim.AdamW(params.values(), lr=lr)
    losses, grads = [], []
    for step in range(steps):
        if runtime:
            runtime.start_step()
        loss = _accumulate(model, step, micro, runtime)
        if runtime:
            runtime.end_step()
        losses.append(loss)
        grads.append({n: p.grad.detach().cpu().clone() for n, p in params.items()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _accumulate(model, step, micro, runtime):
    """Forward and backward of step `step`'s batch in `micro` micro-batches; the step's loss. As the trainer: the
    batch reaches the device before the first forward (the runtime's InputCopies: no wait for compute) and the losses
    are summed there and read once, so nothing makes the host wait for the GPU between micro-batches (on a GPU a
    read or a blocking copy there would land every copy of the micro-batch before, and gpu-check's accumulation
    rows would not test copies in flight across micro-batches)."""
    inputs, target = make_batch(seed=100 + step)
    names = list(inputs)
    if runtime is not None:
        *values, target = runtime.inputs(*inputs.values(), target)
        inputs = dict(zip(names, values))
    size = target.shape[0]
    total = 0.0
    for k in range(micro):
        part = slice(k * size // micro, (k + 1) * size // micro)
        share = (part.stop - part.start) / size
        loss = F.mse_loss(model(**{n: v[part] for n, v in inputs.items()}), target[part])
        (loss * share if micro > 1 else loss).backward()
        total = total + exact_summable(loss.detach()) * share
    return float(total)


def _train_steps_offloaded(model, params, steps, runtime, lr, micro=1):
    optimizer = HostOptimizer(params, lambda host: torch.optim.AdamW(host.values(), lr=lr), runtime.device,
                              pin=runtime.strategy.offload.pin_memory, micro_batches=micro)
    losses, grads = [], []
    try:
        for step in range(steps):
            runtime.start_step()
            loss = _accumulate(model, step, micro, runtime)
            runtime.end_step()
            losses.append(loss)
            grads.append({n: p.grad.clone() for n, p in gradient_holders(optimizer, params).items()})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    finally:
        optimizer.close()
    return losses, grads
