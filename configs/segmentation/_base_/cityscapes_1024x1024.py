# Cityscapes data (19 classes), 1024x1024 training crops, sliding-window test at (2048, 1024) (docs/model.md §6.3),
# MMSegmentation 1.x. Layout: leftImg8bit/{train,val}/<city>/*_leftImg8bit.png and
# gtFine/{train,val}/<city>/*_gtFine_labelTrainIds.png (cityscapesscripts' createTrainIdLabelImgs).
# The official 0.x configs wrapped the training set in RepeatDataset(times=500) to make long epochs; here the
# InfiniteSampler of the iteration-based loop draws the same stream without it.
dataset_type = "CityscapesDataset"
data_root = "data/cityscapes/"
train_pipeline = [
    dict(type="LoadImageFromFile"),
    dict(type="LoadAnnotations"),
    dict(type="RandomResize", scale=(2048, 1024), ratio_range=(0.5, 2.0), keep_ratio=True),
    dict(type="RandomCrop", crop_size=(1024, 1024), cat_max_ratio=0.75),  # = crop_size in upernet_ppma_cityscapes.py
    dict(type="RandomFlip", prob=0.5),
    dict(type="PhotoMetricDistortion"),
    dict(type="PackSegInputs"),
]
test_pipeline = [
    dict(type="LoadImageFromFile"),
    dict(type="Resize", scale=(2048, 1024), keep_ratio=True),
    dict(type="LoadAnnotations"),
    dict(type="PackSegInputs"),
]
train_dataloader = dict(
    batch_size=1,  # x 8 GPUs = 8
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type="InfiniteSampler", shuffle=True),
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(img_path="leftImg8bit/train", seg_map_path="gtFine/train"),
        pipeline=train_pipeline,
    ),
)
val_dataloader = dict(
    batch_size=1,
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type="DefaultSampler", shuffle=False),
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(img_path="leftImg8bit/val", seg_map_path="gtFine/val"),
        pipeline=test_pipeline,
    ),
)
test_dataloader = val_dataloader
val_evaluator = dict(type="IoUMetric", iou_metrics=["mIoU"])
test_evaluator = val_evaluator
