"""The Pan recipe: flow matching for PanVideoDiffusionTransformer on packed video + image batches."""

from pan.recipe import Recipe, Workflow
from pan.recipes.pan.config import PanJobConfig

RECIPE = Recipe(
    name="pan",
    job_config=PanJobConfig,
    task="pan.recipes.pan.task:PanTask",
    description="Pan: flow-matching MMDiT on packed video + image sequences",
    checks="pan.recipes.pan.checks:CHECKS",
    probe="pan.recipes.pan.checks:pan_probe",
    sample="pan.recipes.pan.sample:sample_pan",
    precompute="pan.recipes.pan.precompute:PanFormat",
    demo="pan.recipes.pan.demo:demo",
    workflows=(
        Workflow("pretrain", "pan", "config/pretrain_29B_720p.yaml", "scripts/pretrain.sh",
                 "Pan pretraining (from scratch or a plain state-dict warm start)"),
        Workflow("sft", "pan", "config/sft_29B_720p.yaml", "scripts/sft.sh",
                 "Pan SFT, warm-started from a pretrain checkpoint",
                 check="pan.recipes.pan.checks:sft_warm_starts"),
    ),
)
