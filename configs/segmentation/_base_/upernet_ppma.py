# UPerNet with a PPMA backbone, 512x512 crops (docs/model.md §6.3), MMSegmentation 1.x: the model shared by every
# segmentation config. The backbone is registered by `ppma.models.mm`. Each variant config sets what depends on
# the PPMA size: model.backbone.arch, .drop_path_rate, .init_cfg (the official ImageNet checkpoint),
# model.decode_head.in_channels (the four stage dims) and model.auxiliary_head.in_channels (the third).
custom_imports = dict(imports=["ppma.models.mm"], allow_failed_imports=False)

crop_size = (512, 512)
norm_cfg = dict(type="SyncBN", requires_grad=True)
data_preprocessor = dict(
    type="SegDataPreProcessor",
    mean=[123.675, 116.28, 103.53],
    std=[58.395, 57.12, 57.375],
    bgr_to_rgb=True,
    pad_val=0,
    seg_pad_val=255,
    size=crop_size,
)
model = dict(
    type="EncoderDecoder",
    data_preprocessor=data_preprocessor,
    pretrained=None,
    backbone=dict(type="PPMA", out_indices=(0, 1, 2, 3)),  # + arch, drop_path_rate, init_cfg per variant
    decode_head=dict(
        type="UPerHead",  # + in_channels (the PPMA stage dims) per variant
        in_index=[0, 1, 2, 3],
        pool_scales=(1, 2, 3, 6),
        channels=512,
        dropout_ratio=0.1,
        num_classes=150,
        norm_cfg=norm_cfg,
        align_corners=False,
        loss_decode=dict(type="CrossEntropyLoss", use_sigmoid=False, loss_weight=1.0),
    ),
    auxiliary_head=dict(
        type="FCNHead",  # + in_channels (the PPMA stage-3 dim) per variant
        in_index=2,
        channels=256,
        num_convs=1,
        concat_input=False,
        dropout_ratio=0.1,
        num_classes=150,
        norm_cfg=norm_cfg,
        align_corners=False,
        loss_decode=dict(type="CrossEntropyLoss", use_sigmoid=False, loss_weight=0.4),
    ),
    train_cfg=dict(),
    test_cfg=dict(mode="slide", crop_size=crop_size, stride=(341, 341)),
)
