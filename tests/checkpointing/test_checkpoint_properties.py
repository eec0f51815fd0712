"""Property test: the fixed checkpoint's gradients equal the no-checkpoint reference for random small
module stacks, random frozen masks, every kind of input, dropout and CPU autocast."""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from gradpatch.checkpointing.checkpoint import checkpoint

LAYERS = {
    "linear": lambda: torch.nn.Linear(8, 8),
    "norm": lambda: torch.nn.LayerNorm(8),
    "gelu": torch.nn.GELU,
    "dropout": lambda: torch.nn.Dropout(0.3),
}


class Block(torch.nn.Module):
    def __init__(self, kinds: list[str]) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(LAYERS[k]() for k in kinds))
        self.gate = torch.nn.Parameter(torch.randn(8) * 0.1)

    def body(self, x, extra, index):
        h = self.layers(x) * self.gate
        if extra is not None:
            h = h + extra
        if index is not None:  # an integer tensor input: used, never differentiated
            h = h * (1 + index.float().mean())
        return h

    def forward(self, x, extra, index, use_checkpoint: bool):
        return checkpoint(self.body, (x, extra, index), self.parameters(), use_checkpoint)


def gradients(block, inputs, seed, use_checkpoint, autocast):
    torch.manual_seed(seed)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    params = [p for p in block.parameters() if p.requires_grad]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = block(*inputs, use_checkpoint)
    loss = out.float().pow(2).mean()
    return torch.autograd.grad(loss, leaves + params)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(sorted(LAYERS)), min_size=1, max_size=4),
    frozen=st.lists(st.booleans(), min_size=12, max_size=12),
    x_grad=st.booleans(),
    extra=st.sampled_from(["none", "plain", "grad"]),
    with_index=st.booleans(),
    autocast=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fixed_checkpoint_equals_no_checkpoint(kinds, frozen, x_grad, extra, with_index, autocast, seed):
    torch.manual_seed(seed)
    block = Block(kinds).train()
    for parameter, freeze in zip(block.parameters(), frozen):
        parameter.requires_grad_(not freeze)
    x = torch.randn(3, 8, requires_grad=x_grad)
    extra_tensor = None if extra == "none" else torch.randn(3, 8, requires_grad=extra == "grad")
    index = torch.randint(0, 5, (3,)) if with_index else None
    inputs = (x, extra_tensor, index)
    assume(x_grad or extra == "grad" or any(p.requires_grad for p in block.parameters()))
    expected = gradients(block, inputs, seed, use_checkpoint=False, autocast=autocast)
    actual = gradients(block, inputs, seed, use_checkpoint=True, autocast=autocast)
    assert len(actual) == len(expected)
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
