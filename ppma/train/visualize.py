"""Learned decays, polyline masks and masked attention maps of a PPMA model (spec §2 C.1, paper B.6).

:func:`capture_attention` records a forward pass's attention inputs and ``PathDecay`` outputs;
:func:`mask_row` gives a query's row of the polyline mask ``L`` (or ``L^T``) and :func:`attention_row` its
attention weights as the model computes them. ``ppma-visualize`` (:mod:`ppma.train.cli.visualize`) plots them.
"""

from __future__ import annotations

import contextlib
import sys

import torch

__all__ = [
    "mask_row",
    "attention_row",
    "capture_attention",
]


# ----------------------------------------------------------------------------------------------- math


def mask_row(log_alpha: torch.Tensor, log_beta: torch.Tensor, query: tuple[int, int], transpose: bool = False):
    """Row ``p = (i, j)`` of the V2H polyline mask ``L`` (``transpose=True``: of ``L^T``), as an ``[H, W]`` map.

    ``log_alpha, log_beta: [H, W]`` of one head. ``L[p, s] = (L^T e_p)[s]``, so the row of ``L`` is one
    ``polyline_scan`` with ``transpose=True`` of the one-hot vector ``e_p``, and the row of ``L^T`` one
    ``polyline_scan`` without transpose (spec §2, Algorithm 1)."""
    from ppma.ops import polyline_scan

    H, W = log_alpha.shape
    i, j = query
    if not (0 <= i < H and 0 <= j < W):
        raise ValueError(f"query {query} is outside the {H}x{W} token grid")
    e = torch.zeros(1, H, W, 1, 1, dtype=log_alpha.dtype, device=log_alpha.device)
    e[0, i, j, 0, 0] = 1.0
    y = polyline_scan(e, log_alpha[None, :, :, None], log_beta[None, :, :, None], transpose=not transpose)
    return y[0, :, :, 0, 0]


def attention_row(q, k, log_alpha, log_beta, query: tuple[int, int], criss_cross: bool, scale=None):
    """Attention weights of query token ``(i, j)`` over all keys, ``[H, W]`` (they sum to 1).

    ``q, k: [H, W, d]`` and ``log_alpha, log_beta: [H, W]`` of one head (``q``, ``k`` as the operator
    receives them). The weights are read off the reference operators applied to one-hot values
    (``v = I``), so they are exactly what the model uses: ``out_p = sum_s P[p, s] v_s``."""
    from ppma.ops.reference import criss_cross_attention_ref, polyline_attention_ref

    H, W, d = q.shape
    i, j = query
    if not (0 <= i < H and 0 <= j < W):
        raise ValueError(f"query {query} is outside the {H}x{W} token grid")
    eye = torch.eye(H * W, dtype=torch.float64, device=q.device).reshape(1, H, W, 1, H * W)
    op = criss_cross_attention_ref if criss_cross else polyline_attention_ref
    P = op(q.double()[None, :, :, None], k.double()[None, :, :, None], eye,
           log_alpha.double()[None, :, :, None], log_beta.double()[None, :, :, None], scale)
    return P[0, i, j, 0].reshape(H, W)


# ----------------------------------------------------------------------------------------------- capture

_OPS = ("polyline_attention", "criss_cross_attention", "polyline_attention_ref", "criss_cross_attention_ref")


@contextlib.contextmanager
def capture_attention(model: torch.nn.Module):
    """Record, during a forward pass, every PPMA attention call (operator inputs) and every ``PathDecay``
    output, in call order.

    Yields ``records``: a dict with ``calls`` (list of dicts with ``kind`` in {"full", "criss_cross"},
    ``q``, ``k`` ``[B, H, W, heads, d]``, ``log_alpha``, ``log_beta`` ``[B, H, W, heads]``, ``scale``)
    and ``decays`` (list of ``(module_name, log_alpha, log_beta)``). The operators are wrapped wherever
    a loaded ``ppma`` module holds a reference to them."""
    import ppma.ops
    import ppma.ops.reference

    records = {"calls": [], "decays": []}
    depth = [0]  # the fused wrappers fall back to the *_ref functions: record the outermost call only
    originals = {}
    for name in _OPS:
        src = ppma.ops.reference if name.endswith("_ref") else ppma.ops
        originals[name] = getattr(src, name)

    def wrap(name, fn):
        kind = "criss_cross" if name.startswith("criss") else "full"

        def wrapper(q, k, v, log_alpha, log_beta, *args, **kwargs):
            scale = args[0] if args else kwargs.get("scale")
            if depth[0] == 0:
                records["calls"].append({"kind": kind, "q": q.detach(), "k": k.detach(),
                                         "log_alpha": log_alpha.detach(), "log_beta": log_beta.detach(),
                                         "scale": scale})
            depth[0] += 1
            try:
                return fn(q, k, v, log_alpha, log_beta, *args, **kwargs)
            finally:
                depth[0] -= 1

        return wrapper

    wrappers = {name: wrap(name, fn) for name, fn in originals.items()}
    patched = []  # (module, attribute, original)
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name == "ppma" or mod_name.startswith("ppma.")):
            continue
        for attr, value in list(vars(mod).items()):
            for name, fn in originals.items():
                if value is fn:
                    patched.append((mod, attr, value))
                    setattr(mod, attr, wrappers[name])
    handles = []
    try:
        from ppma.nn import PathDecay
    except ImportError:  # no decay modules: fall back to the decays the operators receive
        PathDecay = None
    if PathDecay is not None:
        for mname, m in model.named_modules():
            if isinstance(m, PathDecay):
                handles.append(m.register_forward_hook(
                    lambda mod, inp, out, mname=mname: records["decays"].append(
                        (mname, out[0].detach(), out[1].detach()))))
    try:
        yield records
    finally:
        for mod, attr, value in patched:
            setattr(mod, attr, value)
        for h in handles:
            h.remove()
