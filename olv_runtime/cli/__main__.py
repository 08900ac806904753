"""``python -m olv_runtime.cli``: the ``olv`` command."""
import sys

from olv_runtime.cli import main

sys.exit(main())
