"""The `pyramid_flow_ar` recipe: Pyramid-Flow autoregressive temporal-pyramid flow matching with
video sync groups. It extends the full-sequence recipe (`pan.recipes.pyramid_flow`: its keys, DiT,
task base, checks, precompute; `pan export --format pyramid_flow` reads its runs too):

    config.py      its keys beyond the full-sequence recipe's, and the window of latent frames
    task.py        the training task: sync groups, units and their history
    sample.py      the unit-by-unit sampler: validation samples and `pan sample`
    checks.py      the launch rules, `pan check`'s rows and the memory probe
    demo.py        `pan demo --recipe pyramid_flow_ar`: a tiny model trained and sampled on CPU

Only the config module is imported here (loading a config stays light); every other hook is named
as a string and imported by the command that uses it.
"""

from pan.recipe import Recipe, Workflow
from pan.recipes.pyramid_flow_ar.config import PyramidARJobConfig

RECIPE = Recipe(
    name="pyramid_flow_ar",
    job_config=PyramidARJobConfig,
    task="pan.recipes.pyramid_flow_ar.task:PyramidFlowARTask",
    description="Pyramid-Flow autoregressive temporal-pyramid flow matching with video sync groups",
    checks="pan.recipes.pyramid_flow_ar.checks:CHECKS",
    probe="pan.recipes.pyramid_flow_ar.checks:ar_probe",
    sample="pan.recipes.pyramid_flow_ar.sample:sample_main",
    precompute="pan.recipes.pyramid_flow.precompute:PyramidJobFormat",
    demo="pan.recipes.pyramid_flow_ar.demo:demo",
    workflows=(Workflow(
        "pyramid-flow-ar", "pyramid_flow_ar", "config/pyramid_flow_ar_384p.yaml", "scripts/train_pyramid_flow.sh",
        "Pyramid-Flow autoregressive temporal-pyramid fine-tuning of a released DiT",
        check="pan.recipes.pyramid_flow_ar.checks:check_launch"),),
)
