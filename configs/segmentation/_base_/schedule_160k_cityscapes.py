# The 160k-iteration schedule of schedule_160k.py, evaluated every 4k iterations as the official Cityscapes runs
# (docs/model.md §6.3).
_base_ = "schedule_160k.py"

train_cfg = dict(val_interval=4000)
