"""`pan launch-command`: print the validated torchrun / srun / sbatch commands of a workflow.

    pan launch-command --workflow pretrain --nodes 30 --gpus-per-node 8 [--config X.yaml] [--key value ...]
    pan launch-command --workflow causal-video-vae --stage both --nodes 1 --gpus-per-node 8

The config (with the overrides) is loaded exactly as train.py will load it, and the layout is checked
for world = nodes x gpus-per-node (cp_size divides the processes per node and the attention heads;
hybrid shard needs whole nodes). An invalid combination is refused with the reason and exit code 2.
Nothing is run: the commands are printed to be copied.

Workflows are declared by the recipes (`Recipe.workflows`, pan/recipe.py); `all_workflows()` lists
every recipe's. A config whose recipe is not the workflow's is refused.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass

from pan.config import ConfigError, load_job_config
from pan.config.core import require
from pan.parallel.dims import ParallelDims
from pan.recipe import Workflow, all_workflows, resolve

EXIT_INVALID = 2
DEFAULT_MASTER_PORT = 29500
TRAIN_SCRIPT = "train.py"


@dataclass
class LaunchCommands:
    """The commands of one launch, as argument lists (`render` quotes them for a shell)."""
    summary: str
    torchrun: list[str]              # one node's command (node_rank 0 on a single node)
    srun: list[str] | None           # multi-node only: one torchrun per node through srun
    sbatch: list[str]                # the same run through the workflow's launch script


def validate(workflow: Workflow, config: str, overrides: list[str], nodes: int, gpus_per_node: int):
    """Load the config and check the layout; returns (job, ParallelDims) or raises ConfigError."""
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(None, f"--nodes ({nodes}) and --gpus-per-node ({gpus_per_node}) must be >= 1.")
    job = load_job_config(["--config", config, *overrides], warn=lambda msg: print(
        f"pan launch-command: {msg}", file=sys.stderr))
    require(job.recipe == workflow.recipe, "recipe",
            f"is {job.recipe} in {config}, but workflow {workflow.name} trains the {workflow.recipe} "
            f"recipe. Use a {workflow.recipe} config, or the workflow of the {job.recipe} recipe "
            f"({', '.join(w.name for w in all_workflows().values() if w.recipe == job.recipe) or 'none'}).")
    dims = ParallelDims.from_config(job.parallel, nodes * gpus_per_node, gpus_per_node)
    if workflow.check is not None:
        resolve(workflow.check)(job, dims)
    return job, dims


def build_commands(workflow: Workflow, config: str, overrides: list[str], nodes: int,
                   gpus_per_node: int, master_port: int = DEFAULT_MASTER_PORT) -> LaunchCommands:
    """Validate, then build the torchrun, srun (nodes > 1) and sbatch commands."""
    job, dims = validate(workflow, config, overrides, nodes, gpus_per_node)
    train_args = [TRAIN_SCRIPT, "--config", config, *overrides]
    rendezvous = [f"--nnodes={nodes}", f"--nproc_per_node={gpus_per_node}",
                  f"--master_port={master_port}"]
    if nodes == 1:
        torchrun = ["torchrun", *rendezvous, "--master_addr=127.0.0.1", "--node_rank=0", *train_args]
        srun = None
    else:
        # Each node fills in its own rank; MASTER_ADDR is the first node of the allocation.
        torchrun = ["torchrun", *rendezvous, "--master_addr=$MASTER_ADDR", "--node_rank=$SLURM_NODEID",
                    *train_args]
        srun = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                "--cpu-bind=none", "bash", "-c", 'exec "$0" --node_rank="$SLURM_NODEID" "$@"',
                "torchrun", *rendezvous, "--master_addr=$MASTER_ADDR", *train_args]
    sbatch = [f"PAN_NPROC_PER_NODE={gpus_per_node}", "sbatch", f"--nodes={nodes}", workflow.script,
              config, *overrides]
    summary = (f"workflow {workflow.name} ({workflow.description}): {nodes} node(s) x {gpus_per_node} "
               f"processes = world {dims.world_size} (dp_replicate {dims.dp_replicate} x dp_shard "
               f"{dims.dp_shard} x cp {dims.cp}), recipe {job.recipe}, config {config}")
    return LaunchCommands(summary, torchrun, srun, sbatch)


def shell_join(args: list[str]) -> str:
    """Quote for a shell; a word naming a variable (`$MASTER_ADDR`) is double-quoted so the shell
    that runs the line expands it."""
    def word(arg: str) -> str:
        if "$" in arg and not any(c in arg for c in "\"'\\`"):
            return f'"{arg}"'
        return shlex.quote(arg)
    return " ".join(word(a) for a in args)


def render(commands: LaunchCommands) -> str:
    lines = [f"# {commands.summary}"]
    if commands.srun is None:
        lines += ["# torchrun on this node (run from the repository root):", shell_join(commands.torchrun)]
    else:
        lines += ["# torchrun on every node (node_rank 0..N-1; MASTER_ADDR = the first node):",
                  shell_join(commands.torchrun),
                  "# srun inside an allocation (salloc/sbatch), one torchrun per node:",
                  'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
                  shell_join(commands.srun)]
    lines += ["# the same run through the workflow's Slurm launch script:", shell_join(commands.sbatch)]
    return "\n".join(lines)


def stage_configs(workflow: Workflow, stage: str | None, config: str | None) -> list[tuple[str | None, str]]:
    """(stage, config) of each run the command prints: the workflow's one run, one stage, or every
    stage in order (`--stage both`)."""
    if stage is None:
        return [(None, config or workflow.default_config)]
    if not workflow.stages:
        raise ConfigError(None, f"--stage applies to workflows run in stages "
                                f"({', '.join(w.name for w in all_workflows().values() if w.stages) or 'none'}); "
                                f"{workflow.name} is one run: drop --stage.")
    if stage == "both":
        if config is not None:
            raise ConfigError(None, "--stage both prints every stage with its own YAML; --config names "
                                    "one: pick a stage with --stage, or drop --config.")
        return list(workflow.stages.items())
    if stage not in workflow.stages:
        raise ConfigError(None, f"workflow {workflow.name} has the stages {list(workflow.stages)} (or both), "
                                f"not {stage!r}.")
    return [(stage, config or workflow.stages[stage])]


def render_stages(runs: list[tuple[str | None, LaunchCommands]]) -> str:
    """One run's commands, or each stage's, then one line submitting them all, each stage waiting
    for the previous one to succeed."""
    if len(runs) == 1:
        return render(runs[0][1])
    blocks = [f"# ---- stage {stage} ----\n" + render(commands) for stage, commands in runs]
    chain = []
    for i, (_, commands) in enumerate(runs):
        env, sbatch, *rest = commands.sbatch
        dependency = [] if i == 0 else ["--dependency=afterok:$JOB"]
        submit = shell_join([env, sbatch, "--parsable", *dependency, *rest])
        chain.append(f"JOB=$({submit})")
    blocks.append("# every stage through Slurm, each after the previous one succeeded:\n" + " && \\\n  ".join(chain))
    return "\n\n".join(blocks)


def main_launch_command(argv: list[str]) -> int:
    """`pan launch-command`: print the commands, or the reason they are refused (exit 2)."""
    workflows = all_workflows()
    parser = argparse.ArgumentParser(
        prog="pan launch-command", allow_abbrev=False,
        description="Print a validated torchrun command (and the srun and sbatch lines) for a "
                    "workflow; never runs it. Other arguments are train.py overrides (--key value).",
        usage=f"pan launch-command --workflow {{{','.join(workflows)}}} --nodes N --gpus-per-node G "
              "[--config X.yaml] [--key value ...]",
        epilog="workflows:\n" + "\n".join(f"  {w.name:<22} {w.description} (recipe {w.recipe})"
                                           for w in workflows.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workflow", required=True, choices=list(workflows))
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--gpus-per-node", type=int, required=True, help="processes per node")
    parser.add_argument("--config", default=None, help="run YAML (default: the workflow's)")
    parser.add_argument("--stage", default=None,
                        help="for workflows run in stages: one stage (its default YAML), or `both` "
                             "(every stage, chained)")
    parser.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT)
    args, overrides = parser.parse_known_args(argv)
    workflow = workflows[args.workflow]
    try:
        runs = [(stage, build_commands(workflow, config, overrides, args.nodes, args.gpus_per_node,
                                       args.master_port))
                for stage, config in stage_configs(workflow, args.stage, args.config)]
    except ConfigError as e:
        print(f"pan launch-command: refused: {e}", file=sys.stderr)
        return EXIT_INVALID
    print(render_stages(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main_launch_command(sys.argv[1:]))
