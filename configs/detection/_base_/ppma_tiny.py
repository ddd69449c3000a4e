# The PPMA-T backbone of the detection configs: its width, stochastic depth and the official ImageNet checkpoint
# (classification/PPMA_T_202502251000/best.pth; the backbone loads its raw, non-EMA weights, the `model` or `models`
# entry, as the official downstream code does), and the FPN's input widths.
# Leaf configs merge it into their model: `model = {{_base_.ppma_model}}` (a base may define `model` only once).
ppma_model = dict(
    backbone=dict(
        arch="tiny",
        drop_path_rate=0.1,
        init_cfg=dict(type="Pretrained", checkpoint="../checkpoints/classification/PPMA_T_202502251000/best.pth"),
    ),
    neck=dict(in_channels=[64, 128, 256, 512]),
)
