"""Loaded by every Python process that has this folder on PYTHONPATH: turns on the HCCL dtype check."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for `import npu_standin`

from npu_standin.hccl import patch_all  # noqa: E402

patch_all()
