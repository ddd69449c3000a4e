"""The official PPMA parameter names and ours: one table, both directions derived from it.

Each row pairs an official name with ours. ``{s}`` is a stage, ``{b}`` a block and ``{i}`` an output index;
``{s+1}`` is the next stage (the official model downsamples at the end of stages 0-2, ours at the start of
stages 1-3). A name ending in ``.`` is a prefix: the rest of the key (``weight``, ``bias``, ``conv.weight``,
``running_mean`` ...) is carried over unchanged. The official layer scales ``gamma_{1,2}`` are ``[1, 1, 1, C]``,
ours ``[C]`` (rows marked ``LAYER_SCALE``). The official names are those of the official classification model
``PPMAViT`` and of its dense-prediction backbone (``outnorm{i}``, README "Features").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Callable

import torch

__all__ = ["NAME_TABLE", "official_to_ours", "ours_to_official", "to_ours", "to_official", "is_ours"]

LAYER_SCALE = "layer_scale"
_BLOCK, _SBLOCK = "layers.{s}.blocks.{b}.", "stages.{s}.blocks.{b}."

#: (official name, our name, shape rule or None). Written once; :func:`to_ours` and :func:`to_official` read it.
NAME_TABLE: tuple[tuple[str, str, str | None], ...] = (
    ("patch_embed.proj.0.", "stem.conv1.", None),
    ("patch_embed.proj.1.", "stem.bn1.", None),
    ("patch_embed.proj.3.", "stem.conv2.", None),
    ("patch_embed.proj.4.", "stem.bn2.", None),
    ("patch_embed.proj.6.", "stem.conv3.", None),
    ("patch_embed.proj.7.", "stem.bn3.", None),
    ("patch_embed.proj.9.", "stem.conv4.", None),
    ("patch_embed.proj.10.", "stem.bn4.", None),
    ("layers.{s}.Relpos.angle", "stages.{s}.rope.angle", None),
    (_BLOCK + "pos.", _SBLOCK + "cpe.", None),
    (_BLOCK + "retention_layer_norm.", _SBLOCK + "norm1.", None),
    (_BLOCK + "retention.q_proj.", _SBLOCK + "attn.q.", None),
    (_BLOCK + "retention.k_proj.", _SBLOCK + "attn.k.", None),
    (_BLOCK + "retention.v_proj.", _SBLOCK + "attn.v.", None),
    (_BLOCK + "retention.out_proj.", _SBLOCK + "attn.proj.", None),
    (_BLOCK + "retention.lepe.", _SBLOCK + "attn.lepe.", None),
    (_BLOCK + "retention.path_embed.", _SBLOCK + "attn.decay.", None),  # dt_linear.weight, dt_bias, A_log
    (_BLOCK + "final_layer_norm.", _SBLOCK + "norm2.", None),
    (_BLOCK + "ffn.", _SBLOCK + "mlp.", None),  # fc1, fc2, dwconv.conv
    (_BLOCK + "gamma_1", _SBLOCK + "ls1.gamma", LAYER_SCALE),
    (_BLOCK + "gamma_2", _SBLOCK + "ls2.gamma", LAYER_SCALE),
    ("layers.{s}.downsample.reduction.", "stages.{s+1}.downsample.conv.", None),
    ("layers.{s}.downsample.norm.", "stages.{s+1}.downsample.norm.", None),
    ("proj.", "head.proj.", None),
    ("norm.", "head.norm.", None),
    ("head.", "head.fc.", None),
    ("outnorm{i}.", "out_norms.{i}.", None),
)

_FIELD = re.compile(r"\{(\w)(\+1)?\}")


def _compile(template: str) -> re.Pattern:
    """``layers.{s}.blocks.{b}.`` -> a regex with one group per field (``{s+1}`` gets its own group)."""
    out, pos = [], 0
    for m in _FIELD.finditer(template):
        out.append(re.escape(template[pos:m.start()]))
        out.append(rf"(?P<{m[1]}{'_next' if m[2] else ''}>\d+)")
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("^" + "".join(out) + ("" if template.endswith(".") else "$"))


def _fill(template: str, fields: dict[str, int]) -> str:
    return _FIELD.sub(lambda m: str(fields[m[1]] + (1 if m[2] else 0)), template)


def _fields(m: re.Match) -> dict[str, int]:
    """Group values -> field values; a ``{s+1}`` group holds s + 1."""
    return {k.removesuffix("_next"): int(v) - (1 if k.endswith("_next") else 0) for k, v in m.groupdict().items()}


def _rules(src: int, dst: int) -> list[tuple[re.Pattern, str, str | None]]:
    return [(_compile(row[src]), row[dst], row[2]) for row in NAME_TABLE]


_TO_OURS = _rules(0, 1)
_TO_OFFICIAL = _rules(1, 0)


def _rename(key: str, rules) -> tuple[str, str | None] | None:
    for pattern, template, shape in rules:
        m = pattern.match(key)
        if m:
            return _fill(template, _fields(m)) + key[m.end():], shape
    return None


def official_to_ours(key: str) -> str | None:
    """Our name of the official parameter ``key``, or ``None`` when it matches no row of :data:`NAME_TABLE`."""
    r = _rename(key, _TO_OURS)
    return r[0] if r else None


def ours_to_official(key: str) -> str | None:
    """The official name of our parameter ``key``, or ``None`` when it matches no row of :data:`NAME_TABLE`."""
    r = _rename(key, _TO_OFFICIAL)
    return r[0] if r else None


def _convert(state_dict: Mapping[str, torch.Tensor], rules, reshape: Callable) -> tuple[dict, list[str]]:
    out, unknown = {}, []
    for k, v in state_dict.items():
        r = _rename(k, rules)
        if r is None:
            unknown.append(k)
            out[k] = v
            continue
        new, shape = r
        out[new] = reshape(v) if shape == LAYER_SCALE else v
    return out, unknown


def to_ours(state_dict: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Official names -> ours (layer scales ``[1, 1, 1, C]`` -> ``[C]``). Returns the new state dict (keys
    that match no row kept as they are) and the list of those unmatched keys."""
    return _convert(state_dict, _TO_OURS, lambda v: v.reshape(-1))


def to_official(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names -> the official ones (layer scales ``[C]`` -> ``[1, 1, 1, C]``); ``KeyError`` on a key that
    matches no row."""
    out, unknown = _convert(state_dict, _TO_OFFICIAL, lambda v: v.reshape(1, 1, 1, -1))
    if unknown:
        raise KeyError(f"convert_to_official_state_dict: no official name for {unknown[0]!r}"
                       f"{f' (and {len(unknown) - 1} more)' if len(unknown) > 1 else ''}")
    return out


def is_ours(state_dict: Mapping[str, torch.Tensor]) -> bool:
    """Whether ``state_dict`` is already in our naming (its keys start with ``stem.`` or ``stages.``)."""
    return any(k.startswith(("stem.", "stages.")) for k in state_dict)
