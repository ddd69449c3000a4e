# ADE20K data (150 classes), 512x512 training crops, sliding-window and multi-scale test (docs/model.md §6.3),
# MMSegmentation 1.x.
dataset_type = "ADE20KDataset"
data_root = "data/ade/ADEChallengeData2016"
train_pipeline = [
    dict(type="LoadImageFromFile"),
    dict(type="LoadAnnotations", reduce_zero_label=True),
    dict(type="RandomResize", scale=(2048, 512), ratio_range=(0.5, 2.0), keep_ratio=True),
    dict(type="RandomCrop", crop_size=(512, 512), cat_max_ratio=0.75),  # = crop_size in upernet_ppma.py
    dict(type="RandomFlip", prob=0.5),
    dict(type="PhotoMetricDistortion"),
    dict(type="PackSegInputs"),
]
test_pipeline = [
    dict(type="LoadImageFromFile"),
    dict(type="Resize", scale=(2048, 512), keep_ratio=True),
    dict(type="LoadAnnotations", reduce_zero_label=True),
    dict(type="PackSegInputs"),
]
# Multi-scale + flip test (`--tta`; the official 0.x `--aug-test`): MultiScaleFlipAug(img_scale=(2048, 512),
# img_ratios=...) resized every image to fit ratio x (2048, 512), so the scales are given explicitly here.
# (`Resize(scale_factor=r)`, as in MMSegmentation's own 1.x configs, would scale the original image size instead.)
# Each scale is predicted in the model's test mode (sliding 512x512 windows, stride 341).
img_ratios = [0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
tta_pipeline = [
    dict(type="LoadImageFromFile", backend_args=None),
    dict(
        type="TestTimeAug",
        transforms=[
            [dict(type="Resize", scale=(int(2048 * r), int(512 * r)), keep_ratio=True) for r in img_ratios],
            [dict(type="RandomFlip", prob=0.0, direction="horizontal"),
             dict(type="RandomFlip", prob=1.0, direction="horizontal")],
            [dict(type="LoadAnnotations")],
            [dict(type="PackSegInputs")],
        ],
    ),
]
tta_model = dict(type="SegTTAModel")
train_dataloader = dict(
    batch_size=2,  # x 8 GPUs = 16
    num_workers=4,
    persistent_workers=True,
    sampler=dict(type="InfiniteSampler", shuffle=True),
    dataset=dict(
        type=dataset_type,
        data_root=data_root,
        data_prefix=dict(img_path="images/training", seg_map_path="annotations/training"),
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
        data_prefix=dict(img_path="images/validation", seg_map_path="annotations/validation"),
        pipeline=test_pipeline,
    ),
)
test_dataloader = val_dataloader
val_evaluator = dict(type="IoUMetric", iou_metrics=["mIoU"])
test_evaluator = val_evaluator
