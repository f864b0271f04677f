"""Train a pan model: `torchrun --nproc_per_node N train.py --config config/X.yaml [--key value ...]`."""

import sys

from pan.runtime.watchdog import watch_launcher  # the standard library only: nothing heavy is imported yet

if __name__ == "__main__":
    watch_launcher()  # first: torchrun can die while this rank imports torch or waits to rendezvous
    from pan.cli import main
    from pan.parallel.world import exit_process

    exit_process(main(["train", *sys.argv[1:]]))
