"""CPU kernels of the model's other layers (docs/ops.md "CPU helper kernels").

PPMA's own operators live in :mod:`ppma.ops`. These serve the backbone around them on the CPU: the rotary
position embedding (:func:`rope`, :func:`rope_`), LayerNorm with the block's residual sum (:func:`layer_norm`,
:func:`add_layer_norm_`), the per-token log-decays (:func:`path_decay`) and the depthwise convolutions of the
LePE, CPE and FFN (:func:`depthwise_conv2d`, :func:`depthwise_conv2d_residual_`,
:func:`gelu_depthwise_conv2d_residual`). Each runs a fused ``torch.ops.ppma`` CPU kernel where one is built for its
inputs and the same formula in plain torch ops elsewhere (CUDA, other dtypes), so every function works on every
device.
"""

from ppma.ops.cpu.depthwise_conv2d import depthwise_conv2d, depthwise_conv2d_residual_, gelu_depthwise_conv2d_residual
from ppma.ops.cpu.layer_norm import add_layer_norm_, layer_norm
from ppma.ops.cpu.path_decay import path_decay
from ppma.ops.cpu.rope import rope, rope_

__all__ = [
    "rope",
    "rope_",
    "layer_norm",
    "add_layer_norm_",
    "path_decay",
    "depthwise_conv2d",
    "depthwise_conv2d_residual_",
    "gelu_depthwise_conv2d_residual",
]
