"""The `pyramid_flow` recipe: Pyramid-Flow full-sequence spatial-pyramid flow matching.

    config.py      its keys (the job config) and the released DiT variant's config.json
    model.py       the DiT: a released Pyramid-Flow model or pan's own behind its interface
    task.py        the training task (what both Pyramid-Flow recipes share, and the full-sequence one)
    sample.py      the stage-by-stage sampler: validation samples and `pan sample`
    rules.py       the launch rules (the workflow's `check`) and what the DiT takes, from its config
    checks.py      `pan check`'s rows
    probe.py       the memory and step-time probe of `pan check`
    precompute.py  `pan data precompute` in Pyramid-Flow's format
    export.py      `pan export --format pyramid_flow`: a released DiT folder

Only the config module is imported here (loading a config stays light); every other hook is named
as a string and imported by the command that uses it.
"""

from pan.recipe import Recipe, Workflow
from pan.recipes.pyramid_flow.config import PyramidJobConfig

RECIPE = Recipe(
    name="pyramid_flow",
    job_config=PyramidJobConfig,
    task="pan.recipes.pyramid_flow.task:PyramidFlowTask",
    description="Pyramid-Flow full-sequence spatial-pyramid flow matching",
    checks="pan.recipes.pyramid_flow.checks:CHECKS",
    probe="pan.recipes.pyramid_flow.probe:full_sequence_probe",
    sample="pan.recipes.pyramid_flow.sample:sample_main",
    exports={"pyramid_flow": "pan.recipes.pyramid_flow.export:export_released"},
    precompute="pan.recipes.pyramid_flow.precompute:PyramidJobFormat",
    workflows=(Workflow(
        "pyramid-flow-no-ar", "pyramid_flow", "config/pyramid_flow_384p.yaml",
        "scripts/train_pyramid_flow_without_ar.sh",
        "Pyramid-Flow full-sequence (non-AR) fine-tuning of a released DiT",
        check="pan.recipes.pyramid_flow.rules:check_launch"),),
)
