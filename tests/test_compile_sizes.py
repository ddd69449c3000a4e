"""README "Models": ``torch.compile(model, fullgraph=True, dynamic=True)`` recompiles only for the image sizes the
README names. Counted with dynamo's own frame counter (``torch._dynamo.testing.CompileCounter``): with batch >= 2
one graph serves every image whose sides are both >= 33 px (odd, non-square, far apart); a side <= 32 (a stage-4
map one token wide, and torch's convolution shape guard at 33) compiles one more graph; batch 1 is specialised by
dynamic shapes (a graph of its own)."""

from __future__ import annotations

import torch

import ppma


def test_which_image_sizes_recompile():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ppma.create_model("ppma_tiny", num_classes=10, embed_dims=(8, 16, 16, 16), depths=(1, 1, 1, 1),
                              num_heads=(1, 2, 2, 2)).eval()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True)
    seen = []
    with torch.no_grad():
        for batch, H, W in ((2, 97, 161), (2, 33, 33), (3, 120, 40), (2, 64, 33), (2, 32, 40), (1, 97, 161)):
            x = torch.randn(batch, 3, H, W)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
            seen.append(counter.frame_count)
    torch._dynamo.reset()
    # sides >= 33, batch >= 2: one graph; a side of 32: a second; batch 1: a third
    assert seen == [1, 1, 1, 1, 2, 3], seen
