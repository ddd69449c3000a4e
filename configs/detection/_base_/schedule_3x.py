# 3x schedule (36 epochs, LR steps at epochs 27 and 33) for the detection configs (docs/model.md §6.2), MMDetection 3.x:
# the 1x schedule's optimizer and warm-up, trained three times as long.
_base_ = "schedule_1x.py"

max_epochs = 36
param_scheduler = [
    dict(type="LinearLR", start_factor=0.001, by_epoch=False, begin=0, end=500),
    dict(type="MultiStepLR", begin=0, end=max_epochs, by_epoch=True, milestones=[27, 33], gamma=0.1),
]
train_cfg = dict(max_epochs=max_epochs)
