import sys

from vexpert_runtime.cli import main

sys.exit(main())
