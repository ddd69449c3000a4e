"""The command-line tools, each an argument parser over the ``ppma.train`` library: ``ppma-train``
(:mod:`.train`, also ``python -m ppma.train``), ``ppma-eval`` (:mod:`.evaluate`), ``ppma-benchmark``
(:mod:`.benchmark`) and ``ppma-visualize`` (:mod:`.visualize`)."""
