# UPerNet + PPMA-T on ADE20K, 512x512 crops, 160k iterations (docs/model.md §6.3), MMSegmentation 1.x.
# Pretrained weights: the official ImageNet checkpoint (classification/PPMA_T_202502251000/best.pth); the backbone
# loads its raw (non-EMA) weights, the `model` or `models` entry, as the official downstream code does.
_base_ = [
    "_base_/upernet_ppma.py",
    "_base_/ade20k.py",
    "_base_/schedule_160k.py",
    "_base_/default_runtime.py",
]

model = dict(
    backbone=dict(
        arch="tiny",
        drop_path_rate=0.1,
        init_cfg=dict(type="Pretrained", checkpoint="../checkpoints/classification/PPMA_T_202502251000/best.pth"),
    ),
    decode_head=dict(in_channels=[64, 128, 256, 512]),
    auxiliary_head=dict(in_channels=256),
)
