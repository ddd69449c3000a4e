# Optimizer and 1x schedule (12 epochs) for the detection configs (docs/model.md §6.2), MMDetection 3.x.
optim_wrapper = dict(
    type="OptimWrapper",
    optimizer=dict(type="AdamW", lr=1e-4, betas=(0.9, 0.999), weight_decay=0.05),
    # no weight decay on any parameter whose name contains "norm" (LayerNorms, out_norms, downsample BNs)
    paramwise_cfg=dict(custom_keys=dict(norm=dict(decay_mult=0.0))),
)
max_epochs = 12
param_scheduler = [
    dict(type="LinearLR", start_factor=0.001, by_epoch=False, begin=0, end=500),
    dict(type="MultiStepLR", begin=0, end=max_epochs, by_epoch=True, milestones=[8, 11], gamma=0.1),
]
train_cfg = dict(type="EpochBasedTrainLoop", max_epochs=max_epochs, val_interval=1)
val_cfg = dict(type="ValLoop")
test_cfg = dict(type="TestLoop")
auto_scale_lr = dict(enable=False, base_batch_size=16)
