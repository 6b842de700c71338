"""`python -m glm53.tools.crop` (kept working): the crop tool lives in glm53/checkpoint/crop.py."""

import sys

from ..checkpoint.crop import CropError, crop, main, plan_crop, rewrite_config

__all__ = ["CropError", "crop", "main", "plan_crop", "rewrite_config"]

if __name__ == "__main__":
    sys.exit(main())
