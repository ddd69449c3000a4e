"""``python -m ppma.train``: same as ``ppma-train``."""

import sys

from ppma.train.cli.train import main

sys.exit(main())
