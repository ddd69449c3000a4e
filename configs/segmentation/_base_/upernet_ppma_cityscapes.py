# UPerNet with a PPMA backbone for Cityscapes (docs/model.md §6.3), MMSegmentation 1.x: the model of upernet_ppma.py with
# 19 classes, 1024x1024 crops and a sliding-window test of stride 768. Each variant config sets what depends on
# the PPMA size, as for ADE20K.
_base_ = "upernet_ppma.py"

crop_size = (1024, 1024)
data_preprocessor = dict(size=crop_size)
model = dict(
    data_preprocessor=dict(size=crop_size),
    decode_head=dict(num_classes=19),
    auxiliary_head=dict(num_classes=19),
    test_cfg=dict(mode="slide", crop_size=crop_size, stride=(768, 768)),
)
