"""Boot file of a preset-engine job (it runs a file, not a command): the kit launcher with the arguments the job
carries in KIT_NODE_ARGS (`kit.train.job.request`), from the uploaded checkout."""

import json
import os
import sys

if __name__ == "__main__":
    sys.path.insert(
        0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    )
    from kit.__main__ import main

    sys.exit(main(json.loads(os.environ["KIT_NODE_ARGS"])))
