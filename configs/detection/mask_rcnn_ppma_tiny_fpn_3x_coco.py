# Mask R-CNN + FPN with PPMA-T on COCO, 3x multi-scale schedule (docs/model.md §6.2), MMDetection 3.x.
_base_ = [
    "_base_/mask_rcnn_ppma_fpn.py",
    "_base_/coco_instance_ms_3x.py",
    "_base_/schedule_3x.py",
    "_base_/default_runtime.py",
    "_base_/ppma_tiny.py",
]

model = {{_base_.ppma_model}}
