"""A diffusers Wan folder as the recipe reads it: what it holds, from its JSON files alone (no weights).

A released `*-Diffusers` folder (or one written by `WanPipeline.save_pretrained`) holds:

    model_index.json          _class_name (WanPipeline / WanImageToVideoPipeline), boundary_ratio (A14B),
                              expand_timesteps (2.2 TI2V), and which components are present
    transformer/              WanTransformer3DModel: config.json + safetensors (A14B: the high-noise expert)
    transformer_2/            A14B only: the low-noise expert
    vae/                      AutoencoderKLWan (z_dim, latents_mean / latents_std)
    text_encoder/, tokenizer/ umT5 (transformers' UMT5EncoderModel) and its tokenizer
    scheduler/                the sampler, with `flow_shift` (UniPC or FlowMatchEuler)
    image_encoder/, image_processor/   Wan 2.1 I2V only (CLIP)

What the recipe derives (`WanFolder`): the experts and their noise ranges (diffusers' rule: `transformer`
denoises the timesteps t >= boundary_ratio * num_train_timesteps, `transformer_2` the rest), the
conditioning the release was trained for (`t2v`; `ti2v` where expand_timesteps is set: the first
latent frame is given clean, at timestep 0, per token; `i2v` where the transformer takes mask and
condition channels beside the noisy latent), the scheduler's flow_shift, and the widths. Every problem
is a ConfigError on `model_path` that says what is missing and how to fix it. `missing_weights` tells
whether an expert's weight files are all there (the run's config check asks it for each trained expert:
a folder of config.json files alone is refused before any model is built).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from pan.config.core import ConfigError, require
from pan.models.pyramid_io import WEIGHTS_INDEX_NAME, WEIGHTS_NAME, weight_files
from pan.recipes.wan.model import WanConfig
from pan.recipes.wan.weights import load_config

PIPELINES = ("WanPipeline", "WanImageToVideoPipeline")
EXPERTS = ("transformer", "transformer_2")        # high-noise, low-noise (A14B); one-expert releases: the first
EXPERT_NAMES = {"high_noise": "transformer", "low_noise": "transformer_2"}
VAE_CLASS = "AutoencoderKLWan"
# I2V transformers take [noisy latent ; 4 mask channels ; condition latent] per voxel
I2V_MASK_CHANNELS = 4


@dataclass(frozen=True)
class WanFolder:
    path: Path
    pipeline: str                       # model_index.json's _class_name
    experts: tuple[str, ...]            # transformer subfolders present, high-noise first
    boundary_ratio: float | None        # A14B: the experts' boundary, as a fraction of the timesteps
    expand_timesteps: bool              # Wan 2.2 TI2V: per-token timesteps, the first frame at 0
    flow_shift: float | None            # the scheduler's
    num_train_timesteps: int            # the scheduler's (1000): the transformer's timestep scale
    transformer: WanConfig              # of `experts[0]` (every expert has the same architecture)
    vae: dict                           # vae/config.json
    text_dim: int | None                # d_model of text_encoder/ (None: the folder has none)
    image_encoder: dict | None = None   # image_encoder/config.json (CLIPVisionModel; Wan 2.1 I2V only)

    @property
    def image_rows(self) -> int | None:
        """CLIP rows per image (its patches and the class token; the penultimate hidden states Wan's
        I2V pipeline takes), None without an image encoder."""
        if self.image_encoder is None:
            return None
        return (self.image_encoder["image_size"] // self.image_encoder["patch_size"]) ** 2 + 1

    @property
    def latent_channels(self) -> int:
        return int(self.vae["z_dim"])

    @property
    def derived_conditioning(self) -> str:
        """The conditioning the release was trained for (see the module docstring)."""
        if self.transformer.in_channels == 2 * self.latent_channels + I2V_MASK_CHANNELS:
            return "i2v"
        return "ti2v" if self.expand_timesteps else "t2v"

    def expert_dir(self, name: str) -> Path:
        return self.path / name

    @property
    def text_encoder_dir(self) -> Path:
        return self.path / "text_encoder"

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    @property
    def vae_dir(self) -> Path:
        return self.path / "vae"

    @property
    def image_encoder_dir(self) -> Path:
        return self.path / "image_encoder"

    @property
    def image_processor_dir(self) -> Path:
        return self.path / "image_processor"


def missing_weights(folder: WanFolder, name: str) -> str | None:
    """What is missing of expert `name`'s weight files (None: every file is there; their tensors are
    checked by `pan check`'s headers and the run's strict load): no `diffusion_pytorch_model.safetensors`
    and no shard index, an index that cannot be read, or shards the index names that are absent."""
    where = folder.expert_dir(name)
    try:
        files = weight_files(where)
    except FileNotFoundError:
        return (f"{where}/ holds no weights: neither {WEIGHTS_NAME} nor a shard index {WEIGHTS_INDEX_NAME} "
                f"(files there: {', '.join(sorted(p.name for p in where.iterdir())) or 'none'})")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{where / WEIGHTS_INDEX_NAME} cannot be read as a safetensors shard index ({type(e).__name__}: {e})"
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        return (f"{where}/ lacks {len(absent)} of the {len(files)} shard files its {WEIGHTS_INDEX_NAME} names "
                f"({', '.join(absent[:3])}{', ...' if len(absent) > 3 else ''})")
    return None


def _json(path: Path, what: str) -> dict:
    require(path.is_file(), "model_path", f"{path} is missing: {what}. Point model_path at a complete diffusers "
                                          "Wan folder (e.g. Wan2.1-T2V-1.3B-Diffusers, downloaded whole).")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError("model_path", f"{path} cannot be read as JSON ({e}): download the folder again.") from None
    require(isinstance(data, dict), "model_path", f"{path} is not a JSON object: download the folder again.")
    return data


def read_folder(path: str | Path | None) -> WanFolder:
    """The folder at `path`, checked (ConfigError on `model_path`); cached per path."""
    require(path is not None, "model_path", "is required: set it to a local diffusers Wan folder (model_index.json, "
                                            "transformer/, vae/, text_encoder/, tokenizer/, scheduler/), e.g. "
                                            "Wan2.1-T2V-1.3B-Diffusers. Nothing is downloaded.")
    return _read_folder(Path(path).expanduser().resolve())


@functools.lru_cache(maxsize=8)
def _read_folder(path: Path) -> WanFolder:
    require(path.is_dir(), "model_path", f"{path} is not a folder: point model_path at a local diffusers Wan folder.")
    index = _json(path / "model_index.json", "a diffusers pipeline folder starts with model_index.json")
    pipeline = index.get("_class_name")
    require(pipeline in PIPELINES, "model_path",
            f"{path} holds a {pipeline}, not a Wan text/image-to-video pipeline ({' or '.join(PIPELINES)}): "
            "use a Wan 2.1 / 2.2 T2V, I2V or TI2V diffusers folder (VACE and Animate are not trained here).")
    experts = tuple(name for name in EXPERTS if _listed(index, name))
    require(experts[:1] == ("transformer",), "model_path",
            f"{path}/model_index.json lists no `transformer`: the recipe trains the folder's transformer(s); "
            "use a folder that holds one.")
    boundary = index.get("boundary_ratio")
    if len(experts) == 2:
        require(boundary is not None and 0 < boundary < 1, "model_path",
                f"{path} holds transformer and transformer_2 but its model_index.json has boundary_ratio "
                f"{boundary}: the experts' boundary is needed (Wan 2.2 A14B: 0.875 for T2V, 0.9 for I2V). "
                "Fix model_index.json or download the folder again.")
    configs = []
    for name in experts:
        require((path / name / "config.json").is_file(), "model_path",
                f"{path}/{name}/config.json is missing: model_index.json lists {name}. Download the folder whole.")
        try:
            configs.append(load_config(path / name))
        except ConfigError as e:
            raise ConfigError("model_path", f"{path}/{name}/config.json does not describe a Wan transformer: "
                                            f"{e}") from None
    if len(configs) == 2:
        mine = ("patch_size", "in_channels", "out_channels", "text_dim")
        differ = [k for k in mine if getattr(configs[0], k) != getattr(configs[1], k)]
        require(not differ, "model_path", f"{path}: transformer and transformer_2 differ in {', '.join(differ)}; "
                                          "the two experts of a release take the same inputs. Check the folder.")
    vae = _json(path / "vae" / "config.json", "the folder's AutoencoderKLWan (vae/config.json + weights)")
    require(vae.get("_class_name", VAE_CLASS) == VAE_CLASS, "model_path",
            f"{path}/vae holds a {vae.get('_class_name')}, not an {VAE_CLASS}: use a Wan folder.")
    transformer = configs[0]
    z = int(vae.get("z_dim", 16))
    require(transformer.output_channels == z, "model_path",
            f"{path}: the transformer predicts {transformer.output_channels} latent channels but the VAE's z_dim "
            f"is {z}; the two come from different releases. Use one release's folder.")
    scheduler = {}
    if (path / "scheduler" / "scheduler_config.json").is_file():
        scheduler = _json(path / "scheduler" / "scheduler_config.json", "the scheduler")
    text_dim = None
    if (path / "text_encoder" / "config.json").is_file():
        text = _json(path / "text_encoder" / "config.json", "the umT5 text encoder")
        text_dim = text.get("d_model")
        require(text_dim == transformer.text_dim, "model_path",
                f"{path}: the text encoder gives {text_dim}-wide features but the transformer takes text_dim "
                f"{transformer.text_dim}. Use one release's folder.")
    return WanFolder(path=path, pipeline=pipeline, experts=experts, boundary_ratio=boundary,
                     expand_timesteps=bool(index.get("expand_timesteps", False)),
                     flow_shift=scheduler.get("flow_shift", scheduler.get("shift")),
                     num_train_timesteps=int(scheduler.get("num_train_timesteps", 1000)),
                     transformer=transformer, vae=vae, text_dim=text_dim,
                     image_encoder=_image_encoder(path, transformer))


def _image_encoder(path: Path, transformer: WanConfig) -> dict | None:
    """image_encoder/config.json (its vision config) where the transformer takes CLIP image rows."""
    if transformer.image_dim is None:
        return None
    for sub, what in (("image_encoder", "config.json"), ("image_processor", "preprocessor_config.json")):
        require((path / sub / what).is_file(), "model_path",
                f"{path}/{sub}/{what} is missing: the transformer takes CLIP image features (image_dim "
                f"{transformer.image_dim}), which the folder's image encoder makes. Download the folder whole.")
    _json(path / "image_encoder" / "config.json", "the CLIP image encoder")
    from transformers import CLIPVisionConfig   # its defaults fill what config.json leaves out

    try:
        vision = CLIPVisionConfig.from_pretrained(str(path / "image_encoder"), local_files_only=True).to_dict()
    except (OSError, ValueError) as e:
        raise ConfigError("model_path", f"{path}/image_encoder/config.json is not a CLIP vision config ({e}): "
                                        "download the folder again.") from None
    require(vision.get("hidden_size") == transformer.image_dim, "model_path",
            f"{path}: the image encoder gives {vision.get('hidden_size')}-wide features but the transformer "
            f"takes image_dim {transformer.image_dim}. Use one release's folder.")
    return vision


def _listed(index: dict, name: str) -> bool:
    """Whether model_index.json lists component `name` (diffusers writes [null, null] for an absent one)."""
    entry = index.get(name)
    return isinstance(entry, list) and len(entry) == 2 and entry[0] is not None and entry[1] is not None
