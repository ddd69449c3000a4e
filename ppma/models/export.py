"""Export PPMA models: ``torch.export`` (fused or reference ops) and ONNX (reference ops), checked with onnxruntime.

- ``torch.export``: the fused operators are registered torch ops with fake (meta) implementations, so an
  :class:`~torch.export.ExportedProgram` keeps them as ``torch.ops.ppma.*`` nodes (running it needs ppma
  imported); with ``impl="reference"`` the program holds only ATen ops.
- ONNX has no ``ppma`` operators, so :func:`export_onnx` always traces the pure-PyTorch reference ops (the same
  numbers, docs/model.md §1.6: dense masks per stage, so memory grows with the square of the tokens). The image size is
  fixed at export (the reference ops specialise on it); the batch size can stay dynamic.

Needs the ``export`` extra for ONNX: ``pip install onnx onnxscript onnxruntime``.

    python -m ppma.models.export --model ppma_tiny --pretrained --img-size 224 --output ppma_tiny.onnx
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

import torch

import ppma.ops as ops

__all__ = ["export_program", "export_onnx", "check_onnx"]


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    training = model.training
    model.eval()  # BatchNorm with running statistics, no drop path: the inference graph
    try:
        yield model
    finally:
        model.train(training)


def _batch_dim(dynamic_batch: bool, max_batch: int = 1024):
    return ({0: torch.export.Dim("batch", min=1, max=max_batch)},) if dynamic_batch else None


def export_program(
    model: torch.nn.Module, example_input: torch.Tensor, impl: str = "fused", dynamic_batch: bool = False
) -> torch.export.ExportedProgram:
    """``torch.export.export`` of ``model`` in eval mode.

    Args:
        model: a :class:`~ppma.models.PPMA` (any variant or configuration).
        example_input: ``[B, in_chans, H, W]``.
        impl: ``"fused"`` keeps the ``torch.ops.ppma.*`` operators in the graph; ``"reference"`` traces the
            pure-PyTorch ops instead (a program without ppma operators). Set for the export only
            (``ppma.ops.use_impl``); the previous choice is restored.
        dynamic_batch: export the batch size as a dynamic dimension (1..1024; ``example_input`` needs ``B >= 2``).
    """
    if impl not in ("fused", "reference"):
        raise ValueError(f"export_program: impl must be 'fused' or 'reference', got {impl!r}")
    with _eval_mode(model), ops.use_impl(impl):
        return torch.export.export(model, (example_input,), dynamic_shapes=_batch_dim(dynamic_batch))


def export_onnx(
    model: torch.nn.Module,
    path: str | os.PathLike,
    example_input: torch.Tensor | None = None,
    img_size: int | tuple[int, int] = 224,
    dynamic_batch: bool = True,
    opset_version: int | None = None,
) -> str:
    """Export ``model`` (eval mode, reference ops) to an ONNX file through ``torch.onnx.export(dynamo=True)``.

    Args:
        model: a :class:`~ppma.models.PPMA`.
        path: output ``.onnx`` file.
        example_input: ``[B, in_chans, H, W]``; default two random ``img_size`` images. With a dynamic batch,
            ``B`` must be at least 2 (``torch.export`` specialises size-1 dimensions).
        img_size: the (fixed) image size when no ``example_input`` is given.
        dynamic_batch: keep the batch size dynamic in the ONNX graph.
        opset_version: ONNX opset (default: the exporter's).

    Returns:
        ``path`` as a string. Input name ``"images"``, output name ``"logits"`` (or the features of a headless model).
    """
    if example_input is None:
        h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
        example_input = torch.randn(2, model.cfg.in_chans, h, w)
    path = os.fspath(path)
    kwargs = {} if opset_version is None else {"opset_version": opset_version}
    with _eval_mode(model), ops.use_impl("reference"):
        torch.onnx.export(model, (example_input,), path, dynamo=True, input_names=["images"],
                          output_names=["logits"], dynamic_shapes=_batch_dim(dynamic_batch), **kwargs)
    return path


def check_onnx(path: str | os.PathLike, model: torch.nn.Module, x: torch.Tensor) -> float:
    """Run the ONNX file with onnxruntime (CPU) on ``x`` and return the relative error
    ``||onnx - torch|| / ||torch||`` against ``model`` (eval mode, its current ops)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(os.fspath(path), providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {session.get_inputs()[0].name: x.detach().cpu().numpy()})
    with _eval_mode(model), torch.no_grad():
        want = model(x)
    got = torch.from_numpy(got).to(want.dtype)
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    """``python -m ppma.models.export``: write a PPMA model as ONNX (and optionally a torch.export program)."""
    from ppma.models import create_model, list_models

    parser = argparse.ArgumentParser(prog="python -m ppma.models.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="ppma_tiny", choices=list_models())
    parser.add_argument("--pretrained", action="store_true", help="the official ImageNet weights (Hugging Face hub)")
    parser.add_argument("--checkpoint", default=None, help="a checkpoint file (official or ppma) instead")
    parser.add_argument("--img-size", type=int, default=224)
    parser.add_argument("--output", required=True, help="the .onnx file; a .pt2 file next to it with --program")
    parser.add_argument("--program", action="store_true", help="also save a torch.export program (fused ops)")
    args = parser.parse_args(argv)

    model = create_model(args.model, pretrained=args.pretrained, checkpoint_path=args.checkpoint).eval()
    x = torch.randn(2, model.cfg.in_chans, args.img_size, args.img_size)
    export_onnx(model, args.output, example_input=x)
    print(f"wrote {args.output}; onnxruntime vs PyTorch relative error {check_onnx(args.output, model, x):.2e}")
    if args.program:
        pt2 = os.path.splitext(args.output)[0] + ".pt2"
        torch.export.save(export_program(model, x, dynamic_batch=True), pt2)
        print(f"wrote {pt2} (load with torch.export.load after `import ppma`)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
