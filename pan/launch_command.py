"""`pan launch-command`: print the validated torchrun / srun / sbatch commands of a workflow.

    pan launch-command --workflow pretrain --nodes 30 --gpus-per-node 8 [--config X.yaml] [--key value ...]
    pan launch-command --workflow causal-video-vae --stage both --nodes 1 --gpus-per-node 8

The config (with the overrides) is loaded exactly as train.py will load it, and the layout is checked
for world = nodes x gpus-per-node (cp_size divides the processes per node and the attention heads;
hybrid shard needs whole nodes). An invalid combination is refused with the reason and exit code 2.
Nothing is run: the commands are printed to be copied.

Workflows are declared by the recipes (`Recipe.workflows`, pan/recipe.py); `all_workflows()` lists
every recipe's. A config whose recipe is not the workflow's is refused.

A workflow run in stages prints one stage (`--stage NAME`) or all, chained (`--stage both`): an
override `--key value` reaches every stage printed, `--stage<NAME>.<key> value` that stage only, and
`--config NAME=X.yaml` replaces that stage's YAML. Chained stages may not share an output_dir, and
the workflow's check sees the previous stage's job (a stage may start from what the one before it
writes last).

    python -m pan.launch_command torchrun [torchrun arguments] train.py [train.py arguments]

runs torchrun (in this process) and exits with the ranks' status instead of torchrun's 1 for every
failure: what the printed commands and scripts/_launch.sh run, so that a scheduler sees pan's exit
statuses (STATUS_MEANINGS). See `run_torchrun`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from pan.config import EXIT_CONFIG_ERROR, ConfigError, load_job_config
from pan.config.arguments import COUNT, POSITIVE, ValueType, input_file, whole_number, yaml_mapping
from pan.config.core import ErrorCollector, require, split_fix
from pan.parallel.dims import ParallelDims
from pan.parallel.world import planned_task
from pan.recipe import Workflow, all_workflows, resolve
from pan.runtime.watchdog import HANG_EXIT_CODE

EXIT_INVALID = 2
DEFAULT_MASTER_PORT = 29500
TRAIN_SCRIPT = "train.py"
# Each node runs torchrun through this module, which exits with the ranks' status (run_torchrun).
TORCHRUN = ["python", "-m", "pan.launch_command", "torchrun"]

# The statuses a launch ends with, as the ranks return them (pan/trainer.py's train()), and what each
# means for a requeue policy. Every other status is a failure of its own kind (the log says which).
EXIT_FAILED = 1
EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143: what a rank returns once it saved the step it stopped at
STATUS_MEANINGS = {
    0: "finished",
    EXIT_FAILED: "failed (a crash, non-finite losses, a lost peer or launcher, a rank killed by a "
                 "signal): read the log before retrying",
    EXIT_CONFIG_ERROR: "refused launch or unreadable run (config, data, resume, output_dir held by "
                       "another run): do not retry until it is fixed",
    HANG_EXIT_CODE: "hang: the watchdog ended every rank with its stacks in the log; retry",
    EXIT_PREEMPTED: "stopped by SIGTERM (preemption, time limit, scancel) after saving the step it "
                    "stopped at: requeue, it resumes from there",
}


@dataclass
class LaunchCommands:
    """The commands of one launch, as argument lists (`render` quotes them for a shell)."""
    summary: str
    torchrun: list[str]              # one node's command (node_rank 0 on a single node)
    srun: list[str] | None           # multi-node only: one torchrun per node through srun
    sbatch: list[str]                # the same run through the workflow's launch script
    job: object = None               # the loaded job config (the next stage's check reads it)


def validate(workflow: Workflow, config: str, overrides: list[str], nodes: int, gpus_per_node: int,
             previous=None, device_memory: float | None = None, problems: ErrorCollector | None = None):
    """Load the config and check the layout; returns (job, ParallelDims). `previous`: the job of the
    stage before this one when stages are chained (`--stage both`), which the workflow's check is
    given (a stage may start from what the previous one writes). Then `pan check`'s rows of the job
    (`failed_rows`).

    Every problem that can be judged is reported at once, as the config loader gathers its own: the
    loader's, the layout's (the recipe's task for this world) and the workflow's rule, each with
    its fix; the rows once the config and the layout hold (a row of a config that breaks a rule, or
    of a layout refused, would only say those again). Without `problems` they are raised together
    (ConfigError); with it they are gathered there, and job / dims are None where not judged."""
    own = ErrorCollector()
    gathered = own if problems is None else problems
    before = len(gathered.errors)
    job = dims = None
    with gathered.gather():
        if nodes < 1 or gpus_per_node < 1:
            raise ConfigError(None, f"--nodes ({nodes}) and --gpus-per-node ({gpus_per_node}) must be >= 1.")
    with gathered.gather():
        job = load_job_config(["--config", config, *overrides], problems=gathered, warn=lambda msg: print(
            f"pan launch-command: {msg}", file=sys.stderr))
    if job is not None and job.recipe != workflow.recipe:   # every other rule would be another recipe's
        gathered.add(ConfigError(
            "recipe", f"is {job.recipe} in {config}, but workflow {workflow.name} trains the {workflow.recipe} "
            f"recipe. Use a {workflow.recipe} config, or the workflow of the {job.recipe} recipe "
            f"({', '.join(w.name for w in all_workflows().values() if w.recipe == job.recipe) or 'none'})."))
        job = None
    loaded = job is not None and len(gathered.errors) == before   # the config holds every rule
    if job is not None and nodes >= 1 and gpus_per_node >= 1:
        with judged(gathered, loaded):
            planned = ParallelDims.from_config(job.parallel, nodes * gpus_per_node, gpus_per_node)
            planned_task(job, planned)  # what the recipe's task refuses for this layout (context groups, ...)
            dims = planned
    if job is not None:
        if previous is not None:
            with gathered.gather():
                refuse_shared_output_dir(job, previous)
        if workflow.check is not None:
            check = resolve(workflow.check)
            with judged(gathered, loaded and dims is not None):
                check(job, dims) if previous is None else check(job, dims, previous=previous)
    if job is not None and dims is not None and loaded:
        said = {split_fix(e)[0] for e in gathered.errors[before:]}   # a row that says a rule's problem again
        for row in failed_rows(job, nodes, gpus_per_node, device_memory, previous):
            if row.detail not in said:
                gathered.add(ConfigError(None, f"{row.check}: {row.detail}", fix=row.fix))
    if problems is None:
        own.raise_any()
    return job, dims


@contextlib.contextmanager
def judged(problems: ErrorCollector, sure: bool):
    """Run a rule, gathering its ConfigErrors. On a config that breaks other rules (`sure` false) a
    rule may meet what those refuse (a folder that is not there, a value out of range) and fail
    otherwise: then it cannot be judged on this config, and the problems already said are the ones
    to fix first."""
    try:
        with problems.gather():
            yield
    except Exception:  # noqa: BLE001 - not judged on this config (see above); its problems are said
        if sure:
            raise


def failed_rows(job, nodes: int, gpus_per_node: int, device_memory: float | None, previous) -> list:
    """`pan check`'s rows of the job for the planned layout (not the environment's: the commands run
    elsewhere, where train.py checks it): the failed rows refuse the launch, a warning is printed.
    Without a GPU here and without --device-memory, the memory row can only plan for this machine's
    host memory, so there it warns instead of refusing (`Preflight.elsewhere`)."""
    from pan.preflight.core import Preflight, job_rows, one_line  # lazy: the torchrun wrapper
    # (`python -m pan.launch_command torchrun`) loads no checks

    ctx = Preflight(job, nodes, gpus_per_node, device_memory=device_memory, previous_stage=previous, elsewhere=True)
    rows = job_rows(ctx)
    for row in rows:
        if row.status == "warn":
            print(f"pan launch-command: warning: {row.check}: {one_line(row.detail)} (fix: {one_line(row.fix)})",
                  file=sys.stderr)
    return [r for r in rows if r.status == "fail"]


def commands_of(workflow: Workflow, config: str, overrides: list[str], nodes: int, gpus_per_node: int,
                master_port: int, job, dims) -> LaunchCommands:
    """The torchrun, srun (nodes > 1) and sbatch commands of a validated job."""
    train_args = [TRAIN_SCRIPT, "--config", config, *overrides]
    rendezvous = [f"--nnodes={nodes}", f"--nproc_per_node={gpus_per_node}",
                  f"--master_port={master_port}"]
    if nodes == 1:
        torchrun = [*TORCHRUN, *rendezvous, "--master_addr=127.0.0.1", "--node_rank=0", *train_args]
        srun = None
    else:
        # Each node fills in its own rank; MASTER_ADDR is the first node of the allocation.
        torchrun = [*TORCHRUN, *rendezvous, "--master_addr=$MASTER_ADDR", "--node_rank=$SLURM_NODEID",
                    *train_args]
        python, *module = TORCHRUN
        srun = ["srun", f"--nodes={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                "--cpu-bind=none", "bash", "-c",
                f'exec "$0" {" ".join(module)} --node_rank="$SLURM_NODEID" "$@"',
                python, *rendezvous, "--master_addr=$MASTER_ADDR", *train_args]
    sbatch = [f"PAN_NPROC_PER_NODE={gpus_per_node}", "sbatch", f"--nodes={nodes}", workflow.script,
              config, *overrides]
    summary = (f"workflow {workflow.name} ({workflow.description}): {nodes} node(s) x {gpus_per_node} "
               f"processes = world {dims.world_size} (dp_replicate {dims.dp_replicate} x dp_shard "
               f"{dims.dp_shard} x cp {dims.cp}), recipe {job.recipe}, config {config}")
    return LaunchCommands(summary, torchrun, srun, sbatch, job)


def shell_join(args: list[str]) -> str:
    """Quote for a shell; a word naming a variable (`$MASTER_ADDR`) is double-quoted so the shell
    that runs the line expands it."""
    def word(arg: str) -> str:
        if "$" in arg and not any(c in arg for c in "\"'\\`"):
            return f'"{arg}"'
        return shlex.quote(arg)
    return " ".join(word(a) for a in args)


STATUS_NOTE = ("# each command exits with the ranks' status: 0 finished, 1 failed, 2 refused (do not "
               "retry), 3 hang (retry), 143 stopped by SIGTERM and saved (requeue)")


def render(commands: LaunchCommands) -> str:
    lines = [f"# {commands.summary}", STATUS_NOTE]
    if commands.srun is None:
        lines += ["# torchrun on this node (run from the repository root):", shell_join(commands.torchrun)]
    else:
        lines += ["# torchrun on every node (node_rank 0..N-1; MASTER_ADDR = the first node):",
                  shell_join(commands.torchrun),
                  "# srun inside an allocation (salloc/sbatch), one torchrun per node (the highest node status wins):",
                  'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
                  shell_join(commands.srun)]
    lines += ["# the same run through the workflow's Slurm launch script:", shell_join(commands.sbatch)]
    return "\n".join(lines)


STAGE_KEY_PREFIX = "--stage"   # `--stage<NAME>.<key> value`: an override of that stage only


def stage_configs(workflow: Workflow, stage: str | None, configs: list[str] | None) -> list[tuple[str | None, str]]:
    """(stage, config) of each run the command prints: the workflow's one run, one stage, or every
    stage in order (`--stage both`). `configs`: the --config values, `YAML` or, per stage,
    `STAGE=YAML` (a stage not named takes its default YAML)."""
    configs = configs or []
    if stage is None:
        require(len(configs) <= 1 and not any(_stage_named(c, workflow) for c in configs), "config",
                f"names one YAML for workflow {workflow.name}: give --config once, as --config X.yaml.")
        return [(None, configs[0] if configs else workflow.default_config)]
    if not workflow.stages:
        raise ConfigError(None, f"--stage applies to workflows run in stages "
                                f"({', '.join(w.name for w in all_workflows().values() if w.stages) or 'none'}); "
                                f"{workflow.name} is one run: drop --stage.")
    if stage != "both" and stage not in workflow.stages:
        raise ConfigError(None, f"--stage {stage}: workflow {workflow.name} has the stages "
                                f"{list(workflow.stages)} (or both), not {stage!r}.")
    chosen = dict(workflow.stages)
    plain = [c for c in configs if not _stage_named(c, workflow)]
    if stage == "both":
        require(not plain, "config",
                f"{plain[0] if plain else ''} names one YAML, but --stage both prints every stage "
                f"({', '.join(workflow.stages)}): give each stage's own as --config STAGE=YAML (e.g. "
                f"--config {next(iter(workflow.stages))}=my_stage.yaml; a stage not named keeps its "
                "default), or pick one stage with --stage.")
    elif plain:
        require(len(plain) == 1 and len(configs) == 1, "config", "names several YAMLs for one stage: give one.")
        chosen[stage] = plain[0]
    for value in configs:
        if _stage_named(value, workflow):
            name, _, path = value.partition("=")
            require(stage == "both" or name == stage, "config",
                    f"{value} is a YAML of stage {name}, but only stage {stage} is printed.")
            chosen[name] = path
    return list(chosen.items()) if stage == "both" else [(stage, chosen[stage])]


def _stage_named(config: str, workflow: Workflow) -> bool:
    return bool(workflow.stages) and config.partition("=")[0] in workflow.stages and "=" in config


def split_stage_overrides(workflow: Workflow, overrides: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """The overrides every run takes, and each stage's own (`--stage2.output_dir runs/x` ->
    stage 2's `--output_dir runs/x`), in the loader's `--key value` / `--key=value` forms."""
    shared, per_stage = [], {}
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        name, eq, value = arg.partition("=")
        stage, dot, key = name.removeprefix(STAGE_KEY_PREFIX).partition(".")
        if not (name.startswith(STAGE_KEY_PREFIX) and dot and key):
            shared.append(arg)
            i += 1
            continue
        if not workflow.stages or stage not in workflow.stages:
            has = f"the stages {list(workflow.stages)}" if workflow.stages else "no stages"
            raise ConfigError(None, f"{name} sets a key of stage {stage!r}, but workflow {workflow.name} has {has}.")
        words = [f"--{key}" + (f"={value}" if eq else "")]
        if not eq and i + 1 < len(overrides) and not overrides[i + 1].startswith("--"):
            words.append(overrides[i + 1])
            i += 1
        per_stage.setdefault(stage, []).extend(words)
        i += 1
    return shared, per_stage


def stage_runs(workflow: Workflow, runs: list[tuple[str | None, str]], overrides: list[str], nodes: int,
               gpus_per_node: int, master_port: int,
               device_memory: float | None = None) -> list[tuple[str | None, LaunchCommands]]:
    """Each run's validated commands: the shared overrides and the stage's own; a chained stage is
    checked against the one before it, and two stages may not write one output_dir. Every stage is
    judged, each problem of a stage said with its name: all of them are raised together."""
    shared, per_stage = split_stage_overrides(workflow, overrides)
    printed = {stage for stage, _ in runs}
    stray = sorted(set(per_stage) - printed)
    if stray:
        raise ConfigError(None, f"--stage{stray[0]}.* overrides are given, but only stage(s) "
                                f"{', '.join(str(s) for s in printed)} are printed: drop them or use --stage both.")
    done: list[tuple[str | None, LaunchCommands]] = []
    problems = ErrorCollector()
    previous = None   # the job of the stage before (when it loaded): the next stage's check reads it
    for stage, config in runs:
        found = ErrorCollector()
        stage_overrides = [*shared, *per_stage.get(stage, [])]
        job, dims = validate(workflow, config, stage_overrides, nodes, gpus_per_node, previous, device_memory, found)
        if found.errors:
            for error in found.unique():
                problems.add(error if stage is None else in_stage(error, stage, config))
        else:
            done.append((stage, commands_of(workflow, config, stage_overrides, nodes, gpus_per_node, master_port,
                                            job, dims)))
        previous = job
    problems.raise_any()
    return done


def in_stage(error: ConfigError, stage: str, config: str) -> ConfigError:
    """A problem of one stage of several, said with the stage's name and YAML."""
    detail, fix = split_fix(error)
    return ConfigError(None, f"stage {stage} ({config}): {detail}", fix=fix)


