"""An independent, literal re-statement of the official PPMA classification model (docs/model.md §1.4-§1.6, §3, §4,
module names of §5.1), used as a parity oracle for ``ppma.models``. It imports nothing from ``ppma``.

It follows the official formulation step by step: the decay module builds the 1-D log-masks with
cumsum/tril/triu (``generate_structed_mask_1d``, the cumsum *including* the first decay), "whole" mode
expands them to the dense (B, heads, N, N) V2H mask through a 6-D repeat/permute, "chunk" mode runs
two masked softmaxes and four matmuls with values, RoPE is ``x * cos + rotate_every_two(x) * sin`` with
``k`` pre-scaled by ``d ** -0.5``, and downsampling sits at the end of stages 0-2.
This is not the official code (which is not part of this project); it is written from docs/model.md.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rotate_every_two(x):
    x1 = x[:, :, :, :, ::2]
    x2 = x[:, :, :, :, 1::2]
    x = torch.stack([-x2, x1], dim=-1)
    return x.flatten(-2)


def theta_shift(x, sin, cos):
    return (x * cos) + (rotate_every_two(x) * sin)


class DWConv2d(nn.Module):
    def __init__(self, dim, kernel_size, stride, padding):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, kernel_size, stride, padding, groups=dim)

    def forward(self, x):  # (b h w c)
        x = x.permute(0, 3, 1, 2)
        x = self.conv(x)
        return x.permute(0, 2, 3, 1)


class RotaryPositionEmbedding2D(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        angle = 1.0 / (10000 ** torch.linspace(0, 1, embed_dim // num_heads // 2))
        angle = angle.unsqueeze(-1).repeat(1, 2).flatten()
        self.register_buffer("angle", angle)

    def forward(self, slen):
        index = torch.arange(slen[0] * slen[1]).to(self.angle)
        sin = torch.sin(index[:, None] * self.angle[None, :])
        sin = sin.reshape(slen[0], slen[1], -1)
        cos = torch.cos(index[:, None] * self.angle[None, :])
        cos = cos.reshape(slen[0], slen[1], -1)
        return (sin, cos)


def generate_structed_mask_1d(x):
    """x (..., n) log-decays -> (..., n, n) symmetric segment-sum log-mask."""
    n = x.shape[-1]
    x_cumsum = torch.cumsum(x, dim=-1)
    x_segsum = x_cumsum[..., :, None] - x_cumsum[..., None, :]  # Cs_i - Cs_j
    mask_tril = torch.tril(torch.ones(n, n, device=x.device, dtype=torch.bool), diagonal=0)
    x_tril = x_segsum.masked_fill(~mask_tril, 0)  # i >= j: Cs_i - Cs_j
    x_triu = torch.triu(-x_segsum, diagonal=1)  # j > i: Cs_j - Cs_i
    return x_tril + x_triu


class PathEmbeding2D(nn.Module):
    def __init__(self, embed_dim, num_heads, mode, A_init_range=(1, 1.1), dt_min=0.001, dt_max=0.1,
                 dt_init_floor=1e-4):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.mode = mode
        self.dt_linear = nn.Linear(self.head_dim, 2, bias=False)
        dt = torch.exp(torch.rand(num_heads) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = torch.clamp(dt, min=dt_init_floor)
        inv_dt = dt + torch.log(-torch.expm1(-dt))
        self.dt_bias = nn.Parameter(inv_dt)
        A = torch.empty(num_heads).uniform_(*A_init_range)
        self.A_log = nn.Parameter(torch.log(A))

    def forward(self, x):
        B, H, W, C = x.shape
        x_h = x.view(B, H * W, self.num_heads, self.head_dim)
        u = self.dt_linear(x_h)  # (B, N, nh, 2)
        A = -torch.exp(self.A_log)
        d_alpha = F.softplus(u[..., 0] + self.dt_bias) * A  # (B, N, nh)
        d_beta = F.softplus(u[..., 1] + self.dt_bias) * A
        d_alpha = d_alpha.view(B, H, W, self.num_heads)
        d_beta = d_beta.view(B, H, W, self.num_heads)
        structed_mask_w = generate_structed_mask_1d(d_alpha.permute(0, 1, 3, 2))  # (B, H, nh, W, W)
        structed_mask_h = generate_structed_mask_1d(d_beta.permute(0, 2, 3, 1))  # (B, W, nh, H, H)
        if self.mode == "chunk":
            return structed_mask_w, structed_mask_h
        # whole: dense V2H mask via a 6-D (B, nh, H, H, W, W) tensor [b, g, i, k, j, l]
        mask_w = structed_mask_w.permute(0, 2, 1, 3, 4).unsqueeze(3).repeat(1, 1, 1, H, 1, 1)
        mask_h = structed_mask_h.permute(0, 2, 3, 4, 1).unsqueeze(4).repeat(1, 1, 1, 1, W, 1)
        mask = (mask_w + mask_h).permute(0, 1, 2, 4, 3, 5)  # [b, g, i, j, k, l]
        return mask.reshape(B, self.num_heads, H * W, H * W)


class _Attention(nn.Module):
    mode = None

    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.key_dim = self.head_dim
        self.scaling = self.key_dim ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.lepe = DWConv2d(embed_dim, 5, 1, 2)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.path_embed = PathEmbeding2D(embed_dim, num_heads, self.mode)

    def _qkv(self, x, rel_pos):
        bsz, h, w, _ = x.size()
        sin, cos = rel_pos
        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)
        lepe = self.lepe(v)
        k = k * self.scaling
        q = q.view(bsz, h, w, self.num_heads, -1).permute(0, 3, 1, 2, 4)  # (b nh h w d)
        k = k.view(bsz, h, w, self.num_heads, -1).permute(0, 3, 1, 2, 4)
        qr = theta_shift(q, sin, cos)
        kr = theta_shift(k, sin, cos)
        v = v.view(bsz, h, w, self.num_heads, -1).permute(0, 3, 1, 2, 4)
        return qr, kr, v, lepe


class MambaAttentionAllDouble(_Attention):
    mode = "whole"

    def forward(self, x, rel_pos):
        bsz, h, w, _ = x.size()
        qr, kr, v, lepe = self._qkv(x, rel_pos)
        mask = self.path_embed(x)  # (b nh N N)
        qr = qr.flatten(2, 3)
        kr = kr.flatten(2, 3)
        vr = v.flatten(2, 3)
        qk_mat = qr @ kr.transpose(-1, -2)
        attn = 0.5 * torch.softmax(qk_mat + mask, -1) + 0.5 * torch.softmax(qk_mat + mask.transpose(-1, -2), -1)
        output = torch.matmul(attn, vr)  # (b nh N d)
        output = output.transpose(1, 2).reshape(bsz, h, w, -1)
        return self.out_proj(output + lepe)


class MambaAttentionChunkDouble(_Attention):
    mode = "chunk"

    def forward(self, x, rel_pos):
        bsz, h, w, _ = x.size()
        qr, kr, v, lepe = self._qkv(x, rel_pos)
        mask_w, mask_h = self.path_embed(x)
        qr_w = qr.transpose(1, 2)  # (b h nh w d)
        kr_w = kr.transpose(1, 2)
        qk_mat_w = qr_w @ kr_w.transpose(-1, -2) + mask_w  # (b h nh w w)
        qk_mat_w = torch.softmax(qk_mat_w, -1)
        qr_h = qr.permute(0, 3, 1, 2, 4)  # (b w nh h d)
        kr_h = kr.permute(0, 3, 1, 2, 4)
        qk_mat_h = qr_h @ kr_h.transpose(-1, -2) + mask_h  # (b w nh h h)
        qk_mat_h = torch.softmax(qk_mat_h, -1)
        # rows first, then columns (H2V)
        v_w = v.transpose(1, 2)  # (b h nh w d)
        output = torch.matmul(qk_mat_w, v_w)  # (b h nh w d)
        output = output.permute(0, 3, 2, 1, 4)  # (b w nh h d)
        output = torch.matmul(qk_mat_h, output)  # (b w nh h d)
        output = output.permute(0, 3, 1, 2, 4)  # (b h w nh d)
        # columns first, then rows (V2H)
        v_h = v.permute(0, 3, 1, 2, 4)  # (b w nh h d)
        v_h = torch.matmul(qk_mat_h, v_h)  # (b w nh h d)
        v_h = v_h.permute(0, 3, 2, 1, 4)  # (b h nh w d)
        v_h = torch.matmul(qk_mat_w, v_h)  # (b h nh w d)
        v_h = v_h.permute(0, 1, 3, 2, 4)  # (b h w nh d)
        output = 0.5 * output + 0.5 * v_h
        output = output.reshape(bsz, h, w, -1)
        return self.out_proj(output + lepe)


class FeedForwardNetwork(nn.Module):
    def __init__(self, embed_dim, ffn_dim):
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.dwconv = DWConv2d(ffn_dim, 3, 1, 1)

    def forward(self, x):
        x = F.gelu(self.fc1(x))
        residual = x
        x = self.dwconv(x)
        x = x + residual
        return self.fc2(x)


class BasicBlock(nn.Module):
    def __init__(self, retention, embed_dim, num_heads, ffn_dim, drop_path=0.0, layerscale=False,
                 layer_init_values=1e-5):
        super().__init__()
        self.layerscale = layerscale
        self.retention_layer_norm = nn.LayerNorm(embed_dim, eps=1e-6)
        if retention == "chunk":
            self.retention = MambaAttentionChunkDouble(embed_dim, num_heads)
        else:
            self.retention = MambaAttentionAllDouble(embed_dim, num_heads)
        self.drop_path_rate = drop_path
        self.final_layer_norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.ffn = FeedForwardNetwork(embed_dim, ffn_dim)
        self.pos = DWConv2d(embed_dim, 3, 1, 1)
        if layerscale:
            self.gamma_1 = nn.Parameter(layer_init_values * torch.ones(1, 1, 1, embed_dim), requires_grad=True)
            self.gamma_2 = nn.Parameter(layer_init_values * torch.ones(1, 1, 1, embed_dim), requires_grad=True)

    def forward(self, x, rel_pos):
        x = x + self.pos(x)
        if self.layerscale:
            x = x + self.gamma_1 * self.retention(self.retention_layer_norm(x), rel_pos)
            x = x + self.gamma_2 * self.ffn(self.final_layer_norm(x))
        else:
            x = x + self.retention(self.retention_layer_norm(x), rel_pos)
            x = x + self.ffn(self.final_layer_norm(x))
        return x


class PatchMerging(nn.Module):
    def __init__(self, dim, out_dim):
        super().__init__()
        self.reduction = nn.Conv2d(dim, out_dim, 3, 2, 1)
        self.norm = nn.BatchNorm2d(out_dim)

    def forward(self, x):
        x = self.reduction(x.permute(0, 3, 1, 2))
        return self.norm(x).permute(0, 2, 3, 1)


class BasicLayer(nn.Module):
    def __init__(self, embed_dim, out_dim, depth, num_heads, ffn_dim, chunkwise, downsample, layerscale,
                 layer_init_values):
        super().__init__()
        retention = "chunk" if chunkwise else "whole"
        self.Relpos = RotaryPositionEmbedding2D(embed_dim, num_heads)
        self.blocks = nn.ModuleList(
            [BasicBlock(retention, embed_dim, num_heads, ffn_dim, 0.0, layerscale, layer_init_values)
             for _ in range(depth)]
        )
        self.downsample = PatchMerging(embed_dim, out_dim) if downsample else None

    def forward(self, x):
        _, h, w, _ = x.size()
        rel_pos = self.Relpos((h, w))
        for blk in self.blocks:
            x = blk(x, rel_pos)
        if self.downsample is not None:
            x = self.downsample(x)
        return x


class PatchEmbed(nn.Module):
    def __init__(self, in_chans, embed_dim):
        super().__init__()
        self.proj = nn.Sequential(
            nn.Conv2d(in_chans, embed_dim // 2, 3, 2, 1), nn.BatchNorm2d(embed_dim // 2), nn.GELU(),
            nn.Conv2d(embed_dim // 2, embed_dim // 2, 3, 1, 1), nn.BatchNorm2d(embed_dim // 2), nn.GELU(),
            nn.Conv2d(embed_dim // 2, embed_dim, 3, 2, 1), nn.BatchNorm2d(embed_dim), nn.GELU(),
            nn.Conv2d(embed_dim, embed_dim, 3, 1, 1), nn.BatchNorm2d(embed_dim),
        )

    def forward(self, x):
        return self.proj(x).permute(0, 2, 3, 1)


class PPMAViT(nn.Module):
    def __init__(self, in_chans=3, num_classes=1000, embed_dims=(64, 128, 256, 512), depths=(2, 2, 8, 2),
                 num_heads=(4, 4, 8, 16), mlp_ratios=(3, 3, 3, 3), chunkwise_recurrents=(True, True, False, False),
                 layerscales=(False, False, False, False), layer_init_values=1e-6, projection=1024):
        super().__init__()
        self.patch_embed = PatchEmbed(in_chans, embed_dims[0])
        self.layers = nn.ModuleList()
        for i in range(4):
            self.layers.append(BasicLayer(
                embed_dim=embed_dims[i],
                out_dim=embed_dims[i + 1] if i < 3 else None,
                depth=depths[i], num_heads=num_heads[i], ffn_dim=int(mlp_ratios[i] * embed_dims[i]),
                chunkwise=chunkwise_recurrents[i], downsample=i < 3, layerscale=layerscales[i],
                layer_init_values=layer_init_values))
        self.proj = nn.Linear(embed_dims[-1], projection)
        self.norm = nn.BatchNorm2d(projection)
        self.avgpool = nn.AdaptiveAvgPool1d(1)
        self.head = nn.Linear(projection, num_classes) if num_classes > 0 else nn.Identity()

    def forward(self, x):
        x = self.patch_embed(x)
        for layer in self.layers:
            x = layer(x)
        x = self.proj(x)  # (b h w c)
        x = self.norm(x.permute(0, 3, 1, 2)).flatten(2)  # (b c h*w)
        x = x * torch.sigmoid(x)  # swish
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.head(x)


OFFICIAL_VARIANTS = {
    "ppma_tiny": dict(),
    "ppma_small": dict(depths=(3, 4, 18, 4), mlp_ratios=(4, 4, 3, 3), chunkwise_recurrents=(True, True, True, False)),
    "ppma_base": dict(embed_dims=(80, 160, 320, 512), depths=(4, 8, 25, 8), num_heads=(5, 5, 10, 16),
                      mlp_ratios=(4, 4, 3, 3), chunkwise_recurrents=(True, True, True, False),
                      layerscales=(False, False, True, True), layer_init_values=1e-6),
}
