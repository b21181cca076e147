import sys

from dlcp.cli import main

sys.exit(main())