def refusal(error: ConfigError) -> str:
    """What `pan launch-command` prints for a refused launch: every problem, one a line (a problem of
    several lines indented below its first), each with its fix below it, as `pan check` gives them."""
    problems = error.problems()
    lines = [f"pan launch-command: refused ({len(problems)} problem{'s' if len(problems) > 1 else ''}; "
             "nothing printed to run):"]
    for problem in problems:
        detail, fix = split_fix(problem)
        first, *more = detail.splitlines() or [""]
        lines += [f"  - {first}", *(f"    {line}" for line in more)]
        lines += [f"    fix: {line}" for line in fix.splitlines()]
    return "\n".join(lines)


def refuse_shared_output_dir(job, previous) -> None:
    """Two chained stages writing one output_dir: the second would resume the first."""
    out = job.checkpoint.output_dir
    require(Path(previous.checkpoint.output_dir).resolve() != Path(out).resolve(), "output_dir",
            f"is {out} for this stage and the one before it: a run resumes the checkpoints of its "
            "output_dir, so this stage would continue the previous one. Give each stage its own with "
            "--stage<NAME>.output_dir DIR (an --output_dir override reaches every stage).")


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


def stage_config(text: str) -> str:
    """`--config [STAGE=]YAML`: the YAML file must exist and parse (which stages there are is the
    workflow's, judged with the rest of the command)."""
    path = text.partition("=")[2] if "=" in text and not Path(text).exists() else text
    input_file("a run config YAML (or STAGE=YAML)", check=yaml_mapping).convert(path)
    return text


