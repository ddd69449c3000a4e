# COCO 2017 instance segmentation data with the 3x multi-scale training pipeline (docs/model.md §6.2), MMDetection 3.x:
# the 1x data (coco_instance.py) with another train pipeline.
_base_ = "coco_instance.py"

# multi-scale DETR-style augmentation: resize the short side to 480..800, or resize, crop and resize
_scales = [(1333, s) for s in range(480, 801, 32)]
train_pipeline = [
    dict(type="LoadImageFromFile", backend_args={{_base_.backend_args}}),
    dict(type="LoadAnnotations", with_bbox=True, with_mask=True),
    dict(type="RandomFlip", prob=0.5),
    dict(
        type="RandomChoice",
        transforms=[
            [dict(type="RandomChoiceResize", scales=_scales, keep_ratio=True)],
            [
                dict(type="RandomChoiceResize", scales=[(400, 1333), (500, 1333), (600, 1333)], keep_ratio=True),
                dict(type="RandomCrop", crop_type="absolute_range", crop_size=(384, 600), allow_negative_crop=True),
                dict(type="RandomChoiceResize", scales=_scales, keep_ratio=True),
            ],
        ],
    ),
    dict(type="PackDetInputs"),
]
train_dataloader = dict(dataset=dict(pipeline=train_pipeline))
