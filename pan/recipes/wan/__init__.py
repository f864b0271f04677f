"""The Wan recipe: fine-tuning Wan 2.1 / 2.2 (T2V, TI2V, A14B's experts) from their diffusers folders
by flow matching on packed video batches.

    config.py       the keys (model_path, wan_experts, flow_shift, ...; the shared components)
    folder.py       what a diffusers Wan folder holds, from its JSON files
    task.py         the parts (one per trained expert), the packed train step, the encoders
    precompute.py   `pan data precompute`: the folder's VAE latents and umT5 features
    text.py         umT5 prompts as WanPipeline encodes them
    sample.py       `pan sample`: diffusers' WanPipeline with the run's weights
    checks.py       `pan check`'s rows: the folder's variant and sizes, encoders, data, memory by hand
    probe.py        the memory and step-time probe of `pan check`, and the hand count of parameters
    context_parallel.py  a micro-batch shared over a cp group (video rows split, text whole)
    demo.py         `pan demo --recipe wan`: a tiny random Wan trained on the synthetic shapes, scored
    tiny.py         tiny Wan diffusers folders written by diffusers (the demo's; the tests' sizes)
    export.py       `pan export --format wan_diffusers / wan_lora`: diffusers transformer folders, LoRA files
    model.py        the transformer (diffusers' WanTransformer3DModel on packed batches)
    weights.py      its diffusers `transformer/` folders, read and written as they are
"""

from pan.recipe import Recipe
from pan.recipes.wan.config import WanJobConfig

RECIPE = Recipe(
    name="wan",
    job_config=WanJobConfig,
    task="pan.recipes.wan.task:WanTask",
    description="Wan 2.1 / 2.2: flow-matching fine-tuning of a diffusers Wan folder's transformer(s)",
    checks="pan.recipes.wan.checks:CHECKS",
    probe="pan.recipes.wan.probe:wan_probe",
    precompute="pan.recipes.wan.precompute:WanFormat",
    sample="pan.recipes.wan.sample:sample_wan",
    demo="pan.recipes.wan.demo:demo",
    exports={"wan_diffusers": "pan.recipes.wan.export:export_diffusers",
             "wan_lora": "pan.recipes.wan.export:export_lora"},
)
