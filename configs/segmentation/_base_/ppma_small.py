# The PPMA-S backbone of the segmentation configs: its width, stochastic depth and the official ImageNet checkpoint
# (classification/PPMA_S_202504021000/best.pth; the backbone loads its raw, non-EMA weights, the `model` or `models`
# entry, as the official downstream code does), and the input widths of the UPerNet and auxiliary heads.
# Leaf configs merge it into their model: `model = {{_base_.ppma_model}}` (a base may define `model` only once).
ppma_model = dict(
    backbone=dict(
        arch="small",
        drop_path_rate=0.15,
        init_cfg=dict(type="Pretrained", checkpoint="../checkpoints/classification/PPMA_S_202504021000/best.pth"),
    ),
    decode_head=dict(in_channels=[64, 128, 256, 512]),
    auxiliary_head=dict(in_channels=256),
)
