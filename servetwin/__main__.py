import sys

from servetwin.cli import main

sys.exit(main())
