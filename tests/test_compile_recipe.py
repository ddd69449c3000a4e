"""``ppma.compile.compile_model`` (docs/compile.md): the compiled model equals the eager one (fp32 tight; bf16
autocast within 2e-2 of the fp32 logits), inference freezes and packs the weights, training compiles without the
frozen wrapper, and the arguments are checked."""

from __future__ import annotations

import pytest
import torch

import ppma
from ppma.compile import FrozenInference, compile_model

pytestmark = pytest.mark.skipif(not ppma.has_ext(), reason="needs the compiled ppma._C ops")

# A small PPMA-T: every stage's mixer (criss-cross, full attention), the stem, patch merging and head.
KW = dict(embed_dims=(16, 32, 32, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 2, 4), num_classes=10)


def _model():
    torch.manual_seed(0)
    return ppma.create_model("ppma_tiny", **KW)


def _images(batch=2, size=64):
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def test_inference_fp32_equals_eager_and_packs_weights():
    from torch._dynamo.utils import counters
    from torch._inductor import config

    torch._dynamo.reset()
    counters.clear()
    model = _model().eval()
    x = _images()
    fast = compile_model(model)
    assert isinstance(fast, FrozenInference) and fast.module is model
    with torch.inference_mode():
        ref = model(x)
        got = fast(x)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fast(_images()), ref, rtol=1e-4, atol=1e-4)  # the cached graph
    # frozen: Inductor packed the linear layers' weights (the point of the recipe), and the global switch is back
    assert counters["inductor"]["mkldnn_linear_weight_pack_matcher_count"] > 0
    assert config.freezing is False


@pytest.mark.full  # one more Inductor compile of the model (minutes on a shared 2-core machine)
def test_inference_bf16_autocast_within_2e2_of_fp32():
    torch._dynamo.reset()
    model = _model().eval()
    x = _images()
    fast = compile_model(model)
    with torch.inference_mode():
        ref = model(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            eager_bf16 = model(x).float()
            got = fast(x).float()
    torch.testing.assert_close(got, ref, rtol=0, atol=2e-2)
    torch.testing.assert_close(got, eager_bf16, rtol=0, atol=2e-2)


def test_arguments_are_checked():
    assert not isinstance(compile_model(_model().train()), FrozenInference)  # lazy: nothing compiles here
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        compile_model(lambda x: x)
    with pytest.raises(ValueError, match=r"model\.eval\(\)"):
        compile_model(_model().train(), inference=True)

