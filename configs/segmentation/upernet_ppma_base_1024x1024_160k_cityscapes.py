# UPerNet + PPMA-B on Cityscapes, 1024x1024 crops, 160k iterations, batch 8 (docs/model.md §6.3), MMSegmentation 1.x.
_base_ = [
    "_base_/upernet_ppma_cityscapes.py",
    "_base_/cityscapes_1024x1024.py",
    "_base_/schedule_160k_cityscapes.py",
    "_base_/default_runtime.py",
    "_base_/ppma_base.py",
]

model = {{_base_.ppma_model}}
