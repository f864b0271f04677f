"""Train a pan model: `torchrun --nproc_per_node N train.py --config config/X.yaml [--key value ...]`."""

import sys

from pan.cli import cmd_train

if __name__ == "__main__":
    sys.exit(cmd_train(sys.argv[1:]))
