"""Official PPMA checkpoints <-> our module names (spec §5), and checkpoint loading.

Official names (``PPMA.py:PPMAViT``, spec §5.1) map one to one onto ours::

    patch_embed.proj.{0,3,6,9}                 stem.conv{1,2,3,4}
    patch_embed.proj.{1,4,7,10}                stem.bn{1,2,3,4}
    layers.{s}.Relpos.angle                    stages.{s}.rope.angle
    layers.{s}.blocks.{b}.pos.conv             stages.{s}.blocks.{b}.cpe.conv
    ....retention_layer_norm                   ....norm1
    ....retention.{q,k,v,out}_proj             ....attn.{q,k,v,proj}
    ....retention.lepe.conv                    ....attn.lepe.conv
    ....retention.path_embed.*                 ....attn.decay.*   (dt_linear.weight, dt_bias, A_log)
    ....final_layer_norm                       ....norm2
    ....ffn.{fc1,fc2,dwconv.conv}              ....mlp.{fc1,fc2,dwconv.conv}
    ....gamma_{1,2}  [1, 1, 1, C]              ....ls{1,2}.gamma  [C]
    layers.{s}.downsample.{reduction,norm}     stages.{s+1}.downsample.{conv,norm}
    proj / norm / head                         head.proj / head.norm / head.fc
    outnorm{i}  (dense-prediction backbone)    out_norms.{i}
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from collections.abc import Mapping
from typing import Sequence

import torch

__all__ = [
    "convert_official_state_dict",
    "convert_to_official_state_dict",
    "select_state_dict",
    "load_checkpoint",
    "EVAL_KEYS",
    "DOWNSTREAM_KEYS",
]

_logger = logging.getLogger("ppma")

#: Checkpoint keys tried in order for ImageNet evaluation: the reported accuracies are EMA maxima (spec §5.2).
EVAL_KEYS = ("model_ema", "model", "models", "state_dict")
#: Keys tried in order for downstream initialisation, mirroring the official backbones' ``key='model'``.
DOWNSTREAM_KEYS = ("model", "models", "model_ema", "state_dict")

_BLOCK = r"layers\.(\d+)\.blocks\.(\d+)\."
# (official regex, our template); groups of the official regex fill the template.
_OFFICIAL_TO_OURS = [
    (r"^patch_embed\.proj\.(0|3|6|9)\.", lambda m: f"stem.conv{int(m[1]) // 3 + 1}."),
    (r"^patch_embed\.proj\.(1|4|7|10)\.", lambda m: f"stem.bn{int(m[1]) // 3 + 1}."),
    (r"^layers\.(\d+)\.Relpos\.angle$", lambda m: f"stages.{m[1]}.rope.angle"),
    (rf"^{_BLOCK}pos\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.cpe."),
    (rf"^{_BLOCK}retention_layer_norm\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.norm1."),
    (rf"^{_BLOCK}retention\.(q|k|v)_proj\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.attn.{m[3]}."),
    (rf"^{_BLOCK}retention\.out_proj\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.attn.proj."),
    (rf"^{_BLOCK}retention\.lepe\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.attn.lepe."),
    (rf"^{_BLOCK}retention\.path_embed\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.attn.decay."),
    (rf"^{_BLOCK}final_layer_norm\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.norm2."),
    (rf"^{_BLOCK}ffn\.", lambda m: f"stages.{m[1]}.blocks.{m[2]}.mlp."),
    (rf"^{_BLOCK}gamma_(1|2)$", lambda m: f"stages.{m[1]}.blocks.{m[2]}.ls{m[3]}.gamma"),
    (r"^layers\.(\d+)\.downsample\.reduction\.", lambda m: f"stages.{int(m[1]) + 1}.downsample.conv."),
    (r"^layers\.(\d+)\.downsample\.norm\.", lambda m: f"stages.{int(m[1]) + 1}.downsample.norm."),
    (r"^proj\.", lambda m: "head.proj."),
    (r"^norm\.", lambda m: "head.norm."),
    (r"^head\.", lambda m: "head.fc."),
    (r"^outnorm(\d+)\.", lambda m: f"out_norms.{m[1]}."),
]

_SBLOCK = r"stages\.(\d+)\.blocks\.(\d+)\."
_OURS_TO_OFFICIAL = [
    (r"^stem\.conv(\d)\.", lambda m: f"patch_embed.proj.{(int(m[1]) - 1) * 3}."),
    (r"^stem\.bn(\d)\.", lambda m: f"patch_embed.proj.{(int(m[1]) - 1) * 3 + 1}."),
    (r"^stages\.(\d+)\.rope\.angle$", lambda m: f"layers.{m[1]}.Relpos.angle"),
    (rf"^{_SBLOCK}cpe\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.pos."),
    (rf"^{_SBLOCK}norm1\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.retention_layer_norm."),
    (rf"^{_SBLOCK}attn\.(q|k|v)\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.retention.{m[3]}_proj."),
    (rf"^{_SBLOCK}attn\.proj\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.retention.out_proj."),
    (rf"^{_SBLOCK}attn\.lepe\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.retention.lepe."),
    (rf"^{_SBLOCK}attn\.decay\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.retention.path_embed."),
    (rf"^{_SBLOCK}norm2\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.final_layer_norm."),
    (rf"^{_SBLOCK}mlp\.", lambda m: f"layers.{m[1]}.blocks.{m[2]}.ffn."),
    (rf"^{_SBLOCK}ls(1|2)\.gamma$", lambda m: f"layers.{m[1]}.blocks.{m[2]}.gamma_{m[3]}"),
    (r"^stages\.(\d+)\.downsample\.conv\.", lambda m: f"layers.{int(m[1]) - 1}.downsample.reduction."),
    (r"^stages\.(\d+)\.downsample\.norm\.", lambda m: f"layers.{int(m[1]) - 1}.downsample.norm."),
    (r"^head\.proj\.", lambda m: "proj."),
    (r"^head\.norm\.", lambda m: "norm."),
    (r"^head\.fc\.", lambda m: "head."),
    (r"^out_norms\.(\d+)\.", lambda m: f"outnorm{m[1]}."),
]
_OFFICIAL_TO_OURS = [(re.compile(p), f) for p, f in _OFFICIAL_TO_OURS]
_OURS_TO_OFFICIAL = [(re.compile(p), f) for p, f in _OURS_TO_OFFICIAL]


def _rename(key: str, rules) -> str | None:
    for pattern, template in rules:
        m = pattern.match(key)
        if m:
            return template(m) + key[m.end() :]
    return None


def _is_state_dict(obj) -> bool:
    return isinstance(obj, Mapping) and len(obj) > 0 and all(isinstance(v, torch.Tensor) for v in obj.values())


def select_state_dict(checkpoint, key: str | Sequence[str] | None = None) -> tuple[dict, str | None]:
    """Pick the weights out of a checkpoint (spec §5.2).

    Args:
        checkpoint: a bare state dict, or a dict holding one under ``model``, ``models``, ``model_ema`` or
            ``state_dict``.
        key: the key to use (``KeyError`` if absent), or a sequence of keys tried in order; ``None`` means
            :data:`EVAL_KEYS` (``model_ema`` first).

    Returns:
        ``(state_dict, chosen_key)``; ``chosen_key`` is ``None`` for a bare state dict.
    """
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint must be a dict, got {type(checkpoint).__name__}")
    if _is_state_dict(checkpoint):
        if isinstance(key, str):
            raise KeyError(f"checkpoint is a bare state dict; key={key!r} cannot be selected")
        return dict(checkpoint), None
    keys = (key,) if isinstance(key, str) else tuple(key or EVAL_KEYS)
    for k in keys:
        if k in checkpoint and isinstance(checkpoint[k], Mapping):
            return dict(checkpoint[k]), k
    raise KeyError(f"none of the keys {list(keys)} holds a state dict; checkpoint keys are {sorted(checkpoint)}")


def convert_official_state_dict(
    checkpoint, key: str | Sequence[str] | None = None, verbose: bool = True
) -> dict[str, torch.Tensor]:
    """Convert an official PPMA checkpoint (classification or mmdet/mmseg) to our naming (spec §5).

    Strips ``module.`` and ``backbone.`` prefixes (keeping only ``backbone.*`` entries when an mm
    checkpoint also holds a neck and heads), renames every key (see the module docstring) and reshapes
    layer-scale ``gamma_{1,2}`` from ``[1, 1, 1, C]`` to ``[C]``. A state dict already in our naming passes
    through unchanged. Keys that match no rule are kept as they are (a strict load then reports them).

    Args:
        checkpoint: a loaded checkpoint (see :func:`select_state_dict`).
        key: which entry to use; ``None`` tries :data:`EVAL_KEYS` in order.
        verbose: log which entry was loaded and what was dropped (at WARNING level when ambiguous).

    Returns:
        A new state dict in our naming.
    """
    sd, chosen = select_state_dict(checkpoint, key)
    if verbose:
        candidates = [k for k in EVAL_KEYS if isinstance(checkpoint, Mapping) and k in checkpoint]
        msg = f"ppma: loading weights from checkpoint entry {chosen!r}" if chosen else "ppma: loading a bare state dict"
        (_logger.warning if len(candidates) > 1 else _logger.info)(
            msg + (f" (entries present: {candidates})" if len(candidates) > 1 else "")
        )
    sd = {k[len("module.") :] if k.startswith("module.") else k: v for k, v in sd.items()}
    if any(k.startswith("backbone.") for k in sd):
        dropped = [k for k in sd if not k.startswith("backbone.")]
        sd = {k[len("backbone.") :]: v for k, v in sd.items() if k.startswith("backbone.")}
        if verbose and dropped:
            _logger.info(f"ppma: kept the {len(sd)} backbone.* entries, dropped {len(dropped)} others (neck/heads)")
    if any(k.startswith(("stem.", "stages.")) for k in sd):  # already in our naming
        return sd
    out: dict[str, torch.Tensor] = {}
    unknown = []
    for k, v in sd.items():
        new = _rename(k, _OFFICIAL_TO_OURS)
        if new is None:
            unknown.append(k)
            out[k] = v
            continue
        if re.search(r"\.ls[12]\.gamma$", new):
            v = v.reshape(-1)
        out[new] = v
    if verbose and unknown:
        _logger.warning(f"ppma: {len(unknown)} checkpoint keys match no PPMA name, kept as is: {unknown[:8]}")
    return out


def convert_to_official_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of :func:`convert_official_state_dict`: our naming -> the official names of spec §5.1."""
    out = {}
    for k, v in state_dict.items():
        new = _rename(k, _OURS_TO_OFFICIAL)
        if new is None:
            raise KeyError(f"convert_to_official_state_dict: no official name for {k!r}")
        if re.search(r"\.gamma_[12]$", new):
            v = v.reshape(1, 1, 1, -1)
        out[new] = v
    return out


