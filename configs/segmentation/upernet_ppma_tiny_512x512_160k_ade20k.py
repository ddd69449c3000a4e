# UPerNet + PPMA-T on ADE20K, 512x512 crops, 160k iterations (docs/model.md §6.3), MMSegmentation 1.x.
_base_ = [
    "_base_/upernet_ppma.py",
    "_base_/ade20k.py",
    "_base_/schedule_160k.py",
    "_base_/default_runtime.py",
    "_base_/ppma_tiny.py",
]

model = {{_base_.ppma_model}}
