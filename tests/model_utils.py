"""What the model tests share: one real training step (an optimizer step that every parameter takes part in,
and a loss that moves)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def assert_trains_one_step(model: torch.nn.Module, x: torch.Tensor, num_classes: int, lr: float = 1e-2) -> None:
    """One SGD step on ``(x, fixed targets)``: every parameter gets a finite gradient (none is left out of the
    graph; it may be zero where the architecture makes it so: a conv bias before BatchNorm, q of a one-token map),
    and the loss on the same batch goes down after the step."""
    model.train()
    target = torch.arange(x.shape[0]) % num_classes
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss = F.cross_entropy(model(x), target)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{n}: non-finite gradient"
    assert sum(p.grad.abs().sum() for p in model.parameters()) > 0
    opt.step()
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    with torch.no_grad():
        after = F.cross_entropy(model(x), target)
    assert after < loss.detach(), f"loss did not go down: {loss.item():.6f} -> {after.item():.6f}"
