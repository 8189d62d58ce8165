"""pretrain_gpt.py with one rank made slow on purpose, for the --log-straggler tests:
the rank named by MEGALITE_TEST_SLOW_RANK sleeps MEGALITE_TEST_SLOW_SECONDS before every
forward of a model chunk. Run it as torchrun runs pretrain_gpt.py."""

import os
import sys
import time

from megalite.model.gpt import GPTModel
from megalite.training import pretrain


def main() -> int:
    if os.environ["RANK"] == os.environ["MEGALITE_TEST_SLOW_RANK"]:
        forward, seconds = GPTModel.forward, float(os.environ["MEGALITE_TEST_SLOW_SECONDS"])

        def slow_forward(self, *args, **kwargs):
            time.sleep(seconds)
            return forward(self, *args, **kwargs)
        GPTModel.forward = slow_forward
    return pretrain()


if __name__ == "__main__":
    sys.exit(main())
