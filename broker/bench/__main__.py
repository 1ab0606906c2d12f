import sys

from zeroserve.broker.bench.main import main

sys.exit(main())
