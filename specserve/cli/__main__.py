"""`python -m specserve.cli …` == the `specserve` console script."""

import sys

from specserve.cli import main

sys.exit(main())
