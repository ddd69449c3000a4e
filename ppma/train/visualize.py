"""Learned decays, polyline masks and masked attention maps of a PPMA model (docs/model.md §2 C.1, paper B.6).

:func:`capture_attention` records a forward pass's attention inputs and ``PathDecay`` outputs;
:func:`mask_row` gives a query's row of the polyline mask ``L`` (or ``L^T``) and :func:`attention_row` its
attention weights as the model computes them. ``ppma-visualize`` (:mod:`ppma.train.cli.visualize`) plots them.
"""

from __future__ import annotations

import contextlib

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
    ``polyline_scan`` without transpose (docs/model.md §2, Algorithm 1)."""
    from ppma.ops import polyline_scan

    H, W = log_alpha.shape
    i, j = query
    if not (0 <= i < H and 0 <= j < W):
        raise ValueError(f"query {query} is outside the {H}x{W} token grid")
    e = torch.zeros(1, H, W, 1, 1, dtype=log_alpha.dtype, device=log_alpha.device)
    e[0, i, j, 0, 0] = 1.0
    y = polyline_scan(e, log_alpha[None, :, :, None], log_beta[None, :, :, None], transpose=not transpose)
    return y[0, :, :, 0, 0]


def attention_row(q, k, log_alpha, log_beta, query: tuple[int, int], mixer: str, scale=None,
                  mask: str = "polyline"):
    """Attention weights of query token ``(i, j)`` over all keys, ``[H, W]`` (they sum to 1).

    ``q, k: [H, W, d]`` and ``log_alpha, log_beta: [H, W]`` of one head (``q``, ``k`` as the operator
    receives them); ``mixer`` is the layer's softmax attention, ``"full"`` or ``"criss_cross"``. The weights are
    read off the operators applied to one-hot values (``v = I``), so they are exactly what the model uses:
    ``out_p = sum_s P[p, s] v_s``: the reference operators for the polyline mask,
    :func:`ppma.nn.masks.masked_attention` of ``mask`` for the ablation masks (docs/ops.md, "Masks"); in
    criss-cross stages ``P`` is the two-step composition (row then column attention, and the reverse), whose row
    still sums to 1."""
    from ppma.ops.reference import criss_cross_attention_ref, polyline_attention_ref

    H, W, d = q.shape
    i, j = query
    if mixer not in ("full", "criss_cross"):
        raise ValueError(f"attention_row: mixer must be 'full' or 'criss_cross', got {mixer!r}")
    if not (0 <= i < H and 0 <= j < W):
        raise ValueError(f"query {query} is outside the {H}x{W} token grid")
    eye = torch.eye(H * W, dtype=torch.float64, device=q.device).reshape(1, H, W, 1, H * W)
    args = (q.double()[None, :, :, None], k.double()[None, :, :, None], eye,
            log_alpha.double()[None, :, :, None], log_beta.double()[None, :, :, None])
    if mask == "polyline":
        op = criss_cross_attention_ref if mixer == "criss_cross" else polyline_attention_ref
        P = op(*args, scale)
    else:
        from ppma.nn.masks import masked_attention

        P = masked_attention(mask, mixer, *args, d**-0.5 if scale is None else scale)
    return P[0, i, j, 0].reshape(H, W)


def mask_rows(mask: str, log_alpha: torch.Tensor, log_beta: torch.Tensor, query: tuple[int, int]):
    """The two masks of ``mask`` (docs/ops.md, "Masks": ``exp(M_a)`` and ``exp(M_b)``) seen from query ``(i, j)``,
    each an ``[H, W]`` map, with the names of the two and of their sum. ``log_alpha, log_beta: [H, W]`` of one head, as the attention
    receives them (constants for ``none`` / ``manhattan``, one decay twice for ``shared``), so the polyline
    family (``polyline``, ``none``, ``manhattan``, ``shared``: V2H and H2V of those decays) and ``v2h`` (V2H
    twice) read off :func:`mask_row`; ``cross_scan`` / ``hilbert`` are the 1-D masks along their two orders."""
    H, W = log_alpha.shape
    if mask in ("cross_scan", "hilbert"):
        from ppma.nn.masks import scan_orders, order_log_mask

        i, j = query
        if not (0 <= i < H and 0 <= j < W):
            raise ValueError(f"query {query} is outside the {H}x{W} token grid")
        order_a, order_b = scan_orders(mask, H, W, log_alpha.device)
        rows = [order_log_mask(t[None, :, :, None], order)[0, 0, i * W + j].reshape(H, W).exp()
                for t, order in ((log_alpha, order_a), (log_beta, order_b))]
        names = ("row-major" if mask == "cross_scan" else "Hilbert", "column-major" if mask == "cross_scan"
                 else "Hilbert (transposed)")
        return rows[0], rows[1], tuple(f"{n} scan mask" for n in names) + (f"{mask}: both",)
    v2h = mask_row(log_alpha, log_beta, query)
    if mask == "v2h":
        return v2h, v2h, ("V2H mask", "V2H mask (both terms)", "v2h: both")
    names = ("V2H mask L (row of query)", "H2V mask L^T")
    names += ("2-D mask L + L^T",) if mask == "polyline" else (f"{mask}: both",)
    return v2h, mask_row(log_alpha, log_beta, query, transpose=True), names


# ----------------------------------------------------------------------------------------------- capture

@contextlib.contextmanager
def capture_attention(model: torch.nn.Module):
    """Record, during a forward pass, every PPMA attention call (operator inputs) and every ``PathDecay``
    output, in call order.

    Yields ``records``: a dict with ``calls`` (list of dicts with ``kind`` in {"full", "criss_cross"},
    ``q``, ``k`` ``[B, H, W, heads, d]``, ``log_alpha``, ``log_beta`` ``[B, H, W, heads]``, ``scale``, ``mask``)
    and ``decays`` (list of ``(module_name, log_alpha, log_beta)``). Both are read with forward hooks: on
    every ``ppma.nn.MaskedAttentionOp`` (the module through which each attention layer calls its operator,
    whichever implementation ``ppma.ops.set_impl`` picks) and every ``ppma.nn.PathDecay``."""
    from ppma.nn import MaskedAttentionOp, PathDecay

    records = {"calls": [], "decays": []}

    def on_attention(mod, inputs, output):
        q, k, _, log_alpha, log_beta = inputs
        records["calls"].append({"kind": mod.mixer, "q": q.detach(), "k": k.detach(),
                                 "log_alpha": log_alpha.detach(), "log_beta": log_beta.detach(),
                                 "scale": mod.scale, "mask": mod.mask})

    handles = []
    for mname, m in model.named_modules():
        if isinstance(m, MaskedAttentionOp):
            handles.append(m.register_forward_hook(on_attention))
        elif isinstance(m, PathDecay):
            handles.append(m.register_forward_hook(
                lambda mod, inp, out, mname=mname: records["decays"].append(
                    (mname, out[0].detach(), out[1].detach()))))
    try:
        yield records
    finally:
        for h in handles:
            h.remove()
