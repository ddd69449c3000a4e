"""``moving_digits``: a video classification task whose label is the motion (for the 3-D models of
``ppma.models.video``; configs/video/demo_moving_digits.yaml).

Each clip is ``[1, frames, canvas, canvas]``: one of scikit-learn's bundled 8x8 digits (the same split as the
``digits`` dataset of ``ppma.train.data``), upsampled to 16x16, moving in a straight line across a blank canvas at
2 or 3 pixels per frame. The label is the direction, one of ``DIRECTIONS`` (right, left, down, up). The trajectory is
centred on a random point (its mean position does not depend on the direction), so the unordered set of frames of a
clip moving right has the same distribution as one moving left: a model that looks at frames one by one and pools
them without order cannot beat 50 %; the direction needs motion across frames.

Clips are made on the fly and are a function of ``(seed, index)`` only (no state, no files): the same index gives
the same clip in every epoch, process and worker.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

__all__ = ["MovingDigits", "build_moving_digits", "DIRECTIONS"]

DIRECTIONS = ("right", "left", "down", "up")
_STEPS = ((0, 1), (0, -1), (1, 0), (-1, 0))  # (di, dj) per frame, per direction


class MovingDigits(Dataset):
    """``len(images) * clips_per_image`` clips of the digit ``images`` ``[n, s, s]`` (values in ``[0, 1]``).

    ``__getitem__(idx)`` -> ``(clip [1, frames, canvas, canvas] float32 in [-1, 1] (blank = -1), direction)``."""

    def __init__(self, images: torch.Tensor, clips_per_image: int, *, frames: int = 8, canvas: int = 48,
                 seed: int = 0) -> None:
        if images.dim() != 3:
            raise ValueError(f"MovingDigits: images must be [n, s, s], got shape {tuple(images.shape)}")
        self.images, self.clips_per_image = images, clips_per_image
        self.frames, self.canvas, self.seed = frames, canvas, seed
        s = images.shape[-1]
        if s + 3 * (frames - 1) > canvas:
            raise ValueError(f"MovingDigits: a {s}px digit moving {3 * (frames - 1)}px does not fit a {canvas}px canvas")
        self.classes = list(DIRECTIONS)
        self.targets = [self._draw(i)[0] for i in range(len(self))]

    def __len__(self) -> int:
        return len(self.images) * self.clips_per_image

    def _draw(self, idx: int):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        direction = int(torch.randint(4, (1,), generator=g))
        speed = int(torch.randint(2, 4, (1,), generator=g))
        s, F_, C = self.images.shape[-1], self.frames, self.canvas
        travel = speed * (F_ - 1)
        di, dj = _STEPS[direction]
        # Centre of the path: uniform over the positions where the whole path fits, along both axes, with the
        # same range whatever the direction (the path is symmetric about its centre).
        lo, hi = s / 2 + travel / 2, C - s / 2 - travel / 2
        ci = lo + (hi - lo) * float(torch.rand((), generator=g))
        cj = lo + (hi - lo) * float(torch.rand((), generator=g))
        return direction, speed, di, dj, ci, cj

    def __getitem__(self, idx: int):
        direction, speed, di, dj, ci, cj = self._draw(idx)
        img = self.images[idx % len(self.images)]
        s, C = img.shape[-1], self.canvas
        clip = torch.zeros(self.frames, C, C)
        for f in range(self.frames):
            off = (f - (self.frames - 1) / 2) * speed
            i0 = int(round(ci + di * off - s / 2))
            j0 = int(round(cj + dj * off - s / 2))
            clip[f, i0 : i0 + s, j0 : j0 + s] = img
        return (clip * 2 - 1)[None], direction


def build_moving_digits(canvas: int = 48, test_size: float = 0.2, seed: int = 0, *, frames: int = 8,
                        train_clips_per_image: int = 3, test_clips_per_image: int = 2):
    """``(train, test)`` :class:`MovingDigits` from the stratified split of scikit-learn's digits that the
    ``digits`` dataset uses (``test_size``, ``seed``): 1437 train digits x 3 clips, 360 test digits x 2 clips."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    images = torch.tensor(d.images, dtype=torch.float32) / 16.0
    idx_train, idx_test = train_test_split(range(len(images)), test_size=test_size, random_state=seed,
                                           stratify=d.target)
    up = F.interpolate(images[:, None], size=(16, 16), mode="bilinear", align_corners=False)[:, 0].clamp(0, 1)
    train = MovingDigits(up[list(idx_train)], train_clips_per_image, frames=frames, canvas=canvas, seed=seed)
    test = MovingDigits(up[list(idx_test)], test_clips_per_image, frames=frames, canvas=canvas, seed=seed + 1)
    return train, test
