import sys

from spec_runtime.cli import main

sys.exit(main())