def load_checkpoint(
    model: torch.nn.Module,
    path: str | os.PathLike,
    key: str | Sequence[str] | None = None,
    strict: bool = True,
    map_location="cpu",
    verbose: bool = True,
):
    """Load an official or ppma checkpoint file (``.pth``/``.pt`` or ``.safetensors``) into ``model``.

    ``.pth`` files are read with ``torch.load(weights_only=True)``. Missing RoPE ``angle`` buffers (a fixed
    function of the head dim) are taken from the model. Entries whose shape differs from the
    model's (e.g. a 1000-class ``head.fc`` into a 10-class model) are dropped and reported; with
    ``strict=True`` every other mismatch (missing or unexpected keys) raises.

    Returns:
        The ``(missing_keys, unexpected_keys)`` result of ``load_state_dict``.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"load_checkpoint: no checkpoint file at {path!r}")
    if os.path.getsize(path) == 0:  # torch.load would raise a bare EOFError
        raise ValueError(f"load_checkpoint: the checkpoint file {path!r} is empty")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            checkpoint = load_file(path, device=str(map_location))
        else:
            checkpoint = torch.load(path, map_location=map_location, weights_only=True)
    except (EOFError, RuntimeError, pickle.UnpicklingError) as exc:
        raise ValueError(f"load_checkpoint: {path!r} is not a readable checkpoint ({type(exc).__name__}: {exc})") from exc
    sd = convert_official_state_dict(checkpoint, key=key, verbose=verbose)
    own = model.state_dict()
    for k, v in own.items():  # the RoPE angles are a fixed function of head_dim; tolerate checkpoints without them
        if k.endswith(".rope.angle") and k not in sd:
            sd[k] = v
    mismatched = [k for k, v in sd.items() if k in own and own[k].shape != v.shape]
    for k in mismatched:
        if verbose:
            _logger.warning(f"ppma: dropping {k}: checkpoint shape {tuple(sd[k].shape)} != model {tuple(own[k].shape)}")
        del sd[k]
    if strict and mismatched:
        allowed = all(k.startswith("head.fc.") for k in mismatched)
        if not allowed:
            raise RuntimeError(f"load_checkpoint: shape mismatch for {mismatched}")
        result = model.load_state_dict(sd, strict=False)
        bad_missing = [k for k in result.missing_keys if not k.startswith("head.fc.")]
        if bad_missing or result.unexpected_keys:
            raise RuntimeError(
                f"load_checkpoint: missing keys {bad_missing}, unexpected keys {result.unexpected_keys}"
            )
    else:
        result = model.load_state_dict(sd, strict=strict)
    if verbose:
        _logger.info(f"ppma: loaded {len(sd)} tensors from {os.path.basename(path)}; "
                     f"missing {len(result.missing_keys)}, unexpected {len(result.unexpected_keys)}")
    return result
