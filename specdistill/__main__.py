"""`python -m specdistill ...` and `torchrun --nproc_per_node N -m specdistill ...`."""

import sys

from specdistill.cli import main

sys.exit(main())
