import sys

from loom.router.cli import main

sys.exit(main())
