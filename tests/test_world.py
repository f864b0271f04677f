"""How a command's process ends: its exit status and its last output survive, also after a process
group ran (when pan skips the interpreter's teardown), and a failing rank is reported."""

import subprocess
import sys

import pytest

from dist_utils import run_distributed

SCRIPT = """
import sys
import torch
import torch.distributed as dist
from pan.parallel.world import exit_process, start_process_group
if sys.argv[1] == "group":
    start_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
    out = [torch.empty(3)]
    dist.all_gather(out, torch.ones(3))
    dist.destroy_process_group()
print("last words", end="")  # unflushed: exit_process must flush it
exit_process(3)
"""


@pytest.mark.parametrize("kind", ["group", "no-group"])
def test_exit_process_keeps_the_status_and_the_last_output(kind, tmp_path):
    run = subprocess.run([sys.executable, "-c", SCRIPT, kind, str(tmp_path / "store")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 3, run.stderr
    assert run.stdout == "last words"


def _fail_on_rank_one() -> int:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one broke")
    return 0


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)rank1.*ValueError: rank one broke"):
        run_distributed(_fail_on_rank_one, world_size=2)
