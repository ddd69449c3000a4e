"""``python -m ppma.train``: same as ``ppma-train``."""

import sys

from ppma.train.main import main

sys.exit(main())
