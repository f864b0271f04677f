"""A recipe that lives outside pan: a tiny GAN with two trained parts (a generator and a
discriminator), used by pan's tests to prove that a model family is one package and nothing else.

pan finds it through the entry point this package declares (pyproject.toml, group `pan.recipes`),
or through `PAN_RECIPE_MODULES=pan_toy_gan`. Everything it offers is named below, lazily: loading a
config imports only `pan_toy_gan.config`. docs/adding_a_recipe.md walks through it.
"""

from pan.recipe import Recipe, Workflow
from pan_toy_gan.config import ToyGanJobConfig

RECIPE = Recipe(
    name="toy_gan",
    job_config=ToyGanJobConfig,
    task="pan_toy_gan.task:ToyGanTask",
    description="a tiny GAN with two parts (tests only)",
    checks="pan_toy_gan.checks:CHECKS",
    probe="pan_toy_gan.checks:toy_probe",
    sample="pan_toy_gan.sample:sample_main",
    exports={"toy_npz": "pan_toy_gan.export:export_npz"},
    workflows=(Workflow("toy-gan", "toy_gan", "config/toy_gan.yaml", "scripts/toy_gan.sh",
                        "the tests' two-part GAN", check="pan_toy_gan.checks:launch_rule"),),
)
