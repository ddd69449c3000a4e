# The PPMA-B backbone of the segmentation configs: its width, stochastic depth and the official ImageNet checkpoint
# (classification/PPMA_B_202504101400/best.pth; the backbone loads its raw, non-EMA weights, the `model` or `models`
# entry, as the official downstream code does), and the input widths of the UPerNet and auxiliary heads.
# Leaf configs merge it into their model: `model = {{_base_.ppma_model}}` (a base may define `model` only once).
ppma_model = dict(
    backbone=dict(
        arch="base",
        drop_path_rate=0.4,
        init_cfg=dict(type="Pretrained", checkpoint="../checkpoints/classification/PPMA_B_202504101400/best.pth"),
    ),
    decode_head=dict(in_channels=[80, 160, 320, 512]),
    auxiliary_head=dict(in_channels=320),
)
