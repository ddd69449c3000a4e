"""A small stand-in classifier with ppma.ops attention, used by the training tests until/unless the real
backbone is importable. It is NOT the PPMA model; it only exercises the training machinery."""

import torch
import torch.nn as nn
import torch.nn.functional as F

import ppma.ops


class StandIn(nn.Module):
    def __init__(self, num_classes=10, in_chans=3, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.stem = nn.Sequential(nn.Conv2d(in_chans, dim, 3, 2, 1), nn.BatchNorm2d(dim), nn.GELU(),
                                  nn.Conv2d(dim, dim, 3, 2, 1))
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.decay = nn.Linear(dim, 2 * heads)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(dim, num_classes)

    def no_weight_decay(self):
        return set()

    def forward(self, x):
        x = self.stem(x).permute(0, 2, 3, 1)
        B, H, W, C = x.shape
        h = self.norm(x)
        q, k, v = self.qkv(h).reshape(B, H, W, 3, self.heads, C // self.heads).unbind(3)
        la, lb = (-F.softplus(self.decay(h))).chunk(2, dim=-1)
        y = ppma.ops.criss_cross_attention(q, k, v, la.contiguous(), lb.contiguous())
        x = x + self.proj(y.reshape(B, H, W, C))
        return self.head(self.drop(x.mean((1, 2))))


def create_standin(name, pretrained=False, num_classes=1000, drop_path_rate=None, checkpoint_path=None, **kw):
    return StandIn(num_classes=num_classes, in_chans=kw.get("in_chans", 3))


def test_standin_forward():
    assert create_standin("x", num_classes=5)(torch.randn(2, 3, 16, 16)).shape == (2, 5)
