# Mask R-CNN + FPN with PPMA-S on COCO, 3x multi-scale schedule (docs/model.md §6.2), MMDetection 3.x.
# Pretrained weights: the official ImageNet checkpoint (classification/PPMA_S_202504021000/best.pth); the backbone
# loads its raw (non-EMA) weights, the `model` or `models` entry, as the official downstream code does.
_base_ = [
    "_base_/mask_rcnn_ppma_fpn.py",
    "_base_/coco_instance_ms_3x.py",
    "_base_/schedule_3x.py",
    "_base_/default_runtime.py",
]

model = dict(
    backbone=dict(
        arch="small",
        drop_path_rate=0.15,
        init_cfg=dict(type="Pretrained", checkpoint="../checkpoints/classification/PPMA_S_202504021000/best.pth"),
    ),
    neck=dict(in_channels=[64, 128, 256, 512]),
)
