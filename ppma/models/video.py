"""PPMA video backbone with 3-D polyline path masked attention (paper appendix C.2; ``ppma.nn.attention_3d``).

``ppma.create_model("ppma_video_tiny")`` (not registered with timm; docs/video.md): clips ``[B, C, T, H, W]`` ->
logits. A 3-D patch embedding (tubelets of ``tubelet = (2, 4, 4)``: a temporal stride of 2, a spatial stride of 4;
``T, H, W`` must be multiples of it), four stages of :class:`VideoBlock` with spatial ``2 x 2`` patch merging
between them (time is kept), and a LayerNorm + mean-pool + linear head. Each stage runs the 3-D attention in
``"axial"`` (``O(N (T + H + W))``, for the large early maps) or ``"full"`` mode; ``mask="none"`` is the ablation
without the polyline mask, ``frame_wise=True`` the 2-D baseline that attends within each frame only (the 2-D
polyline attention per frame, a frame-wise model; only the final pooling mixes frames).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from ppma.nn.attention_3d import DWConv3d, PPMAAttention3D
from ppma.nn.layers import DropPath, _has_hooks, conv3d, linear

__all__ = ["VideoConfig", "PPMAVideo", "VideoBlock", "VIDEO_MODEL_CONFIGS", "create_video_model"]


@dataclass(frozen=True)
class VideoConfig:
    """Hyper-parameters of :class:`PPMAVideo` (per-stage tuples have four entries)."""

    in_chans: int = 3
    num_classes: int = 400
    embed_dims: tuple = (64, 128, 256, 512)
    depths: tuple = (2, 2, 6, 2)
    num_heads: tuple = (2, 4, 8, 16)
    mlp_ratios: tuple = (3.0, 3.0, 3.0, 3.0)
    mixer: tuple = ("axial", "axial", "full", "full")  # per stage: ppma.nn.attention_3d.MIXERS_3D
    mask: str = "polyline"
    frame_wise: bool = False
    tubelet: tuple = (2, 4, 4)
    drop_path_rate: float = 0.1
    drop_rate: float = 0.0


VIDEO_MODEL_CONFIGS = {"ppma_video_tiny": VideoConfig()}


class _FrameWiseAttention(nn.Module):
    """2-D baseline: :class:`PPMAAttention3D` applied to each frame alone (``T = 1`` maps), so no token of one frame
    attends to another frame (its LePE is a 1 x 5 x 5 convolution)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.inner = PPMAAttention3D(dim, num_heads, "full")
        self.inner.lepe = DWConv3d(dim, (1, 5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape[:2]
        return self.inner(x.reshape(B * T, 1, *x.shape[2:])).reshape(x.shape)


class VideoBlock(nn.Module):
    """``x += cpe(x)``; ``x += drop_path(attn(norm1(x)))``; ``x += drop_path(mlp(norm2(x)))`` on ``[B, T, H, W, C]``
    (``cpe``: depthwise 3 x 3 x 3 convolution; 1 x 3 x 3 in the frame-wise baseline)."""

    def __init__(self, dim: int, num_heads: int, *, mlp_ratio: float = 3.0, mixer: str = "full",
                 mask: str = "polyline", frame_wise: bool = False,
                 drop_path: float = 0.0) -> None:
        super().__init__()
        self.cpe = DWConv3d(dim, (1, 3, 3) if frame_wise else (3, 3, 3))
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        if frame_wise:
            self.attn = _FrameWiseAttention(dim, num_heads)
        else:
            self.attn = PPMAAttention3D(dim, num_heads, mixer, mask=mask)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        hidden = int(mlp_ratio * dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.cpe(x)
        x = x + self.drop_path(self.attn(self.norm1(x)))
        return x + self.drop_path(self._mlp(self.norm2(x)))

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        # the MLP's linear layers through ppma.nn.layers.linear (widened under CPU autocast where the CPU has no
        # kernels for its dtype); a replaced or hooked MLP runs as it is
        mlp = self.mlp
        if (type(mlp) is not nn.Sequential or len(mlp) != 3 or any(_has_hooks(m) for m in (mlp, *mlp))
                or not (type(mlp[0]) is nn.Linear and type(mlp[2]) is nn.Linear)):
            return mlp(x)
        return linear(mlp[1](linear(x, mlp[0])), mlp[2])


class _Downsample(nn.Module):
    """Spatial 2 x 2 patch merging (time kept): ``Conv3d(k=(1, 3, 3), stride=(1, 2, 2))`` + LayerNorm."""

    def __init__(self, dim: int, out_dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv3d(dim, out_dim, (1, 3, 3), stride=(1, 2, 2), padding=(0, 1, 1))
        self.norm = nn.LayerNorm(out_dim, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(conv3d(x.permute(0, 4, 1, 2, 3), self.conv).permute(0, 2, 3, 4, 1))


class PPMAVideo(nn.Module):
    """The video backbone (module docstring). ``forward(x)``: ``[B, in_chans, T, H, W]`` -> ``[B, num_classes]``;
    ``T`` must be divisible by ``tubelet[0]`` and ``H, W`` by ``tubelet[1:]`` (else ``ValueError``: nothing is
    dropped silently). Not registered with timm, whose model contract (image-shaped ``pretrained_cfg``,
    ``features_only``, ``forward_intermediates``) a clip model does not meet (docs/video.md)."""

    def __init__(self, cfg: VideoConfig | None = None, **kwargs) -> None:
        super().__init__()
        cfg = dataclasses.replace(cfg or VideoConfig(), **kwargs)
        if isinstance(cfg.mixer, str):  # one string: every stage
            cfg = dataclasses.replace(cfg, mixer=(cfg.mixer,) * 4)
        for name in ("embed_dims", "depths", "num_heads", "mlp_ratios", "mixer"):
            if len(getattr(cfg, name)) != 4:
                raise ValueError(f"PPMAVideo: {name} must have 4 entries, got {getattr(cfg, name)!r}")
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        d0 = cfg.embed_dims[0]
        self.patch_embed = nn.Conv3d(cfg.in_chans, d0, cfg.tubelet, stride=cfg.tubelet)
        self.embed_norm = nn.LayerNorm(d0, eps=1e-6)
        rates = torch.linspace(0, cfg.drop_path_rate, sum(cfg.depths)).tolist()
        self.stages = nn.ModuleList()
        self.downsamples = nn.ModuleList()
        n = 0
        for s in range(4):
            dim = cfg.embed_dims[s]
            self.stages.append(nn.Sequential(*(
                VideoBlock(dim, cfg.num_heads[s], mlp_ratio=cfg.mlp_ratios[s], mixer=cfg.mixer[s],
                           mask=cfg.mask, frame_wise=cfg.frame_wise, drop_path=rates[n + b])
                for b in range(cfg.depths[s]))))
            n += cfg.depths[s]
            self.downsamples.append(_Downsample(dim, cfg.embed_dims[s + 1]) if s < 3 else nn.Identity())
        self.norm = nn.LayerNorm(cfg.embed_dims[-1], eps=1e-6)
        self.head_drop = nn.Dropout(cfg.drop_rate)
        self.head = nn.Linear(cfg.embed_dims[-1], cfg.num_classes) if cfg.num_classes > 0 else nn.Identity()
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    def no_weight_decay(self) -> set[str]:
        return {n for n, _ in self.named_parameters() if n.endswith(("dt_bias", "A_log"))}

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, T, H, W]`` -> the last stage's map ``[B, T', H', W', C']``."""
        if x.dim() != 5 or x.shape[1] != self.cfg.in_chans:
            raise ValueError(f"PPMAVideo: x must be [B, {self.cfg.in_chans}, T, H, W], got shape {tuple(x.shape)}")
        # the tubelet embedding is a strided convolution: it would drop the frames and pixels past the last whole
        # tubelet without a word, so a clip that does not tile is refused (docs/video.md)
        if any(n % t for n, t in zip(x.shape[2:], self.cfg.tubelet)):
            raise ValueError(
                f"PPMAVideo: T, H, W = {tuple(x.shape[2:])} must be multiples of the tubelet {tuple(self.cfg.tubelet)} "
                "(a remainder would be dropped); crop or pad the clip first"
            )
        x = self.embed_norm(conv3d(x, self.patch_embed).permute(0, 2, 3, 4, 1))
        for stage, down in zip(self.stages, self.downsamples):
            x = down(stage(x))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.forward_features(x)).mean(dim=(1, 2, 3))
        return linear(self.head_drop(x), self.head)


_OVERRIDES = {f.name for f in dataclasses.fields(VideoConfig)} - {"num_classes", "drop_path_rate"}


def create_video_model(name: str, pretrained: bool = False, num_classes: int = 400,
                       drop_path_rate: float | None = None, checkpoint_path=None, **overrides) -> PPMAVideo:
    """Build a video model of :data:`VIDEO_MODEL_CONFIGS` (``ppma.create_model`` routes these names here).
    ``overrides``: any :class:`VideoConfig` field. No pretrained weights exist."""
    if name not in VIDEO_MODEL_CONFIGS:
        raise ValueError(f"create_video_model: unknown model {name!r}; available: {sorted(VIDEO_MODEL_CONFIGS)}")
    if pretrained or checkpoint_path is not None:
        raise ValueError(f"create_video_model: {name} has no pretrained weights")
    unknown = set(overrides) - _OVERRIDES
    if unknown:
        raise TypeError(f"create_video_model: unknown arguments {sorted(unknown)}; accepted: {sorted(_OVERRIDES)}")
    cfg = dataclasses.replace(VIDEO_MODEL_CONFIGS[name], num_classes=num_classes, **overrides)
    if drop_path_rate is not None:
        cfg = dataclasses.replace(cfg, drop_path_rate=drop_path_rate)
    return PPMAVideo(cfg)

