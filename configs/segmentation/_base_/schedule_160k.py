# Optimizer and 160k-iteration schedule for the segmentation configs (docs/model.md §6.3), MMSegmentation 1.x.
optim_wrapper = dict(
    type="OptimWrapper",
    optimizer=dict(type="AdamW", lr=6e-5, betas=(0.9, 0.999), weight_decay=0.05),
    # no weight decay on any parameter whose name contains "norm" (LayerNorms, out_norms, downsample BNs)
    paramwise_cfg=dict(custom_keys=dict(norm=dict(decay_mult=0.0))),
)
param_scheduler = [
    dict(type="LinearLR", start_factor=1e-6, by_epoch=False, begin=0, end=1500),
    dict(type="PolyLR", power=1.0, eta_min=0.0, by_epoch=False, begin=1500, end=160000),
]
train_cfg = dict(type="IterBasedTrainLoop", max_iters=160000, val_interval=16000)
val_cfg = dict(type="ValLoop")
test_cfg = dict(type="TestLoop")
