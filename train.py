"""Train a pan model: `torchrun --nproc_per_node N train.py --config config/X.yaml [--key value ...]`."""

import sys

from pan.cli import cmd_train
from pan.parallel.world import exit_process

if __name__ == "__main__":
    exit_process(cmd_train(sys.argv[1:]))
