import sys

from hf_dist.cli import main

sys.exit(main())
