import sys

from raylastic.cluster.cli import main

sys.exit(main())
