# Mask R-CNN + FPN with PPMA-B on COCO, 1x schedule (docs/model.md §6.2), MMDetection 3.x.
# Pretrained weights: the official ImageNet checkpoint (classification/PPMA_B_202504101400/best.pth); the backbone
# loads its raw (non-EMA) weights, the `model` or `models` entry, as the official downstream code does.
_base_ = [
    "_base_/mask_rcnn_ppma_fpn.py",
    "_base_/coco_instance.py",
    "_base_/schedule_1x.py",
    "_base_/default_runtime.py",
]

model = dict(
    backbone=dict(
        arch="base",
        drop_path_rate=0.4,
        init_cfg=dict(type="Pretrained", checkpoint="../checkpoints/classification/PPMA_B_202504101400/best.pth"),
    ),
    neck=dict(in_channels=[80, 160, 320, 512]),
)
