"""`python -m services.cli …` == the `specserve` console script."""

import sys

from services.cli import main

sys.exit(main())
