# UPerNet + PPMA-B on Cityscapes, 1024x1024 crops, 160k iterations, batch 8 (docs/model.md §6.3), MMSegmentation 1.x.
# Pretrained weights: the official ImageNet checkpoint (classification/PPMA_B_202504101400/best.pth); the backbone
# loads its raw (non-EMA) weights, the `model` or `models` entry, as the official downstream code does.
_base_ = [
    "_base_/upernet_ppma_cityscapes.py",
    "_base_/cityscapes_1024x1024.py",
    "_base_/schedule_160k_cityscapes.py",
    "_base_/default_runtime.py",
]

model = dict(
    backbone=dict(
        arch="base",
        drop_path_rate=0.4,
        init_cfg=dict(type="Pretrained", checkpoint="../checkpoints/classification/PPMA_B_202504101400/best.pth"),
    ),
    decode_head=dict(in_channels=[80, 160, 320, 512]),
    auxiliary_head=dict(in_channels=320),
)
