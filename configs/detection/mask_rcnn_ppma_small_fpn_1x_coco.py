# Mask R-CNN + FPN with PPMA-S on COCO, 1x schedule (docs/model.md §6.2), MMDetection 3.x.
_base_ = [
    "_base_/mask_rcnn_ppma_fpn.py",
    "_base_/coco_instance.py",
    "_base_/schedule_1x.py",
    "_base_/default_runtime.py",
    "_base_/ppma_small.py",
]

model = {{_base_.ppma_model}}