def build_parser(workflows: dict | None = None) -> argparse.ArgumentParser:
    """`pan launch-command`'s options (`workflows`: every recipe's, by name)."""
    workflows = all_workflows() if workflows is None else workflows
    parser = argparse.ArgumentParser(
        prog="pan launch-command", allow_abbrev=False,
        description="Print a validated torchrun command (and the srun and sbatch lines) for a "
                    "workflow; never runs it. Other arguments are train.py overrides (--key value).",
        usage=f"pan launch-command --workflow {{{','.join(workflows)}}} --nodes N --gpus-per-node G "
              "[--config X.yaml] [--stage STAGE|both] [--key value ...] [--stage<NAME>.<key> value ...]",
        epilog="workflows:\n" + "\n".join(f"  {w.name:<22} {w.description} (recipe {w.recipe})"
                                           for w in workflows.values()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workflow", required=True, choices=list(workflows))
    parser.add_argument("--nodes", type=COUNT, required=True)
    parser.add_argument("--gpus-per-node", type=COUNT, required=True, help="processes per node")
    parser.add_argument("--config", action="append", default=None, metavar="[STAGE=]YAML",
                        type=ValueType("config", stage_config, "config"),
                        help="run YAML (default: the workflow's); with stages, STAGE=YAML gives one "
                             "stage's (repeatable)")
    parser.add_argument("--stage", default=None,
                        help="for workflows run in stages: one stage (its default YAML), or `both` "
                             "(every stage, chained). Overrides reach every stage printed; "
                             "--stage<NAME>.<key> VALUE (e.g. --stage2.output_dir runs/s2) only that stage")
    parser.add_argument("--master-port", type=whole_number(1, 65535), default=DEFAULT_MASTER_PORT)
    parser.add_argument("--device-memory", type=POSITIVE, default=None, metavar="GIB",
                        help="memory of one device of the planned run in GiB, for the memory check (default: "
                             "this machine's GPU; without one the memory row only warns)")
    return parser


def main_launch_command(argv: list[str]) -> int:
    """`pan launch-command`: print the commands, or the reason they are refused (exit 2)."""
    workflows = all_workflows()
    args, overrides = build_parser(workflows).parse_known_args(argv)
    workflow = workflows[args.workflow]
    try:
        runs = stage_runs(workflow, stage_configs(workflow, args.stage, args.config), overrides, args.nodes,
                          args.gpus_per_node, args.master_port, args.device_memory)
    except ConfigError as e:
        print(refusal(e), file=sys.stderr)
        return EXIT_INVALID
    print(render_stages(runs))
    return 0


# ---- torchrun, exiting with the ranks' status ---------------------------------------------------


def child_processes(parent: int) -> list[int]:
    """The pids whose parent is `parent` (torchrun's ranks, when `parent` is torchrun)."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:  # the name in (...) may hold spaces
            found.append(int(entry.name))
    return found


class SigtermToRanks:
    """torchrun's SIGTERM, passed on to its ranks, which decide: each finishes its step, saves and
    exits 143, and torchrun returns once they are done, with their status, however long the save
    takes. (torchrun's own handling stops them 30 s later, interrupting a longer save, and says 1.)
    A rank gets it with its decoding workers, as from torchrun (each rank is a process group of its
    own); a rank torchrun starts after the SIGTERM gets it as soon as it runs. Nothing here raises
    into torchrun: after its ranks ended, a SIGTERM changes nothing."""

    def __init__(self):
        self.signalled: set[int] = set()
        self.received = False

    def handle(self, signum, frame) -> None:
        ranks = self.pass_on(again=True)
        print(f"pan launch: SIGTERM: passed on to the {ranks} rank(s) running on this node (and to any "
              "it starts later): they save and stop", file=sys.stderr, flush=True)
        if not self.received:
            self.received = True
            threading.Thread(target=self.pass_on_to_new_ranks, name="pan-sigterm", daemon=True).start()

    def pass_on(self, again: bool) -> int:
        ranks = child_processes(os.getpid())
        for pid in ranks:
            if again or pid not in self.signalled:
                self.signalled.add(pid)
                with contextlib.suppress(OSError):  # ended meanwhile
                    if os.getpgid(pid) == pid:
                        os.killpg(pid, signal.SIGTERM)
                    else:
                        os.kill(pid, signal.SIGTERM)
        return len(ranks)

    def pass_on_to_new_ranks(self) -> None:
        while True:
            time.sleep(0.2)
            self.pass_on(again=False)


def ranks_status(failures: dict) -> tuple[int, str]:
    """The status of a failed launch from torchrun's failures ({global rank: ProcessFailure}): the
    first failure's (the others follow from it: torchrun stops the other ranks once one failed);
    among failures seen in the same second, the highest status, as srun picks among nodes. A rank
    killed by a signal is a failure (1): 143 only ever comes from ranks that saved."""
    first = min(f.timestamp for f in failures.values())
    rank, failure = max(((r, f) for r, f in failures.items() if f.timestamp == first),
                        key=lambda rf: (rf[1].exitcode, -rf[0]))
    if failure.exitcode < 0:
        name = signal.Signals(-failure.exitcode).name
        return EXIT_FAILED, f"rank {rank} was killed by {name}"
    return failure.exitcode, f"rank {rank} exited with {failure.exitcode}"


def run_torchrun(argv: list[str]) -> int:
    """torchrun with `argv`, returning the ranks' status (STATUS_MEANINGS).

    torchrun reports 1 for any failed rank. Here the status is the first failed rank's own (2, 3,
    143, ...; a rank killed by a signal: 1), or 0. SIGTERM (preemption, time limit, scancel, srun
    ending the step) goes to the ranks, which save and stop, and torchrun waits for them however
    long their save takes; SIGINT, SIGHUP and SIGQUIT stop the ranks as torchrun does (then the
    status is 128 + the signal).
    """
    signal.signal(signal.SIGTERM, SigtermToRanks().handle)  # first: a SIGTERM may come at any moment
    from torch.distributed import run as torch_run  # lazy: the launch-command printer needs no torch
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    if any("--signals-to-handle" in action.option_strings for action in torch_run.get_args_parser()._actions):
        argv = ["--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", *argv]  # SIGTERM stays ours (above)
    else:
        print("pan launch: this torch's torchrun has no --signals-to-handle: on SIGTERM it stops the "
              "ranks itself and the status is 1", file=sys.stderr)
    failed = None
    try:
        torch_run.main(argv)
    except ChildFailedError as e:
        failed = e
    except SignalException as e:
        failed = e
    except Exception as e:  # noqa: BLE001 - torchrun's own failure (rendezvous, arguments): as torchrun says
        traceback.print_exc()
        failed = e
    # The status is decided: a SIGTERM from now on (srun ending this step because another node ended
    # first) must not kill this process, also not while Python finalises (which restores SIGTERM's
    # default action where a Python handler was set, but keeps an ignored signal ignored).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if failed is None:
        status, why = 0, "every rank finished"
    elif isinstance(failed, ChildFailedError):
        print(failed, file=sys.stderr)  # torchrun's table of the failed ranks
        status, why = ranks_status(failed.failures)
    elif isinstance(failed, SignalException):  # 143 is the ranks' alone: a SIGTERM here (an old torch) fails
        status = EXIT_FAILED if failed.sigval == signal.SIGTERM else 128 + failed.sigval
        why = f"torchrun was stopped by {failed.sigval.name}"
    else:
        status, why = EXIT_FAILED, "torchrun failed"
    meaning = STATUS_MEANINGS.get(status, "failed")
    print(f"pan launch: status {status} ({why}): {meaning}", file=sys.stderr, flush=True)
    return status


def main(argv: list[str]) -> int:
    """`python -m pan.launch_command torchrun ...` runs torchrun; anything else prints commands."""
    if argv[:1] == ["torchrun"]:
        return run_torchrun(argv[1:])
    return main_launch_command(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
